"""The unscaling folded out of the inner chain's reductions (jaxmp._scaling._fold): same numbers, fewer passes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp._scaling import _fold as fold
from jaxmp._scaling._transform import update_and_apply

# The folded chains are optax's (adamw, clip_by_global_norm): adamw's bias correction is a
# Python float ** int32 count, which strict promotion refuses.
pytestmark = pytest.mark.standard_promotion(reason="optax.adamw bias correction: Python float ** int32 count")


def _inner():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-3))


@pytest.fixture(scope="module")
def drawn_params():
    """One jitted draw, made once for this module (eagerly, the split and each normal compile a
    program of their own); the same values as the eager draw: the 1e-7 comparison below is made
    on them."""
    @jax.jit
    def draw():
        k1, k2 = jax.random.split(jax.random.PRNGKey(0))
        return {"w": jax.random.normal(k1, (33, 7)), "b": jax.random.normal(k2, (7,))}

    return draw()


@pytest.fixture(scope="module")
def traced(drawn_params):
    """The inner chain's update of unscaled gradients, traced once: the scale is an argument."""
    tx = _inner()
    params = drawn_params
    state = tx.init(params)

    def f(g, s):
        return tx.update(jax.tree_util.tree_map(lambda x: x * (1.0 / s), g), state, params)

    return jax.make_jaxpr(f)(params, jnp.float32(1.0)), params


@pytest.fixture(scope="module")
def folded_and_plain(traced):
    """The folded and the plain evaluation of ``traced``, each compiled once for every scale."""
    closed, _ = traced
    return (jax.jit(lambda *a: fold.eval_folded(closed, a, [2])),
            jax.jit(lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a)))


def _rewrites(closed, scale_positions) -> bool:
    """Whether `fold.eval_folded` rewrites ``closed``: its traced program differs from the plain
    evaluation's (with nothing to fold it is ``eval_jaxpr`` itself)."""
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    folded = jax.make_jaxpr(lambda *a: fold.eval_folded(closed, a, scale_positions))(*args)
    plain = jax.make_jaxpr(lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a))(*args)
    return str(folded) != str(plain)


def test_global_norm_is_found_and_folded(traced):
    closed, _ = traced
    assert _rewrites(closed, [2])  # invars: w, b (sorted: b, w), then the scale
    assert not _rewrites(closed, [])


@pytest.mark.parametrize("scale", [2.0**15, 2.0**-3, 1.0])
def test_power_of_two_scale_is_bitwise_the_unfolded_update(traced, folded_and_plain, scale):
    _, params = traced
    grads = jax.tree_util.tree_map(lambda p: np.asarray(p) * np.float32(3.0 * scale), params)
    args = [*jax.tree_util.tree_leaves(grads), np.float32(scale)]
    folded_fn, plain_fn = folded_and_plain
    folded, plain = folded_fn(*args), plain_fn(*args)
    for a, b in zip(folded, plain):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # ~4 s; the power-of-two cases stay in the default tier
def test_other_scale_agrees_within_rounding(traced):
    closed, params = traced
    grads = jax.tree_util.tree_map(lambda p: p * 3000.0, params)
    args = [*jax.tree_util.tree_leaves(grads), jnp.float32(1000.0)]
    folded = fold.eval_folded(closed, args, [2])
    plain = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    for a, b in zip(folded, plain):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


def test_folding_adds_no_pass_over_the_gradients():
    # What the fold is for: the global norm's sum of squares reads the scaled gradients in its
    # own pass, so the unscaled gradients are never written out for it (XLA's bytes accessed).
    # (256x256: at the toy sizes above XLA keeps the reductions apart on both sides.)
    tx = _inner()
    params = {"w": jnp.ones((256, 256)), "b": jnp.ones(256)}
    state = tx.init(params)
    closed = jax.make_jaxpr(lambda g, s: tx.update(jax.tree_util.tree_map(lambda x: x * (1.0 / s), g), state,
                                                   params))(params, jnp.float32(4.0))
    args = [*jax.tree_util.tree_leaves(params), jnp.float32(2.0**15)]

    def bytes_accessed(fn):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        return (cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"]

    folded = bytes_accessed(lambda *a: fold.eval_folded(closed, a, [2]))
    plain = bytes_accessed(lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a))
    # 256x256 float32 is 262,144 bytes: the fold saves a write and a read of it (give or take
    # a few scalars, which differ between XLA versions).
    assert plain - folded >= 2 * 256 * 256 * 4 - 256, (folded, plain)


@pytest.mark.xfail(strict=True, reason="known limit of the fold: sum(g**2) of the *scaled* gradients overflows "
                   "float32 first; the exact forms tried cost XLA:CPU a pass (see the session note)")
def test_a_gradient_whose_scaled_square_overflows_is_clipped_as_optax_clips_it():
    # |g| * scale = 3e19: its square leaves float32's range. Evaluated as sum(g**2) / scale**2,
    # the norm is inf and clip_by_global_norm zeroes the update of a finite step.
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    params = {"w": jnp.ones(4)}
    loss = lambda p: jnp.sum(p["w"] * 1e15)  # noqa: E731 - true gradient 1e15 per element, norm 2e15
    want = optax.apply_updates(params, inner.update(jax.grad(loss)(params), inner.init(params), params)[0])
    tx = jaxmp.loss_scaling(inner, "dynamic")
    state = tx.init(params)
    _, g = jaxmp.value_and_grad(loss, state)(params)
    new, state = jax.jit(lambda g, s, p: update_and_apply(tx, g, s, p))(g, state, params)
    assert bool(state.last_step_finite)
    np.testing.assert_allclose(new["w"], want["w"], rtol=1e-6)
    np.testing.assert_allclose(new["w"], 0.5, rtol=1e-6)


def test_folded_norm_of_zero_gradients_is_zero_at_a_tiny_scale():
    # 1/scale**2 overflows float32 for scale <= 2**-64: the factor is applied one 1/scale at a
    # time, so a zero sum of squares stays 0 (0 * inf would be NaN).
    closed = jax.make_jaxpr(lambda g, s: jnp.sum(jnp.square(g * (1.0 / s))))(jnp.ones(3), jnp.float32(2.0))
    out = jax.jit(lambda g, s: fold.eval_folded(closed, [g, s], [1])[0])(jnp.zeros(3), jnp.float32(2.0**-70))
    assert float(out) == 0.0


@pytest.mark.parametrize("scale", ["torch-after-overflows", 2.0**-64, 2.0**-70, 2.0**-126])
def test_scale_below_one_clips_as_optax_clips(scale):
    # Below 1 the scaled squares underflow (XLA:CPU flushes subnormals): 4 * (2 * 2**-70)**2 is 0,
    # so a folded norm would leave the step unclipped (4x too large) -- or, with 1/scale**2, NaN.
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    params = {"w": jnp.ones(4)}
    want = jax.jit(inner.update)({"w": jnp.full(4, 2.0)}, inner.init(params), params)[0]["w"]  # norm 4, clipped to 1
    if scale == "torch-after-overflows":
        tx = jaxmp.loss_scaling(inner, "torch")
        state = tx.init(params)
        ls = dataclasses.replace(state.loss_scale, loss_scale=jnp.float32(2.0**-70))
        state = state._replace(loss_scale=ls)
    else:
        tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(scale))
        state = tx.init(params)
    _, g = jaxmp.value_and_grad(lambda p: jnp.sum(p["w"] * 2.0), state)(params)
    new, state = jax.jit(lambda g, s, p: update_and_apply(tx, g, s, p))(g, state, params)
    assert bool(state.last_step_finite)
    np.testing.assert_array_equal(np.asarray(new["w"]), np.asarray(params["w"]) + np.asarray(want))


def test_half_precision_reductions_are_not_rewritten():
    def f(g, s):
        u = (g * (1.0 / s)).astype(jnp.bfloat16)
        return jnp.sum(jnp.square(u))

    closed = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.float32(2.0))
    assert not _rewrites(closed, [1])


def test_max_norm_is_folded_with_positive_scale():
    def f(g, s):
        return jnp.max(jnp.abs(g * (1.0 / s)))

    closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.float32(2.0))
    assert _rewrites(closed, [1])
    g = jnp.array([-8.0, 2.0, 4.0])
    assert float(fold.eval_folded(closed, [g, jnp.float32(4.0)], [1])[0]) == 2.0


def test_loss_scaling_step_equals_unscale_then_optax(drawn_params):
    """The whole wrapper (clip + AdamW, dynamic scale 2**15) steps exactly as optax on unscaled gradients."""
    params = drawn_params
    tx = jaxmp.loss_scaling(_inner(), jaxmp.DynamicLossScale())
    ref = _inner()
    state, ref_state = tx.init(params), ref.init(params)
    scale = float(jaxmp.get_loss_scale(state).loss_scale)
    # numpy arithmetic for the inputs and the reference apply: no eager programs
    grads = jax.tree_util.tree_map(lambda p: np.asarray(p) * np.float32(5.0), params)
    with pytest.warns(jaxmp.MixedPrecisionWarning):  # the gradients were scaled by hand
        new, _ = jax.jit(lambda g, s, p: update_and_apply(tx, g, s, p))(
            jax.tree_util.tree_map(lambda g: g * np.float32(scale), grads), state, params)
    u, _ = jax.jit(ref.update)(grads, ref_state, params)
    want = jax.tree_util.tree_map(lambda p, u: np.asarray(p) + np.asarray(u), params, u)  # optax.apply_updates
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)
