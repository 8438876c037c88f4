"""Unit tests of jaxmp.flax._overrides: the Flax door's default rules, the argument resolution and
the bad-input errors of the deprecated PrecisionOverrides. (The rules' effect on models is in
tests/flax/test_linen.py and test_nnx.py.)"""

import warnings

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
    with pytest.raises(TypeError, match=r"give rules= only \(overrides= is its deprecated name\), not both"):
        ov.resolve_rules("O1", rules=ov.default_rules(), overrides=ov.default_rules())
    with pytest.raises(TypeError, match=r"rules must be a jaxmp.AutocastRules .* got dict"):
        ov.resolve_rules("O1", rules={"norm": "float32"})


def test_resolve_rules_defaults_to_the_presets_rules_and_keeps_given_ones():
    policy, rules = ov.resolve_rules("O1")
    assert isinstance(policy, jaxmp.Policy) and rules == ov.default_rules("O1")
    mine = ov.default_rules("O1").with_path("head", "float32")
    assert ov.resolve_rules("O1", mine)[1] is mine


def test_resolve_rules_deprecated_spellings_warn_and_give_the_same_rules():
    with pytest.warns(DeprecationWarning, match=r"a tuple of categories .* is deprecated"):
        _, rules = ov.resolve_rules("O1", ("loss",))
    assert rules == ov.default_rules("O1", keep_float32=("loss",))
    with pytest.warns(DeprecationWarning, match=r"overrides= argument of the Flax door is deprecated"):
        _, rules = ov.resolve_rules("O1", overrides=ov.default_rules("O1", keep_float32=()))
    assert rules.float32_loss is False


def _overrides(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return ov.PrecisionOverrides(**kw)


@pytest.mark.parametrize("kw, error, match", [
    ({"half_modules": (nn.Dense(2),)}, TypeError, r"half_modules: .* \(got an instance; pass its class, type\(x\) = Dense\)"),
    ({"fp32_modules": ("LayerNorm",)}, TypeError, r"got the string 'LayerNorm'; pass the class itself"),
    ({"fp32_modules": (int,)}, TypeError, r"expected a flax.linen.Module or flax.nnx.Module subclass \(got type"),
    ({"half_modules": (nn.Dense,), "fp32_modules": (nn.Dense,)}, ValueError, r"\['Dense'\] are in both"),
    ({"module_policies": ((nn.Dense,),)}, TypeError, r"\(module class, policy\) pairs"),
    ({"fp32_softmax": 1}, TypeError, r"fp32_softmax must be a bool, got 1"),
    ({"fp8": "delayed"}, TypeError, r"fp8 must be a jaxmp.fp8.DelayedScaling / CurrentScaling recipe or None"),
    ({"fp32_paths": 3}, TypeError, r"fp32_paths: expected a tuple of module path strings, got int"),
])
def test_precision_overrides_bad_fields(kw, error, match):
    with pytest.raises(error, match=match):
        _overrides(**kw)


def test_precision_overrides_normalises_its_fields():
    po = _overrides(half_modules=nn.Dense, fp32_modules=(nn.LayerNorm, nn.LayerNorm),
                    module_policies={nn.Conv: "O0"}, fp32_paths="head")
    assert po.half_modules == (nn.Dense,) and po.fp32_modules == (nn.LayerNorm,)  # one class, deduplicated
    assert po.fp32_paths == ("head",) and po.module_policies[0][0] is nn.Conv
    assert isinstance(po.module_policies[0][1], jaxmp.Policy)
    # a later pair for the same class replaces the earlier one
    po = _overrides(module_policies=((nn.Conv, "O0"), (nn.Conv, "O1")))
    assert len(po.module_policies) == 1


def test_precision_overrides_builders_warn_and_keep_a_class_in_one_list():
    po = _overrides()
    with pytest.warns(DeprecationWarning, match=r"PrecisionOverrides.with_fp32 is deprecated"):
        moved = po.with_fp32(nn.Dense)
    assert nn.Dense in moved.fp32_modules and nn.Dense not in moved.half_modules
    with pytest.warns(DeprecationWarning):
        with pytest.raises(TypeError, match=r"with_fp32_paths: give at least one module path"):
            po.with_fp32_paths()
    with pytest.warns(DeprecationWarning):
        with pytest.raises(TypeError, match=r"expected a jaxmp.Recipe or a preset name, got int"):
            ov.PrecisionOverrides.from_recipe(3)
