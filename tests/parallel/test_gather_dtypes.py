"""ZeRO and FSDP gather bfloat16 params as bfloat16: half the wire bytes of gathering the float32
masters and casting after (what a hand-written ZeRO step compiles to).

Read (benchmarks/_wire_bytes.py) from the program XLA has after SPMD partitioning and before
XLA:CPU widens bf16 collectives to float32 (``all-reduce-promotion`` the reductions,
``float-normalization-bf16`` the gathers; the final CPU HLO shows float32 gathers for both). The
compile option ``xla_dump_hlo_pass_re`` dumps that program in-process on every JAX of the matrix
(jaxmp/engine/_tested.py).
"""

import collections

import optax
import pytest

import jaxmp
from benchmarks import _zero_gathers
from benchmarks._zero_gathers import LAYERS, WIDTH, gathers as _gathers, loss as _loss, setup as _setup

pytestmark = pytest.mark.standard_promotion(reason='optax.adamw bias correction: Python float ** int32 count')


@pytest.fixture(scope="module")
def hand_written_zero() -> collections.Counter:
    """The gathers of a hand-written ZeRO step, lowered once for both layouts' tests."""
    return _zero_gathers.hand_written_zero_gathers()


@pytest.mark.parametrize("layout", ["zero", "fsdp"])
def test_sharded_layouts_gather_half_params_in_their_own_dtype(hand_written_zero, layout):
    mesh, params, batch = _setup()
    tx = jaxmp.loss_scaling(optax.adamw(1e-3), "none", master_weights=True)
    step = jaxmp.parallel.make_sharded_train_step(_loss, tx, mesh, layout=layout)
    p, s = jaxmp.parallel.shard_state((params, tx.init(params)), step.layout)
    ours = _gathers(step.lower(p, s, batch))
    hand = hand_written_zero
    per_step = LAYERS * WIDTH * WIDTH
    # The reference: the hand-written step gathers every weight as its float32 master.
    assert hand["f32"] >= per_step, hand
    # jaxmp gathers each weight once (ZeRO: the new params; FSDP: the forward's use), in bf16;
    # nothing of a weight's size crosses the wire in float32.
    assert ours["bf16"] == per_step, ours
    assert ours["f32"] < WIDTH * WIDTH, ours
    assert 2 * ours["bf16"] + 4 * ours["f32"] <= 0.55 * 4 * hand["f32"], (ours, hand)
