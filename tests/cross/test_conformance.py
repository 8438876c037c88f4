"""The conformance matrix: every front door x every preset name x a small model of each library
x {jit, grad, vmap, scan, remat}, generated from the axes in tests/cross/_conformance.py.

Default tier (trace only, no compile): each cell traces; a refusal by design (delayed fp8 under a
plain function) is a cell that checks the refusal's message; the documented dtypes hold: the
door's output in the policy's output dtype (the loss too where it runs behind the door), every
gradient in its param's dtype, every matmul in the compute dtype (fp8 operands under the fp8
presets), and at O1 every float32-list op (exp, log, rsqrt, every reduction) in float32, backward
pass included under autocast. Every preset name runs ``grad``; the other transformations run once
per distinct recipe (aliases resolve to the same program).

Slow tier (trained): each door x library x distinct recipe trains a few steps through
``jaxmp.loss_scaling`` under ``jit``: finite, and within tolerance of the same steps in float32.
"""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.flax
from jaxmp.engine import FLOAT32_OPS
from tests._support._op_dtypes import ops_of
from tests.cross import _conformance as C

X, Y = C.data()
# fp8 and, under O2-nvfp4, fp4 (E2M1): the formats an fp8 preset quantises matmul operands to
FP8 = {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2), np.dtype(jnp.float4_e2m1fn)}


def _cells(transforms, presets):
    for door in C.DOORS:
        for library in door.libraries:
            for preset in presets:
                for transform in transforms:
                    yield pytest.param(door, library, preset, transform, id=f"{door.name}-{library}-{preset}-{transform}")


DISTINCT = C.distinct_presets()
ALIASES = tuple(p for p in C.PRESETS if p not in DISTINCT)
TRACE_CELLS = [*_cells(tuple(C.TRANSFORMS), DISTINCT), *_cells(("grad",), ALIASES)]


@pytest.fixture(autouse=True)
def _library(request):
    # Equinox and Haiku are extras: their cells skip with the extra's name when it is missing.
    library = getattr(request.node, "callspec", None) and request.node.callspec.params.get("library")
    module = C.LIBRARIES[library][0] if library else None
    if module in ("equinox", "haiku"):
        pytest.importorskip(module, reason=f"the {module} extra")
    if module is None:  # plain JAX: jaxmp and the test's own code stay strict (tests/conftest.py)
        yield
        return
    # A library's own layers mix dtypes on purpose (Flax's LayerNorm computes its statistics in
    # float32 and meets half params under O3 or hand casts): its cells run JAX's standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def _floating(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


@pytest.mark.parametrize("door,library,preset,transform", TRACE_CELLS)
def test_each_cell_traces_with_the_documented_dtypes(door, library, preset, transform):
    recipe = C.recipe(preset)
    refused = C.refusal(door, preset)
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            cell = door.build(library, preset)
            jax.eval_shape(lambda p, x, y: C.TRANSFORMS[transform](cell.loss, p, x, y, C.loss_scale(preset)),
                           cell.params, X, Y)
        return
    cell = door.build(library, preset)
    scale = C.loss_scale(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MixedPrecisionWarning)  # a cell that warns is a finding
        closed, (value, grads) = jax.make_jaxpr(
            lambda p, x, y: C.TRANSFORMS[transform](cell.loss, p, x, y, scale), return_shape=True)(cell.params, X, Y)
    ops = ops_of(closed)
    policy = recipe.policy
    assert value.shape == () and value.dtype == (policy.output_dtype if cell.loss_inside else jnp.float32)
    if grads is not None:  # gradients come back in each param's own dtype
        got = jax.tree.map(lambda g: np.dtype(g.dtype), grads)
        want = jax.tree.map(lambda p: np.dtype(p.dtype), cell.params)
        assert got == want, (got, want)
    # Every matmul in the compute dtype; under the fp8 presets its operands pass through float8
    # (a real fp8 matmul where the backend has one, quantise-dequantise on the CPU).
    dots = [op for op in ops if op.primitive == "dot_general"]
    assert dots, "the model has matmuls"
    fp8 = recipe.fp8 is not None and door.name != "policy-casts"  # a Policy is dtypes only
    for op in dots:
        assert set(op.in_dtypes) <= {np.dtype(policy.compute_dtype)} | (FP8 if fp8 else set()), op
    if fp8:
        assert any(set(op.out_dtypes) & FP8 for op in ops), "an fp8 preset quantises the matmul operands"
    # O1: the float32 list runs in float32 (under autocast in the backward pass too).
    if door.float32_list and recipe.level == "O1" and (transform in ("jit", "vmap") or door.name == "autocast"):
        half = [op for op in ops if op.primitive in FLOAT32_OPS and op.out_dtypes
                and _floating(op.out_dtypes[0]) and op.out_dtypes[0] != np.float32]
        assert not half, half


@pytest.mark.parametrize("door,library,preset", [
    pytest.param(d, lib, p, id=f"{d.name}-{lib}-{p}") for d in C.DOORS for lib in d.libraries for p in DISTINCT])
def test_the_door_returns_the_policy_output_dtype(door, library, preset):
    if C.refusal(door, preset) is not None:
        pytest.skip("refused by design (checked above)")
    cell = door.build(library, preset)
    out = jax.eval_shape(cell.output, cell.params, X)
    assert out.dtype == C.recipe(preset).policy.output_dtype


def _public_callables_taking_a_policy():
    import jaxmp.diagnostics
    import jaxmp.flax.nnx

    found = {"jaxmp.flax.nnx.call"}  # the NNX door's functional form (its module has no __all__)
    for module in (jaxmp, jaxmp.flax, jaxmp.diagnostics, jaxmp.parallel, jaxmp.lean, jaxmp.fp8):
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            try:
                params = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                continue
            if "policy" in params or "preset" in params:
                found.add(f"{module.__name__}.{name}")
    return found


def test_every_public_callable_taking_a_policy_is_a_door_of_the_matrix_or_says_why_not():
    doors = {d.api for d in C.DOORS}
    unclassified = _public_callables_taking_a_policy() - doors - set(C.NOT_DOORS)
    assert not unclassified, f"add these to tests/cross/_conformance.py DOORS (or NOT_DOORS with a reason): {unclassified}"
    assert set(C.PRESETS) == set(jaxmp._precision._presets.PRESET_NAMES)


def test_the_matrix_counts():
    # The size the closing note reports; a shrinking axis fails here.
    pairs = sum(len(d.libraries) for d in C.DOORS)
    assert pairs == 13 and len(C.TRANSFORMS) == 5
    assert len(TRACE_CELLS) == pairs * (len(DISTINCT) * len(C.TRANSFORMS) + len(ALIASES))


# -- the trained cells (slow tier) -----------------------------------------------------------

TOL = {"float32": 1e-5, "bfloat16": 0.08, "float16": 0.03}


def _train(cell, preset, steps=5):
    recipe = C.recipe(preset)
    tx = jaxmp.loss_scaling(optax.adam(1e-2), recipe.loss_scale, master_weights=recipe.master_weights)
    params = jax.tree.map(jnp.asarray, cell.params)
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jaxmp.value_and_grad(cell.loss, state)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return jaxmp.apply_updates(params, updates, state), state, loss

    losses = []
    for _ in range(steps):
        params, state, loss = step(params, state, X, Y)
        losses.append(float(loss))
    return np.array(losses), params, state


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax's Adam bias correction mixes a float with its int32 count")
@pytest.mark.parametrize("door,library,preset", [
    pytest.param(d, lib, p, id=f"{d.name}-{lib}-{p}") for d in C.DOORS for lib in d.libraries for p in DISTINCT])
def test_each_cell_trains_a_few_steps_like_float32(door, library, preset):
    if C.refusal(door, preset) is not None:
        pytest.skip("refused by design (checked in the default tier)")
    recipe = C.recipe(preset)
    losses, params, state = _train(door.build(library, preset), preset)
    reference, _, _ = _train(C.DOORS[0].build(library, "float32") if library in C.DOORS[0].libraries
                             else door.build(library, "float32"), "float32")
    # A non-finite step never reaches the params, whatever the preset (O3 included).
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree.leaves(params))
    if recipe.level == "O3":
        return  # pure half: Adam's epsilon flushes in float16, steps are skipped; the docs say it may diverge
    skipped = int(jaxmp.scaling_stats(state)["total_skips"])
    # A dynamic scale starts at 2**15 and may back off once on hand-cast float16 code.
    assert skipped <= (1 if recipe.loss_scale == "dynamic" else 0), skipped
    finite = losses[np.isfinite(losses)]  # an overflow in the backward pass leaves the loss finite
    tol = TOL[np.dtype(recipe.policy.compute_dtype).name] * (3 if recipe.fp8 is not None else 1)
    np.testing.assert_allclose(losses[0], reference[0], rtol=tol, atol=tol)  # the same params' loss
    if not skipped:
        np.testing.assert_allclose(losses, reference, rtol=tol, atol=tol)
    assert finite[-1] < finite[0]
