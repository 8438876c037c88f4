"""jaxmp/engine/_config.py: what a policy argument resolves to under autocast, and the tracing context."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp.engine._config import AutocastConfig, current, resolve_config

F16, BF16, F32 = np.dtype("float16"), np.dtype(jnp.bfloat16), np.dtype("float32")


@pytest.mark.parametrize("policy, compute, output, cast_inputs, identity", [
    ("O0", F32, F32, "", True),
    ("O1-bf16", BF16, F32, "", False),
    ("O1-fp16", F16, F32, "", False),
    ("O2-bf16", BF16, F32, "weights", False),
    ("O3-fp16", F16, F16, "all", False),
])
def test_each_preset_resolves_to_its_row_of_the_table(policy, compute, output, cast_inputs, identity):
    cfg = resolve_config(policy, None)
    assert (cfg.compute_dtype, cfg.output_dtype, cfg.cast_inputs, cfg.identity) == (compute, output, cast_inputs,
                                                                                   identity)
    assert policy in cfg.name


def test_o3_has_no_float32_list_and_o1_keeps_one():
    assert not resolve_config("O3-bf16", None).rules.float32_ops
    assert "exp" in resolve_config("O1-bf16", None).rules.float32_ops


def test_a_policy_acts_as_o1_with_its_dtypes_and_casts_arguments_when_its_params_are_half():
    cfg = resolve_config(jaxmp.Policy(param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float16),
                         None)
    assert (cfg.compute_dtype, cfg.output_dtype, cfg.cast_inputs) == (F16, F16, "")
    half_params = resolve_config("params=bfloat16,compute=bfloat16,output=float32", None)
    assert half_params.cast_inputs == "weights" and half_params.output_dtype == F32


def test_a_bare_half_dtype_name_is_pure_half_with_a_warning_naming_the_mixed_preset():
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="'O1-fp16'"):
        cfg = resolve_config("fp16", None)
    assert cfg.output_dtype == F16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_config("O1-fp16", None)  # a preset never warns


def test_explicit_rules_are_used_and_anything_else_is_refused():
    rules = jaxmp.AutocastRules(promote="widest")
    assert resolve_config("O1-bf16", rules).rules is rules
    # promote=None (the default) is the preset's, filled in; the rest is the rules as given
    edited = jaxmp.AutocastRules().with_float32("tanh")
    assert resolve_config("O2-bf16", edited).rules == edited.__class__(float32_ops=edited.float32_ops, promote="narrow")
    with pytest.raises(TypeError, match="rules must be a jaxmp.AutocastRules, got dict"):
        resolve_config("O1-bf16", {"half": ["dot_general"]})
    with pytest.raises(ValueError):
        resolve_config("O7", None)


def test_configs_are_hashable_and_equal_when_their_settings_are():
    a, b = resolve_config("O2-bf16", None), resolve_config("O2-bf16", None)
    assert isinstance(a, AutocastConfig) and a == b and hash(a) == hash(b) and a != resolve_config("O1-bf16", None)


def test_current_is_the_config_only_while_autocast_traces():
    seen = []

    def f(x):
        seen.append(current())
        return x @ x

    assert current() is None
    jaxmp.autocast(f, "O1-bf16")(jnp.ones((2, 2)))
    assert seen[-1] is not None and seen[-1].compute_dtype == BF16 and current() is None
    f(jnp.ones((2, 2)))
    assert seen[-1] is None
