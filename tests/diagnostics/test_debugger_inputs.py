"""The precision debugger's inputs (issue 49, item 3): array loss scales, inf refused, NaN inputs named,
non-floating leaves held fixed, non-array arguments static, clear type errors, no warning from its own
differentiation, and a user's ``jaxmp.loss_scaling`` optimizer in ``steps=k`` mode."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp._misuse import MixedPrecisionWarning
from jaxmp.diagnostics import compare_to_float32, locate_non_finite, strict_precision

X = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
P = {"w": np.linspace(0.5, 1.5, 8, dtype=np.float32).reshape(4, 2)}


def _loss(p, x):
    with jax.named_scope("enc"):
        h = x @ p["w"]
    return jnp.mean(jnp.square(h))


def test_bad_arguments_get_clear_errors():
    with pytest.raises(TypeError, match="optax GradientTransformation.*not a name"):
        compare_to_float32(_loss, P, X, steps=2, optimizer="adam")
    with pytest.raises(TypeError, match="rules must be a jaxmp.AutocastRules"):
        compare_to_float32(_loss, P, X, policy="O1-bf16", rules={"enc": "float32"})
    with pytest.raises(TypeError, match="rules must be a jaxmp.AutocastRules"):
        locate_non_finite(_loss, P, X, policy="O1-bf16", rules={"enc": "float32"})
    with pytest.raises(TypeError, match="rules must be a jaxmp.AutocastRules"):
        strict_precision(_loss, rules={"enc": "float32"})
    with pytest.raises(TypeError, match="given no inputs.*params, batch"):
        compare_to_float32(lambda: _loss(P, X))
    for bad in (float("inf"), float("nan"), 0.0, -1.0, jnp.asarray(jnp.inf)):
        with pytest.raises(ValueError, match="finite positive"):
            locate_non_finite(_loss, P, X, loss_scale=bad)
    with pytest.raises(ValueError, match="one value"):
        locate_non_finite(_loss, P, X, loss_scale=np.ones(2))


def test_a_first_argument_with_nothing_to_train_is_refused_or_said():
    """Issue 60 item 7: an integer args[0] with steps=2 gave a report of NaN shares and gradient errors."""
    def scaled(n, x):
        return _loss(P, x) * jnp.asarray(n, jnp.float32)

    for n, kind in ((3, r"a Python int, static"), (jnp.int32(3), "int32"), ({"n": jnp.int32(3)}, "int32")):
        f = scaled if not isinstance(n, dict) else (lambda p, x: scaled(p["n"], x))
        with pytest.raises(ValueError, match=rf"steps=2 trains args\[0\], which holds no floating leaf \({kind}\)"):
            compare_to_float32(f, n, X, policy="O1-bf16", steps=2, fix=False)
        with pytest.raises(ValueError, match=r"grad=True differentiates args\[0\].*steps=0, grad=False"):
            compare_to_float32(f, n, X, policy="O1-bf16", grad=True, fix=False)
    # The forward comparison the message offers runs, and says that it compared no gradient.
    rep = compare_to_float32(scaled, jnp.int32(3), X, policy="O1-bf16", steps=0, grad=False, fix=False)
    assert rep.gradient_errors == () and np.isfinite(rep.loss_error)
    assert "no gradient: args[0] holds no floating leaf, int32" in str(rep)


def test_a_nan_input_is_named_by_the_comparison_as_by_the_locator():
    x = X.copy()
    x[3, 1] = np.nan
    with pytest.raises(ValueError, match=r"the input \[1\] already holds inf/NaN"):
        compare_to_float32(_loss, P, x, policy="O1-bf16")
    assert locate_non_finite(_loss, P, x).bad_input == "[1]"


@pytest.mark.slow  # ~3 s on a shared 2-core CPU: three instrumented programs
def test_the_runs_own_loss_scale_array_is_accepted():
    # A 0-d float32 array straight from the optimizer state; the same answer as the number.
    state = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale()).init(P)
    scale = jaxmp.get_loss_scale(state).loss_scale
    assert isinstance(scale, jax.Array) and scale.shape == ()
    big = {"w": P["w"] * 10}
    as_array = locate_non_finite(_loss, big, X * 10, policy="O1-fp16", loss_scale=scale)
    as_float = locate_non_finite(_loss, big, X * 10, policy="O1-fp16", loss_scale=float(scale))
    assert as_array.found and as_array.backward and as_array == as_float
    assert not locate_non_finite(_loss, big, X * 10, policy="O1-fp16", loss_scale=1.0).found


@pytest.mark.slow  # ~5 s on a shared 2-core CPU: three comparisons compile
def test_non_floating_params_and_non_array_arguments_are_handled():
    # An int counter and a PRNG key among the params, a string and a Python number as arguments.
    def loss(p, x, reduce, gain):
        noise = jax.random.uniform(p["key"], x.shape) * 0.0
        h = _loss({"w": p["w"]}, x + noise) * gain + p["count"].astype(jnp.float32) * 0.0
        return h if reduce == "mean" else h * 2

    params = {"w": P["w"], "count": np.int32(3), "key": jax.random.key(0)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixedPrecisionWarning)  # none from its own differentiation
        rep = compare_to_float32(loss, params, X, "mean", 2.0, policy="O1-fp16", fix=False)
    assert np.isclose(rep.loss_float32, 2 * float(_loss(P, X)), rtol=1e-6)
    assert [p for p, _ in rep.gradient_errors] == ["['w']"]  # only the floating leaf is differentiated
    # jax.jit with a static argument: traced with its value.
    jitted = jax.jit(loss, static_argnums=(2, 3))
    assert compare_to_float32(jitted, params, X, "sum", 2.0, fix=False).loss_float32 == pytest.approx(
        4 * float(_loss(P, X)), rel=1e-6)
    found = locate_non_finite(jitted, params, X, "mean", 2.0)
    assert not found.found and found.bad_input is None


@pytest.mark.slow  # ~4 s on a shared 2-core CPU: two 5-step comparisons
@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
def test_a_users_loss_scaling_optimizer_trains_as_its_inner_optimizer_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", MixedPrecisionWarning)
        scaled = compare_to_float32(_loss, P, X, policy="O1-bf16", steps=5, fix=False,
                                    optimizer=jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale()))
    plain = compare_to_float32(_loss, P, X, policy="O1-bf16", steps=5, fix=False, optimizer=optax.adam(1e-2))
    # The scale is a power of two: scaled then unscaled gradients are the plain ones, bitwise.
    assert scaled.losses == plain.losses and scaled.losses_float32 == plain.losses_float32
    assert scaled.losses[-1] < scaled.losses[0]  # it trained
