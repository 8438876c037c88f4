"""jaxmp/engine/_modules.py: applying one module rule to a call, the Linen interceptor and the call hooks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp.engine._modules import (call_with_rule, cast_output, first_floating_dtype, install_call_hooks,
                                  is_layer_call, module_interceptor)
from jaxmp.engine._module_rules import ModuleRule
from jaxmp._jaxpr import walk

F16, BF16, F32 = np.dtype("float16"), np.dtype(jnp.bfloat16), np.dtype("float32")
FLOAT32_RULE = ModuleRule(F32, F32, "input", "float32")


def test_first_floating_dtype_skips_integers_and_finds_nothing_in_an_integer_tree():
    assert first_floating_dtype(((jnp.int32(1), 2.0, jnp.ones(2, F16)), {"b": jnp.ones(1)})) == F16
    assert first_floating_dtype(((jnp.arange(3),), {})) is None


def test_cast_output_as_the_rule_says():
    out = {"y": jnp.ones(2, F32), "i": jnp.arange(2)}
    assert cast_output(out, FLOAT32_RULE, F16)["y"].dtype == F16 and cast_output(out, FLOAT32_RULE, F16)["i"].dtype == jnp.int32
    assert cast_output(out, FLOAT32_RULE, None)["y"].dtype == F32  # no floating input: nothing to go back to
    assert cast_output(out, ModuleRule(BF16, F32, "computed", "half"), F16)["y"].dtype == F32
    assert cast_output(out, ModuleRule(BF16, F32, F16, "policy"), None)["y"].dtype == F16


def test_call_with_rule_casts_inputs_runs_in_a_region_and_casts_back():
    seen = []

    def call(x, *, scale):
        seen.append((x.dtype, scale.dtype))
        return x * scale

    out = call_with_rule(FLOAT32_RULE, "Norm", call, (jnp.ones(2, F16),), {"scale": jnp.ones(2, BF16)})
    assert seen == [(F32, F32)] and out.dtype == F16
    jx = jax.make_jaxpr(lambda x: call_with_rule(FLOAT32_RULE, "Norm", lambda y: y * 2.0, (x,), {}))(jnp.ones(2, F16))
    assert any("Norm" in e.name for e in walk(jx))


def test_is_layer_call():
    assert [is_layer_call(n) for n in ("__call__", "attend", "setup", "_private")] == [True, True, False, False]


def test_module_interceptor_applies_the_rule_observes_and_reports_errors():
    rules = jaxmp.AutocastRules(class_rules=((nn.LayerNorm, "float32"),)).module_rules()
    seen, failed = [], []
    icpt = module_interceptor(rules.rule_for, observe=lambda m, r: seen.append(type(m).__name__),
                              on_error=lambda m: failed.append(type(m).__name__))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.LayerNorm()(nn.Dense(2)(x))

    with nn.intercept_methods(icpt):
        Net().init(jax.random.key(0), jnp.ones((1, 2)))
    assert seen == ["LayerNorm"] and failed == []

    class Broken(nn.LayerNorm):
        def __call__(self, x):
            raise RuntimeError("broken layer")

    with nn.intercept_methods(icpt), pytest.raises(RuntimeError, match="broken layer"):
        Broken().init(jax.random.key(0), jnp.ones((1, 2)))
    assert failed == ["Broken"] and seen[-1] == "Broken"


def test_install_call_hooks_is_idempotent_and_inert_outside_autocast():
    class Scale:
        def __call__(self, x):
            return jnp.exp(x) * 2.0

    class Sub(Scale):
        pass

    original = Scale.__call__
    install_call_hooks([Scale])
    hooked = Scale.__call__
    install_call_hooks([Scale])
    assert Scale.__call__ is hooked and hooked.__wrapped__ is original
    assert Sub()(jnp.ones(2, F16)).dtype == F16  # outside autocast: unchanged
    rules = jaxmp.AutocastRules(class_rules=((Scale, "half"),))
    out = jax.make_jaxpr(jaxmp.autocast(lambda x: Sub()(x), "O1-bf16", rules=rules))(jnp.ones(2))
    exps = [e for e in walk(out) if e.primitive == "exp"]
    assert exps and all(e.invars[0].aval.dtype == BF16 for e in exps)  # the class rule reached the subclass
