"""Precision on the wire composed with the rest of jaxmp (issue 63): every lean recipe, the fp8 and
block-scaled presets, the Flax Linen and NNX wrappers, and a jaxmp.parallel.Checkpointer of a state
trained with the options, under ZeRO and FSDP on 8 simulated devices.

The options are generated from what exists (``_wire.GATHER_BITS`` x ``_wire.REDUCE_BITS``). Each
composed run is held to the same run without the options: finite, the final loss within the
fidelity tolerance of tests/parallel/test_wire_gathers.py, and the same state (structure, shapes,
dtypes: nothing of the wire is kept). ZeRO's quantized gather needs a float32 master (its params
are the gathered copy); a recipe without one is refused by name. The full crosses are in the slow
tier; the default tier runs the checkpoint under FSDP (the fix of the mixed_precision LM is held
in the default tier by tests/engine/test_custom_derivatives.py, here in the slow one).
"""

from __future__ import annotations

import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.flax
from jaxmp import lean
from jaxmp.parallel import _wire
from tests._support import _wire as W
from tests._support._arrays import leaf_bytes

pytestmark = [pytest.mark.standard_promotion(reason="optax.adamw bias correction: Python float ** int32 count"),
              pytest.mark.filterwarnings("ignore::jaxmp.MixedPrecisionWarning")]

FIDELITY_RTOL = 0.03  # as tests/parallel/test_wire_gathers.py's
STEPS = 4
WIRE = [{k: v for k, v in (("gather_bits", g), ("reduce_bits", r)) if v is not None}
        for g in (None, *_wire.GATHER_BITS) for r in (None, *_wire.REDUCE_BITS) if (g, r) != (None, None)]
WIRE_IDS = ["-".join(f"{k.split('_')[0]}{v}" for k, v in w.items()) for w in WIRE]
ALL = WIRE[-1]  # the quantized gather and the narrowest reduction at once
MASTER = r"gather_bits under layout='zero' .*master_weights=True"


def _train(loss, tx, params, layout, opts, steps=STEPS, batch=None):
    mesh = jaxmp.parallel.make_data_mesh()
    step = jaxmp.parallel.make_sharded_train_step(loss, tx, mesh, layout=layout, **opts)
    p, s = jaxmp.parallel.shard_state((params, tx.init(params)), step.layout)
    x, y = W.data(steps, nan_step=None)
    losses = []
    for t in range(steps):
        b = batch(t) if batch is not None else {"x": x[t], "y": y[t]}
        p, s, m = step(p, s, jaxmp.parallel.make_global_batch(b, mesh))
        losses.append(float(m["loss"]))
    return p, s, np.asarray(losses), step


def _state_spec(tree):
    return [(tuple(a.shape), a.dtype) for a in jax.tree_util.tree_leaves(tree)]


def _close_to_plain(quant, plain):
    assert np.isfinite(quant[2]).all()
    assert _state_spec(quant[:2]) == _state_spec(plain[:2])  # no codes of the wire in the state
    np.testing.assert_allclose(quant[2][-1], plain[2][-1], rtol=FIDELITY_RTOL)


# ----------------------------------------------------------------------------- lean recipes


def _lean_tx(name):
    return jaxmp.loss_scaling(lean.preset(name, optax.adamw(1e-2), key=0), "none")


@functools.cache
def _lean_run(name, layout, wire_items):
    return _train(W.loss, _lean_tx(name), W.params(), layout, dict(wire_items))


def _has_master(name):
    return "masters" in name  # "fp32-masters", "masters-bf16-moments": lean's master_weights


# The full crosses compile hundreds of programs: one XLA:CPU compile segfaulted in the 100-cell
# lean cross during a full two-tier run (jax 0.10.2), and together they cost CI tens of minutes.
# They run on request; the slow tier keeps the cells with every option at once.
FULL_CROSS = pytest.mark.skipif(not os.environ.get("JAXMP_WIRE_FULL_CROSS"),
                                reason="a full wire cross: run it with JAXMP_WIRE_FULL_CROSS=1")


LEAN_CELLS = [(name, layout, w) for name in lean.PRESETS for layout in ("zero", "fsdp") for w in WIRE]
LEAN_IDS = [f"{n}-{layout}-{i}" for n, layout, w in LEAN_CELLS for i in [WIRE_IDS[WIRE.index(w)]]]


def _check_lean(name, layout, wire):
    if layout == "zero" and "gather_bits" in wire and not _has_master(name):
        with pytest.raises(ValueError, match=MASTER):
            _lean_run(name, layout, tuple(sorted(wire.items())))
        return
    _close_to_plain(_lean_run(name, layout, tuple(sorted(wire.items()))), _lean_run(name, layout, ()))


def test_every_lean_recipe_is_in_the_cross():
    assert {c[0] for c in LEAN_CELLS} == set(lean.PRESETS) and len(LEAN_CELLS) == len(lean.PRESETS) * 2 * len(WIRE)
    assert any(_has_master(n) for n in lean.PRESETS) and not all(_has_master(n) for n in lean.PRESETS)


@pytest.mark.slow  # two compiles each (about 30 s on 2 loaded cores)
@pytest.mark.parametrize("name,layout", [("remainders-4bit", "fsdp"), ("masters-bf16-moments", "zero"),
                                         ("bf16-sr-8bit", "zero")])
def test_a_lean_recipe_composes_with_every_option_at_once(name, layout):
    # 4-bit moments (blocks inside each device's slice) under FSDP; bf16 moments under a float32
    # master under ZeRO; and a recipe without a master, which ZeRO's quantized gather refuses.
    _check_lean(name, layout, ALL)


@pytest.mark.slow
@FULL_CROSS
@pytest.mark.parametrize("name,layout,wire", LEAN_CELLS, ids=LEAN_IDS)
def test_each_lean_recipe_composes_with_each_wire_option(name, layout, wire):
    _check_lean(name, layout, wire)


# ----------------------------------------------------------------------------- fp8 and block presets

FP8_PRESETS = ("O2-fp8-current", "O2-mxfp8", "O2-nvfp4")


@functools.cache
def _preset_run(preset, layout, wire_items):
    tx = jaxmp.loss_scaling(optax.adamw(1e-2), jaxmp.get_recipe(preset).loss_scale, master_weights=True)
    return _train(jaxmp.autocast(W.loss, preset), tx, W.params(), layout, dict(wire_items))


def _check_preset(preset, layout, wire):
    _close_to_plain(_preset_run(preset, layout, tuple(sorted(wire.items()))), _preset_run(preset, layout, ()))


@pytest.mark.slow  # two block-scaled compiles
def test_the_block_scaled_preset_composes_with_every_option_under_fsdp():
    # FSDP gathers in the loss, where the block-scaled matmul then quantizes the dequantized weight.
    _check_preset("O2-mxfp8", "fsdp", ALL)


# Measured (this file's model, 4 steps): under FSDP, O2-nvfp4 on weights gathered as 8-bit codes
# (quantized twice: 8-bit on the wire, then NVFP4 in the matmul) ends 4.4% (gather8) and 6.5%
# (gather8-reduce8) from the unquantized run's loss, past the 3% tolerance; gather8-reduce4 and
# ZeRO stay within it. Gathering straight into the matmul's format (the issue's "not quantized
# twice") is not built; until it is, these cells are expected to miss.
NVFP4_MISSES = {("O2-nvfp4", "fsdp", "gather8"), ("O2-nvfp4", "fsdp", "gather8-reduce8")}
NVFP4_TWICE = pytest.mark.xfail(reason="O2-nvfp4 x FSDP 8-bit gathers: quantized twice, 4.4-6.5% off", strict=False)


@pytest.mark.slow
@pytest.mark.parametrize("preset,layout,wire", [
    pytest.param(p, layout, w, id=f"{p}-{layout}-{i}",
                 marks=[NVFP4_TWICE] if (p, layout, i) in NVFP4_MISSES else [])
    for p in FP8_PRESETS for layout in ("zero", "fsdp") for w, i in zip(WIRE, WIRE_IDS)])
def test_each_fp8_and_block_preset_composes_with_each_wire_option(preset, layout, wire):
    _check_preset(preset, layout, wire)


# ----------------------------------------------------------------------------- Flax Linen and NNX


def _lm_run(layout, wire_items, preset="O2-bf16"):
    # benchmarks/_lm.py's causal LM (attention, LayerNorm, tied shapes) behind jaxmp.flax.mixed_precision:
    # before, its attention's custom_vjp lost its varying axis in the per-shard loss and the step
    # failed with "the manual axis types do not match", with or without the options.
    from benchmarks import _lm

    model = jaxmp.flax.mixed_precision(_lm.CausalLM(context=16, width=32, num_layers=1, num_heads=2, mlp_dim=64),
                                       preset)
    params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]

    def loss(p, b):
        logits = model.apply({"params": p}, b["inputs"]).astype(jnp.float32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["label"]))

    ids = np.random.default_rng(0).integers(0, 50, size=(STEPS, 16, 17)).astype(np.int32)
    tx = jaxmp.loss_scaling(optax.adamw(1e-2), "none", master_weights=True)
    return _train(loss, tx, params, layout, {"min_shard_size": 0, "wire_block": 32, **dict(wire_items)},
                  batch=lambda t: {"inputs": ids[t, :, :-1], "label": ids[t, :, 1:]})


@pytest.mark.slow  # two LM compiles a layout (the default tier's check of the fix: tests/engine)
@pytest.mark.parametrize("layout", ["zero", "fsdp"])
def test_the_linen_wrapped_lm_trains_in_the_sharded_step_with_every_option(layout):
    plain, quant = _lm_run(layout, ()), _lm_run(layout, tuple(sorted(ALL.items())))
    assert np.isfinite(plain[2]).all() and plain[2][-1] < plain[2][0]  # it trains
    _close_to_plain(quant, plain)
    assert quant[0]["Block_0"]["Dense_0"]["kernel"].dtype == jnp.bfloat16  # the wrapper's O2 storage


@pytest.mark.slow
@FULL_CROSS
@pytest.mark.parametrize("wire", WIRE, ids=WIRE_IDS)
@pytest.mark.parametrize("layout", ["zero", "fsdp"])
def test_the_linen_wrapped_lm_composes_with_each_wire_option(layout, wire):
    _close_to_plain(_lm_run(layout, tuple(sorted(wire.items()))), _lm_run(layout, ()))


def _nnx_run(layout, wire_items):
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(16, 512, rngs=rngs)
            self.norm = nnx.LayerNorm(512, rngs=rngs)
            self.l2 = nnx.Linear(512, 8, rngs=rngs)

        def __call__(self, x):
            return self.l2(self.norm(jax.nn.relu(self.l1(x))))

    graphdef, params = nnx.split(jaxmp.flax.mixed_precision(MLP(nnx.Rngs(0)), "O2-bf16"), nnx.Param)

    def loss(p, b):
        return jnp.mean((nnx.merge(graphdef, p)(b["x"]).astype(jnp.float32) - b["y"]) ** 2)

    tx = jaxmp.loss_scaling(optax.adamw(1e-2), "none", master_weights=True)
    return _train(loss, tx, params, layout, dict(wire_items))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero", "fsdp"])
def test_the_nnx_wrapped_model_trains_in_the_sharded_step_with_every_option(layout):
    plain, quant = _nnx_run(layout, ()), _nnx_run(layout, tuple(sorted(ALL.items())))
    _close_to_plain(quant, plain)
    kernels = [x for path, x in jax.tree_util.tree_leaves_with_path(quant[0]) if "kernel" in jax.tree_util.keystr(path)]
    assert len(kernels) == 2 and all(k.dtype == jnp.bfloat16 for k in kernels)  # the wrapper's O2 storage


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("layout", [pytest.param("zero", marks=pytest.mark.slow), "fsdp"])
def test_a_checkpoint_of_a_state_trained_with_every_option_restores_bitwise_and_holds_no_wire_codes(layout):
    # 8-bit moments under a float32 master: the state's own uint8 leaves are the moments' codes, so
    # the saved uint8 leaves must be exactly those, never a quantized copy of the gathered weights.
    def make_tx():
        return jaxmp.loss_scaling(lean.quantized_moments(optax.adamw(1e-2), bits=8, block=64, min_size=0), "none",
                                  master_weights=True)

    p, s, _, step = _train(W.loss, make_tx(), W.params(), layout, dict(ALL), steps=2)
    x, y = W.data(4, nan_step=None)

    def resume(p, s):
        for t in (2, 3):
            p, s, _ = step(p, s, jaxmp.parallel.make_global_batch({"x": x[t], "y": y[t]}, step.mesh))
        return leaf_bytes((p, s))

    target = jaxmp.parallel.abstract_state((p, s), step.layout)
    with tempfile.TemporaryDirectory() as d, jaxmp.parallel.Checkpointer() as ckpt:
        ckpt.save(f"{d}/ckpt", {"params": p, "opt_state": s})
        restored = ckpt.restore(f"{d}/ckpt", {"params": target[0], "opt_state": target[1]})
    assert leaf_bytes((restored["params"], restored["opt_state"])) == leaf_bytes((p, s))
    saved_codes = [a.shape for a in jax.tree_util.tree_leaves(restored) if a.dtype == jnp.uint8]
    own_codes = [a.shape for a in jax.tree_util.tree_leaves(s) if a.dtype == jnp.uint8]
    assert saved_codes == own_codes and own_codes  # the moments' codes, nothing of the wire
    assert not [a for a in jax.tree_util.tree_leaves(restored["params"]) if a.dtype == jnp.uint8]
    assert resume(restored["params"], restored["opt_state"]) == resume(p, s)
