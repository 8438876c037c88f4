"""jaxmp/engine/_unscaled.py: the watching identity that warns when a float16 program is differentiated unscaled."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxmp
from jaxmp.engine._unscaled import watch


def test_watch_is_the_identity_on_values_and_leaves_non_floating_inputs_alone():
    x, i, key = jnp.arange(3.0), jnp.arange(3), jax.random.key(0)
    out = watch([x, i, 7, key], "f")
    assert out[1] is i and out[2] == 7 and out[3] is key
    assert jnp.array_equal(out[0], x) and out[0].dtype == x.dtype
    assert watch((), "f") == []


def test_differentiating_through_watch_warns_and_passes_the_tangent_through():
    def f(x):
        return jnp.sum(watch([x], "loss under 'O1-fp16'")[0] * 3.0)

    with pytest.warns(jaxmp.MixedPrecisionWarning, match="loss under 'O1-fp16' computes in float16"):
        g = jax.grad(f)(jnp.ones(2))
    assert g.tolist() == [3.0, 3.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(jnp.ones(2))  # no derivative: no warning
        jax.jit(f)(jnp.ones(2))


def test_one_warning_per_trace_however_many_watched_regions():
    def f(x):
        for k in range(3):
            x = watch([x], f"region {k}")[0] * 2.0
        return jnp.sum(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(jax.grad(f))(jnp.ones(2))
    assert len([w for w in caught if issubclass(w.category, jaxmp.MixedPrecisionWarning)]) == 1


def test_a_float16_autocast_program_warns_under_grad_and_a_bfloat16_one_does_not():
    loss = lambda w: jnp.sum(jnp.ones((1, 2)) @ w)  # noqa: E731
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="no loss scale"):
        jax.grad(jaxmp.autocast(loss, "O1-fp16"))(jnp.ones((2, 2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.grad(jaxmp.autocast(loss, "O1-bf16"))(jnp.ones((2, 2)))
