"""Unit tests of jaxmp.flax._overrides: the Flax door's default rules and the resolution of its
arguments. (The rules' effect on models is in tests/flax/test_linen.py and test_nnx.py.)"""

import flax.linen as nn
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxmp
from jaxmp.flax import _overrides as ov


def test_join_path_and_explicit_float32():
    assert ov.join_path(("layers", 0, "attn")) == "layers/0/attn" and ov.join_path(()) == ""
    assert ov.explicit_float32(nn.Dense(2, dtype=jnp.float32))
    assert not ov.explicit_float32(nn.Dense(2))  # dtype=None: Flax infers it, not an explicit choice
    assert not ov.explicit_float32(nn.Dense(2, dtype=jnp.bfloat16))
    assert not ov.explicit_float32(object())
    assert not ov.explicit_float32(type("M", (), {"dtype": "not a dtype"})())


def test_overridden_float32_message_names_each_layer_and_both_routes():
    msg = ov.overridden_float32_message(["head", ""], ["Dense", "MyNet"], jnp.bfloat16)
    assert "2 half-list layer(s)" in msg and "in bfloat16" in msg
    assert "'head' (Dense)" in msg and "the wrapped model itself (MyNet)" in msg
    assert "rules.with_path('head', 'float32')" in msg and "rules.with_class(MyNet, 'float32')" in msg
    only_root = ov.overridden_float32_message([""], ["MyNet"], jnp.float16)
    assert "with_path" not in only_root and "with_class(MyNet" in only_root


@pytest.mark.parametrize("keep, norm_f32, float32_loss", [
    (None, True, True), ("loss", False, True), (("norm",), True, False), ((), False, False),
])
def test_default_rules_keep_float32_categories(keep, norm_f32, float32_loss):
    rules = ov.default_rules("O1", keep_float32=keep)
    classes = dict(rules.class_rules)
    assert classes[nn.Dense] == "half" and classes[nnx.Linear] == "half"
    assert (classes.get(nn.LayerNorm) == "float32") is norm_f32 and (nnx.RMSNorm in classes) is norm_f32
    assert rules.float32_loss is float32_loss and rules.fp8_matmuls is None


def test_default_rules_refuses_an_unknown_category():
    with pytest.raises(ValueError, match=r"unknown keep_float32 categories \['norms'\]: expected a subset of"):
        ov.default_rules("O1", keep_float32=("norms", "loss"))


def test_resolve_rules_bad_arguments():
    with pytest.raises(TypeError, match=r"rules must be a jaxmp.AutocastRules .* got dict"):
        ov.resolve_rules("O1", rules={"norm": "float32"})
    # A tuple of categories (the spelling before AutocastRules) names the call that keeps them.
    with pytest.raises(TypeError, match=r"got tuple: \('loss',\); .*default_rules\(policy, keep_float32=\('loss',\)\)"):
        ov.resolve_rules("O1", ("loss",))


def test_resolve_rules_defaults_to_the_presets_rules_and_keeps_given_ones():
    policy, rules = ov.resolve_rules("O1")
    assert isinstance(policy, jaxmp.Policy) and rules == ov.default_rules("O1")
    mine = ov.default_rules("O1").with_path("head", "float32")
    assert ov.resolve_rules("O1", mine)[1] is mine
