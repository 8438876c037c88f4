"""The block-scaled presets compose with the rest of jaxmp: dynamic loss scaling (a non-finite
step is skipped and leaves params, masters and moments bitwise unchanged), float32 masters, a
lean recipe (param remainders: bitwise the float32-master run), the ZeRO and FSDP layouts on 8
simulated devices (the sharded step equals the replicated one, to test_layouts' tolerances) and
an orbax checkpoint (the resumed run is bitwise the uninterrupted one).

The conformance matrix (tests/cross/test_conformance.py) already runs every preset, the block
ones included, through every front door and model library; these are the step-level pieces it
leaves to the step matrix, which runs no fp8 preset."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import lean
from tests._support._arrays import leaf_bytes

pytestmark = pytest.mark.standard_promotion(reason="optax.adamw bias correction: Python float ** int32 count")

BF16 = jnp.bfloat16
N, BATCH = 8, 32
BLOCK_PRESETS = ("O2-mxfp8", "O2-fp8-rowwise", "O2-fp8-block128", "O2-nvfp4")
# The loss-scaling bookkeeping: the only leaves a skipped step may change.
BOOKKEEPING = frozenset({"loss_scale", "counter", "last_step_finite", "consecutive_skips", "total_skips",
                         "skip_reason"})


def _params():
    rng = np.random.default_rng(0)
    return {"w1": jnp.asarray(rng.normal(size=(16, 64)) / 4, BF16), "b1": jnp.zeros(64, BF16),
            "w2": jnp.asarray(rng.normal(size=(64, 8)) / 8, BF16)}


def _plain_loss(p, b):
    h = jnp.tanh(b["x"].astype(p["w1"].dtype) @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)


def _batches(steps, poisoned=()):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(steps, BATCH, 16)).astype(np.float32)
    y = rng.normal(size=(steps, BATCH, 8)).astype(np.float32)
    for t in poisoned:
        x[t, 5, 3] = np.inf
    return [{"x": x[t], "y": y[t]} for t in range(steps)]


def _tx(inner=None, masters=True):
    inner = optax.adamw(1e-2) if inner is None else inner
    return jaxmp.loss_scaling(inner, jaxmp.DynamicLossScale(2.0**15, period=8), master_weights=masters)


@functools.cache
def _step(preset, key="masters"):
    tx = {"masters": _tx, "remainders": lambda: _tx(lean.preset("remainders", optax.adamw(1e-2)), masters=False),
          "fp32-masters": lambda: _tx(lean.preset("fp32-masters", optax.adamw(1e-2)), masters=False)}[key]()
    loss = jaxmp.autocast(_plain_loss, preset)

    @jax.jit
    def step(p, s, b):
        value, g = jaxmp.value_and_grad(loss, s)(p, b)
        u, s = tx.update(g, s, p)
        return jaxmp.apply_updates(p, u, s), s, value

    return tx, step


def _run(preset, batches, key="masters", state=None):
    tx, step = _step(preset, key)
    p, s = state if state is not None else (_params(), tx.init(_params()))
    losses = []
    for b in batches:
        p, s, value = step(p, s, b)
        losses.append(float(value))
    return p, s, losses


def _unbooked(tree) -> list[bytes]:
    """The bytes of each leaf of ``tree`` but the loss-scaling bookkeeping."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    kept = [x for path, x in leaves if not {getattr(k, "name", getattr(k, "key", None)) for k in path} & BOOKKEEPING]
    assert kept
    return leaf_bytes(kept)


def _check_skip(preset):
    p1, s1, _ = _run(preset, _batches(1))
    assert leaf_bytes(p1) != leaf_bytes(_params())  # the normal step moved the params
    master = jaxmp.master_params(s1)["w1"]
    assert master.dtype == jnp.float32 and p1["w1"].dtype == BF16  # bf16 params, float32 masters
    p2, s2, losses = _run(preset, _batches(2, poisoned=(1,))[1:], state=(p1, s1))
    # The inf's block decodes to NaN, through every layer to the loss (a ragged 1x128 block of a
    # 64-wide layer once lost it: tests/formats/test_block_scaled.py::test_a_nan_in_a_ragged_block_...).
    assert not np.isfinite(losses[0])
    stats = jaxmp.scaling_stats(s2)
    assert int(stats["total_skips"]) == 1 and float(stats["loss_scale"]) == 2.0**14  # halved
    assert leaf_bytes(p2) == leaf_bytes(p1)
    assert _unbooked(s2) == _unbooked(s1)  # masters, moments and the step count: bitwise unchanged


def test_mxfp8_under_dynamic_loss_scaling_skips_a_non_finite_step_bitwise():
    _check_skip("O2-mxfp8")


@pytest.mark.slow  # a compile per preset
@pytest.mark.parametrize("preset", ["O2-fp8-rowwise", "O2-fp8-block128", "O2-nvfp4"])
def test_each_block_preset_under_dynamic_loss_scaling_skips_a_non_finite_step_bitwise(preset):
    _check_skip(preset)


@pytest.mark.slow  # two compiles and 6 steps
def test_nvfp4_with_param_remainders_is_bitwise_the_float32_master_run():
    # lean's "remainders" stores the float32 master as the bf16 param plus 16 bits: under NVFP4
    # (stochastic rounding and all) it must still train bit for bit like the float32 masters.
    batches = _batches(6, poisoned=(3,))
    p_ref, s_ref, loss_ref = _run("O2-nvfp4", batches, "fp32-masters")
    p, s, losses = _run("O2-nvfp4", batches, "remainders")
    np.testing.assert_array_equal(losses, loss_ref)
    assert leaf_bytes(p) == leaf_bytes(p_ref)
    assert int(jaxmp.scaling_stats(s)["total_skips"]) == 1


@pytest.mark.slow  # orbax's first save and restore: seconds
def test_an_orbax_checkpoint_under_nvfp4_resumes_bitwise(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    batches = _batches(6, poisoned=(4,))
    p_all, s_all, _ = _run("O2-nvfp4", batches)
    p_half, s_half, _ = _run("O2-nvfp4", batches[:3])
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": p_half, "opt_state": s_half})
        ckpt.wait_until_finished()
        target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, {"params": p_half, "opt_state": s_half})
        restored = ckpt.restore(tmp_path / "ckpt", target)
    assert leaf_bytes(restored) == leaf_bytes({"params": p_half, "opt_state": s_half})
    p_res, s_res, _ = _run("O2-nvfp4", batches[3:], state=(restored["params"], restored["opt_state"]))
    assert leaf_bytes(p_res) == leaf_bytes(p_all) and leaf_bytes(s_res) == leaf_bytes(s_all)
    assert int(jaxmp.scaling_stats(s_all)["total_skips"]) == 1


# ----------------------------------------------------------------------------- ZeRO and FSDP

#: As tests/parallel/test_layouts.py: XLA:CPU from JAX 0.12 contracts a slice's AdamW update
#: differently from the whole array's, so ZeRO is bitwise only up to JAX 0.11.
BITWISE_SLICES = jax.__version_info__ < (0, 12)
SHARDED_STEPS = 4
SHARDED_POISON = (2,)


@functools.cache
def _sharded_step(preset, layout):
    tx = _tx()
    mesh = jaxmp.parallel.make_data_mesh()
    step = jaxmp.parallel.make_sharded_train_step(jaxmp.autocast(_plain_loss, preset), tx, mesh, layout=layout,
                                                  min_shard_size=0)
    return tx, step


def _run_sharded(preset, layout, steps=SHARDED_STEPS):
    tx, step = _sharded_step(preset, layout)
    p, s = jaxmp.parallel.shard_state((_params(), tx.init(_params())), step.mesh, layout, min_shard_size=0)
    finite, losses = [], []
    for b in _batches(SHARDED_STEPS, SHARDED_POISON)[:steps]:
        p, s, m = step(p, s, jaxmp.parallel.make_global_batch(b, step.mesh))
        finite.append(bool(m["last_step_finite"]))
        losses.append(float(m["loss"]))
    return p, s, finite, np.asarray(losses)


@pytest.mark.slow  # two sharded compiles per preset
@pytest.mark.parametrize("preset", ["O2-mxfp8", "O2-nvfp4"])
def test_zero_under_a_block_preset_trains_as_the_replicated_state(preset):
    p_ref, s_ref, finite_ref, loss_ref = _run_sharded(preset, "replicated")
    p, s, finite, losses = _run_sharded(preset, "zero")
    assert finite == finite_ref == [t not in SHARDED_POISON for t in range(SHARDED_STEPS)]
    if BITWISE_SLICES:
        np.testing.assert_array_equal(losses, loss_ref)
        assert leaf_bytes(p) == leaf_bytes(p_ref) and leaf_bytes(s) == leaf_bytes(s_ref)
    else:
        np.testing.assert_allclose(losses, loss_ref, rtol=1e-3)
    assert jaxmp.master_params(s)["w1"].addressable_shards[0].data.shape == (16, 64 // N)  # it did shard


@pytest.mark.slow  # two sharded compiles per preset
@pytest.mark.parametrize("preset", ["O2-mxfp8", "O2-nvfp4"])
def test_fsdp_under_a_block_preset_one_step_within_ulps_and_the_same_skips(preset):
    # One step from identical state: each param within 2 bf16 ulps of the replicated step (the
    # reduce-scatter sums in another order; the quantized forward sees the same bits).
    one_ref = _run_sharded(preset, "replicated", steps=1)[0]
    one = _run_sharded(preset, "fsdp", steps=1)[0]
    for k in one_ref:
        a, b = np.asarray(one_ref[k], np.float32), np.asarray(one[k], np.float32)
        ulp = np.abs(np.asarray(jnp.nextafter(one_ref[k], jnp.asarray(np.inf, BF16)), np.float32) - a)
        assert np.all(np.abs(a - b) <= 2 * ulp), k
    _, _, finite_ref, loss_ref = _run_sharded(preset, "replicated")
    p, _, finite, losses = _run_sharded(preset, "fsdp")
    assert finite == finite_ref and not all(finite)
    ok = np.isfinite(loss_ref)
    np.testing.assert_allclose(losses[ok], loss_ref[ok], rtol=1e-2)
    assert p["w1"].addressable_shards[0].data.shape == (16, 64 // N)  # the params themselves sharded
