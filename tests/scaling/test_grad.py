"""jaxmp/_scaling/_grad.py: value_and_grad scales the loss, returns it unscaled, and refuses bad losses."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp
from jaxmp._scaling._grad import value_and_grad
from jaxmp._misuse import MixedPrecisionWarning


def _sq(w):
    return jnp.sum(w ** 2)


def test_gradients_carry_the_scale_and_the_loss_does_not():
    w = jnp.array([1.0, -2.0])
    loss, g = value_and_grad(_sq, jaxmp.StaticLossScale(8.0))(w)
    assert float(loss) == 5.0 and g.tolist() == [16.0, -32.0]
    loss, g = value_and_grad(_sq, jaxmp.NoOpLossScale())(w)
    assert float(loss) == 5.0 and g.tolist() == [2.0, -4.0]


def test_the_scale_is_read_from_an_optimizer_state_nested_anywhere():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "static:4")
    state = tx.init({"w": jnp.ones(2)})
    for source in (state, (state,), {"opt": [state]}):
        _, g = value_and_grad(lambda p: _sq(p["w"]), source)({"w": jnp.ones(2)})
        assert g["w"].tolist() == [8.0, 8.0]
    with pytest.raises(ValueError, match="no jaxmp.loss_scaling state found"):
        value_and_grad(_sq, {"nothing": jnp.ones(1)})


def test_has_aux_and_argnums_and_kwargs_follow_jax():
    def f(a, b, *, k):
        return jnp.sum(a * b) * k, {"k": k}

    (loss, aux), (ga, gb) = value_and_grad(f, jaxmp.StaticLossScale(2.0), argnums=(0, 1), has_aux=True)(
        jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]), k=jnp.float32(0.5))
    assert float(loss) == 5.5 and float(aux["k"]) == 0.5
    assert ga.tolist() == [3.0, 4.0] and gb.tolist() == [1.0, 2.0]  # 2 (scale) * 0.5 * the other
    out = value_and_grad(lambda p: _sq(p["w"]), jaxmp.NoOpLossScale(), allow_int=True)(
        {"w": jnp.ones(2), "n": jnp.int32(3)})
    assert out[1]["n"].dtype == jax.dtypes.float0


def test_under_jit_the_unscaled_loss_is_returned_in_float32():
    ls = jaxmp.DynamicLossScale(2.0 ** 10)
    loss, g = jax.jit(lambda w: value_and_grad(_sq, ls)(w))(jnp.array([3.0]))
    assert loss.dtype == jnp.float32 and float(loss) == 9.0 and float(g[0]) == 6.0 * 2 ** 10


def test_bad_losses_are_refused_with_the_fix():
    ls = jaxmp.NoOpLossScale()
    with pytest.raises(ValueError, match=r"scalar, got shape \(2,\).*mean"):
        value_and_grad(lambda w: w * 2, ls)(jnp.ones(2))
    with pytest.raises(TypeError, match="floating point, got dtype int32"):
        value_and_grad(lambda w: jnp.int32(1), ls)(jnp.ones(2))
    with pytest.raises(ValueError, match=r"has_aux=True, fun must return a pair \(loss, aux\)"):
        value_and_grad(_sq, ls, has_aux=True)(jnp.ones(2))
    with pytest.raises(TypeError, match="fun must be callable, got int"):
        value_and_grad(3, ls)


def test_a_float16_loss_warns_unless_there_is_no_scale():
    w = jnp.ones(2, jnp.float16)
    with pytest.warns(MixedPrecisionWarning, match="the loss is float16"):
        value_and_grad(_sq, jaxmp.DynamicLossScale(2.0 ** 15))(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value_and_grad(_sq, jaxmp.NoOpLossScale())(w)
        value_and_grad(lambda w: _sq(w).astype(jnp.float32), jaxmp.DynamicLossScale(2.0 ** 15))(w)


def test_scaling_marks_the_states_loss_scale_so_update_does_not_warn():
    tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    assert not jaxmp._misuse.was_scaled(jaxmp.get_loss_scale(state))
    _, g = value_and_grad(lambda p: _sq(p["w"]), state)(params)
    assert jaxmp._misuse.was_scaled(jaxmp.get_loss_scale(state))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixedPrecisionWarning)
        tx.update(g, state, params)


def test_a_chain_with_transforms_before_loss_scaling_warns():
    inner = jaxmp.loss_scaling(optax.sgd(0.1), "none")
    tx = optax.chain(optax.clip_by_global_norm(1.0), inner)
    state = tx.init({"w": jnp.ones(2)})
    with pytest.warns(MixedPrecisionWarning, match="1 transform\\(s\\) before jaxmp.loss_scaling"):
        value_and_grad(lambda p: _sq(p["w"]), state)
