"""Bad input to the core gets a ValueError/TypeError whose message names the problem."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

_P = {"w": jnp.ones(3)}


def _update_with(grads, **kw):
    tx = jaxmp.loss_scaling(optax.sgd(0.1), **kw)
    return tx.update(grads, tx.init(_P), _P)


def _select_mismatch():
    return jaxmp.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)})


CASES = [
    # (id, callable, exception, message regex)
    ("unknown dtype name", lambda: jaxmp.get_policy("p=f32,c=f12"), ValueError, r"Unknown dtype name 'f12'"),
    ("bare unknown name", lambda: jaxmp.get_policy("quarter"), ValueError, r"Unknown policy 'quarter'.*a preset \(O0, O1"),
    ("preset O4 lists the presets", lambda: jaxmp.get_policy("O4"), ValueError, r"Unknown policy 'O4'.*O0, O1, O2, O3.*mixed_float16"),
    ("spaced preset lists the presets", lambda: jaxmp.get_policy("O1 - bf16"), ValueError, r"Unknown policy 'O1 - bf16'.*'O2-bf16'"),
    ("Keras typo lists the presets", lambda: jaxmp.get_policy("mixed_float32"), ValueError, r"mixed_float16, mixed_bfloat16"),
    ("master_dtype name accepted", lambda: jaxmp.loss_scaling(optax.sgd(0.1), master_dtype="bf17"), TypeError, r"master_dtype must be a floating dtype.*names: \["),
    ("unknown key", lambda: jaxmp.get_policy("q=f16"), ValueError, r"Unknown key 'q'"),
    ("malformed part", lambda: jaxmp.get_policy("p=f32,c"), ValueError, r"Malformed policy part 'c'"),
    ("double equals", lambda: jaxmp.get_policy("p==f32"), ValueError, r"Malformed policy part"),
    ("duplicate key", lambda: jaxmp.get_policy("p=f32,params=f16"), ValueError, r"given twice"),
    ("empty policy", lambda: jaxmp.get_policy("  "), ValueError, r"empty"),
    ("non-string policy", lambda: jaxmp.get_policy(16), TypeError, r"policy name must be a string"),
    ("bad preset suffix", lambda: jaxmp.get_policy("O2-fp4"), ValueError, r"Unknown half dtype 'fp4'.*'O2-fp8'"),
    ("unknown recipe", lambda: jaxmp.get_recipe("O7"), ValueError, r"Unknown preset 'O7'"),
    ("integer compute dtype", lambda: jaxmp.Policy(jnp.float32, jnp.int8, jnp.float32), TypeError,
     r"compute_dtype must be a floating dtype.*int8"),
    ("bool param dtype", lambda: jaxmp.Policy(jnp.bool_, jnp.float16, jnp.float32), TypeError,
     r"param_dtype must be a floating dtype"),
    ("not a policy", lambda: jaxmp.as_policy(3.0), TypeError, r"Expected a jaxmp.Policy"),
    ("unknown platform", lambda: jaxmp.recommended_policy(platform="fpga"), ValueError, r"unknown platform 'fpga'"),
    ("bad compute capability", lambda: jaxmp.recommended_policy(platform="gpu", compute_capability="x.y"),
     ValueError, r"compute_capability must look like"),
    ("negative static scale", lambda: jaxmp.StaticLossScale(-2.0), ValueError, r"loss_scale must be a positive finite"),
    ("zero static scale", lambda: jaxmp.StaticLossScale(0.0), ValueError, r"loss_scale must be a positive finite"),
    ("inf dynamic scale", lambda: jaxmp.DynamicLossScale(float("inf")), ValueError, r"loss_scale must be a positive finite"),
    ("nan dynamic scale", lambda: jaxmp.DynamicLossScale(float("nan")), ValueError, r"loss_scale must be a positive finite"),
    ("vector scale", lambda: jaxmp.StaticLossScale([1.0, 2.0]), TypeError, r"loss_scale must be a real scalar"),
    ("string scale", lambda: jaxmp.StaticLossScale("big").scale(1.0), TypeError, r"loss_scale must be a real scalar"),
    ("zero growth interval", lambda: jaxmp.DynamicLossScale(period=0), ValueError, r"period \(growth interval\) must be >= 1"),
    ("float growth interval", lambda: jaxmp.DynamicLossScale(period=2.5), TypeError, r"period \(growth interval\) must be an int"),
    ("growth factor 1", lambda: jaxmp.DynamicLossScale(factor=1.0), ValueError, r"factor \(growth factor\) must be"),
    ("backoff above 1", lambda: jaxmp.DynamicLossScale(backoff_factor=2.0), ValueError, r"backoff_factor must be in \(0, 1\)"),
    ("min above max", lambda: jaxmp.DynamicLossScale(2.0, min_loss_scale=8.0, max_loss_scale=4.0), ValueError,
     r"min_loss_scale \(8.0\) is larger than max_loss_scale"),
    ("initial outside bounds", lambda: jaxmp.DynamicLossScale(2.0**30), ValueError, r"outside \[min_loss_scale, max_loss_scale\]"),
    ("negative counter", lambda: jaxmp.DynamicLossScale(counter=-1), ValueError, r"counter must be a non-negative"),
    ("unknown loss scale spec", lambda: jaxmp.make_loss_scale("huge"), ValueError, r"Unknown loss scale 'huge'"),
    ("bad static spec", lambda: jaxmp.make_loss_scale("static:lots"), ValueError, r"cannot read the static scale"),
    ("adjust with non-bool", lambda: jaxmp.DynamicLossScale().adjust(jnp.float32(1.0)), TypeError, r"boolean scalar.*float32"),
    ("adjust with vector", lambda: jaxmp.DynamicLossScale().adjust(jnp.ones(2, bool)), ValueError, r"boolean scalar, got shape"),
    ("select_tree mismatched trees", _select_mismatch, ValueError, r"same structure"),
    ("select_tree mismatched leaves", lambda: jaxmp.select_tree(jnp.array(True), jnp.ones(2), jnp.ones(3)),
     ValueError, r"leaves differ"),
    ("non-scalar loss", lambda: jaxmp.value_and_grad(lambda w: w * 2, jaxmp.NoOpLossScale())(jnp.ones(3)), ValueError,
     r"loss must be a scalar, got shape \(3,\)"),
    ("integer loss", lambda: jaxmp.value_and_grad(lambda w: jnp.int32(1), jaxmp.NoOpLossScale())(jnp.ones(3)),
     TypeError, r"loss must be floating point"),
    ("has_aux without pair", lambda: jaxmp.value_and_grad(lambda w: jnp.sum(w), jaxmp.NoOpLossScale(), has_aux=True)(
        jnp.ones(3)), ValueError, r"has_aux=True, fun must return a pair"),
    ("value_and_grad without scale", lambda: jaxmp.value_and_grad(lambda w: jnp.sum(w), optax.sgd(0.1).init(_P)),
     ValueError, r"no jaxmp.loss_scaling state found"),
    ("non-callable loss", lambda: jaxmp.value_and_grad(3, jaxmp.NoOpLossScale()), TypeError, r"fun must be callable"),
    ("mismatched grad tree", lambda: _update_with({"v": jnp.ones(3)}), ValueError, r"different tree structures"),
    ("mismatched grad shape", lambda: _update_with({"w": jnp.ones(4)}), ValueError, r"has shape \(4,\) but"),
    ("non-array grad leaf", lambda: _update_with({"w": "grad"}), TypeError, r"gradient leaf at \['w'\] is a str"),
    ("inner not optax", lambda: jaxmp.loss_scaling(lambda g: g), TypeError, r"inner must be an optax GradientTransformation"),
    ("master_weights not bool", lambda: jaxmp.loss_scaling(optax.sgd(0.1), master_weights="yes"), TypeError,
     r"master_weights must be a bool"),
    ("integer master dtype", lambda: jaxmp.loss_scaling(optax.sgd(0.1), master_dtype=jnp.int32), TypeError,
     r"master_dtype must be a floating dtype"),
    ("no master weights", lambda: jaxmp.master_params(jaxmp.loss_scaling(optax.sgd(0.1)).init(_P)), ValueError,
     r"keeps no master weights"),
    ("bad max_consecutive_skips", lambda: jaxmp.check_health(jaxmp.loss_scaling(optax.sgd(0.1)).init(_P), 0),
     ValueError, r"max_consecutive_skips must be an int >= 1"),
    ("two loss-scaling states", lambda: jaxmp.find_loss_scaling_state(
        [jaxmp.loss_scaling(optax.sgd(0.1)).init(_P)] * 2), ValueError, r"found 2 jaxmp.loss_scaling states"),
    ("wrong state type", lambda: jaxmp.loss_scaling(optax.sgd(0.1)).update(_P, optax.EmptyState(), _P), TypeError,
     r"state must be the LossScalingState"),
]


@pytest.mark.parametrize("fn,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_there_are_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_traced_scale_inside_jit_is_allowed():
    # Building a loss scale from a traced value inside jit must not trip the validation.
    out = jax.jit(lambda s: jaxmp.DynamicLossScale(s).adjust(jnp.array(False)).loss_scale)(jnp.float32(8.0))
    assert float(out) == 4.0
