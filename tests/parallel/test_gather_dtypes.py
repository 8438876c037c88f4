"""ZeRO and FSDP gather bfloat16 params as bfloat16: half the wire bytes of gathering the float32
masters and casting after (what a hand-written ZeRO step compiles to).

Read from the program XLA has after SPMD partitioning and before XLA:CPU's
``float-normalization-bf16`` pass, which widens every bf16 collective to float32 on the CPU (the
final CPU HLO shows float32 gathers for both). The compile option ``xla_dump_hlo_pass_re`` dumps
that program in-process on every JAX of the matrix (jaxmp/engine/_tested.py).
"""

import collections
import glob
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

pytestmark = pytest.mark.standard_promotion(reason='optax.adamw bias correction: Python float ** int32 count')

BF16 = jnp.bfloat16
WIDTH = 128   # 128 x 128 weights: sharded over 8 devices (min_shard_size 1024)
LAYERS = 2


def _gathers(lowered) -> collections.Counter:
    """Elements all-gathered per dtype, in the program just before float-normalization-bf16."""
    with tempfile.TemporaryDirectory() as d:
        lowered.compile(compiler_options={"xla_dump_to": d, "xla_dump_hlo_pass_re": "float-normalization-bf16"})
        (path,) = glob.glob(d + "/*before_float-normalization-bf16.txt")
        text = open(path).read()
    counts: collections.Counter = collections.Counter()
    for dtype, dims in re.findall(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^ ]* all-gather(?:-start)?\(", text):
        counts[dtype] += int(np.prod([int(x) for x in dims.split(",") if x]))
    return counts


def _loss(p, b):
    x = b["x"]
    for i in range(LAYERS):
        x = jnp.tanh((x.astype(BF16) @ p[f"w{i}"]).astype(jnp.float32))
    return jnp.mean(x ** 2)


def _setup():
    mesh = jaxmp.parallel.make_data_mesh()
    params = {f"w{i}": jnp.zeros((WIDTH, WIDTH), BF16) for i in range(LAYERS)}
    batch = jaxmp.parallel.make_global_batch({"x": np.ones((16, WIDTH), np.float32)}, mesh)
    return mesh, params, batch


@pytest.fixture(scope="module")
def hand_written_zero() -> collections.Counter:
    """The gathers of a hand-written ZeRO step, lowered once for both layouts' tests.

    What a user writes: bf16 params replicated, float32 masters and AdamW state on slices, the
    new params cast from the updated masters and replicated (XLA gathers the float32 master)."""
    from benchmarks import _gpt2

    mesh, params, batch = _setup()
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    jitted, (p, m, o) = _gpt2.hand_written_step(_loss, abstract, mesh, "zero", None)
    return _gathers(jitted.lower(p, m, o, batch))


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
