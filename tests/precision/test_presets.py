"""jaxmp/_precision/_presets.py: preset names to recipes, the one policy parser, and the typo hints."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import fp8
from jaxmp._precision._policy import Policy
from jaxmp._precision._presets import (FLOAT32_CATEGORIES, PRESET_NAMES, Recipe, as_policy, did_you_mean, get_policy, get_recipe,
                           parse_preset, preset_half_dtype, resolve_policy)

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32)


@pytest.mark.parametrize("name,p,c,o,master,scale,keep", [
    ("O0", F32, F32, F32, False, "none", ()),
    ("O1-fp16", F32, F16, F32, False, "dynamic", FLOAT32_CATEGORIES),
    ("O1-bf16", F32, BF16, F32, False, "none", FLOAT32_CATEGORIES),
    ("O2-fp16", F16, F16, F32, True, "dynamic", ("norm", "loss")),
    ("O2-bf16", BF16, BF16, F32, True, "none", ("norm", "loss")),
    ("O3-fp16", F16, F16, F16, False, "none", ()),
    ("float32", F32, F32, F32, False, "none", ()),
    ("mixed_float16", F32, F16, F32, False, "dynamic", FLOAT32_CATEGORIES),
    ("mixed_bfloat16", F32, BF16, F32, False, "none", FLOAT32_CATEGORIES)])
def test_each_preset_is_its_documented_recipe(name, p, c, o, master, scale, keep):
    r = get_recipe(name)
    assert (r.policy.param_dtype, r.policy.compute_dtype, r.policy.output_dtype) == (p, c, o)
    assert (r.master_weights, r.loss_scale, r.keep_float32, r.fp8) == (master, scale, keep, None)


def test_every_listed_preset_name_parses():
    for name in PRESET_NAMES:
        assert isinstance(get_recipe(name), Recipe), name


def test_preset_spellings_lower_case_separators_and_spaces():
    for name in ("o2-bf16", " O2_bf16 ", "O2:bfloat16", "O2-BF16"):
        r = parse_preset(name)
        assert r.policy.param_dtype == BF16 and r.master_weights, name
    # A suffixless level takes the hardware's half dtype (float16 on the CPU the tests run on).
    assert get_recipe("O1").policy.compute_dtype == preset_half_dtype() == F16


def test_fp8_presets_are_o2_bf16_with_an_fp8_recipe():
    delayed, current = get_recipe("O2-fp8"), get_recipe("O2-fp8-current")
    assert isinstance(delayed.fp8, fp8.DelayedScaling) and isinstance(current.fp8, fp8.CurrentScaling)
    assert isinstance(get_recipe("O2-fp8-delayed").fp8, fp8.DelayedScaling)
    assert delayed.policy == get_recipe("O2-bf16").policy and delayed.master_weights
    with pytest.raises(ValueError, match="fp8 presets are O2-based.*'O2-fp8', not 'O1-fp8'"):
        parse_preset("O1-fp8")


def test_parse_preset_returns_none_for_what_is_not_a_preset_and_refuses_a_bad_suffix():
    for text in ("", "O", "O4", "X1", "O1x", "bf16", "p=f32,c=bf16"):
        assert parse_preset(text) is None, text
    with pytest.raises(ValueError, match=r"Unknown half dtype 'f8' in preset 'O2-f8'.*did you mean"):
        parse_preset("O2-f8")
    for text in ("O2-", "O1_", "o3:"):  # a separator with nothing after it is a typo, not "O2"
        with pytest.raises(ValueError, match=r"no half dtype after it.*'O\d-bf16'"):
            parse_preset(text)


def test_preset_half_dtype_reads_the_device():
    dev = lambda platform, cc=None: SimpleNamespace(platform=platform, compute_capability=cc)  # noqa: E731
    assert preset_half_dtype(dev("tpu")) == BF16
    assert preset_half_dtype(dev("gpu", "8.0")) == BF16 and preset_half_dtype(dev("gpu", "9.0")) == BF16
    assert preset_half_dtype(dev("gpu", "7.5")) == F16 and preset_half_dtype(dev("gpu")) == F16
    assert preset_half_dtype(dev("cpu")) == F16


def test_resolve_policy_takes_every_documented_form():
    pol = Policy(F32, BF16, F32)
    assert resolve_policy(pol) == (pol, None)
    r = get_recipe("O2-bf16")
    assert resolve_policy(r) == (r.policy, r)
    jmp_like = SimpleNamespace(param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float32)
    p, rec = resolve_policy(jmp_like)
    assert rec is None and isinstance(p, Policy) and p.compute_dtype == F16
    p, rec = resolve_policy("params=float32,compute=bfloat16,output=float32")
    assert rec is None and p == pol
    p, rec = resolve_policy(" mixed_float16 ")
    assert rec.name == "mixed_float16" and p.compute_dtype == F16
    assert resolve_policy("bf16")[0] == Policy(BF16, BF16, BF16)
    assert as_policy("O2-bf16") == get_policy("O2-bf16") == r.policy


def test_bad_policies_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="policy name is empty"):
        resolve_policy("   ")
    with pytest.raises(ValueError, match=r"Unknown policy 'mixed_bflot16' \(did you mean 'mixed_bfloat16'"):
        resolve_policy("mixed_bflot16")
    with pytest.raises(TypeError, match="got int: 3"):
        resolve_policy(3)
    with pytest.raises(TypeError, match="preset name must be a string, got Policy"):
        get_recipe(Policy(F32, F32, F32))
    with pytest.raises(ValueError, match=r"Unknown preset 'p=f32'.*expected O0, O1"):
        get_recipe("p=f32")
    with pytest.raises(TypeError, match="policy name must be a string, got NoneType"):
        get_policy(None)


def test_did_you_mean_suggests_close_names_in_their_spelling_or_nothing():
    assert did_you_mean("o2-bf61", PRESET_NAMES).startswith(" (did you mean 'O2-bf16'")
    assert did_you_mean("zzzzzz", PRESET_NAMES) == ""
    assert did_you_mean(17, ["O1"]) == ""


# -- issue 59, item 12: a Policy cannot carry an fp8 recipe, so the dtype views refuse fp8 presets --

_FP8_PRESETS = tuple(n for n in (*PRESET_NAMES, "O2-fp8-delayed") if get_recipe(n).fp8 is not None)


def test_every_fp8_and_block_preset_is_listed():
    assert set(_FP8_PRESETS) == {"O2-fp8", "O2-fp8-delayed", "O2-fp8-current", "O2-mxfp8", "O2-fp8-rowwise",
                                 "O2-fp8-block128", "O2-nvfp4"}


@pytest.mark.parametrize("name", _FP8_PRESETS)
def test_get_policy_refuses_an_fp8_preset_naming_the_calls_that_keep_its_recipe(name):
    import jax
    import jaxmp

    recipe = get_recipe(name)
    for view in (get_policy, as_policy, jaxmp.get_policy, jaxmp.as_policy):
        with pytest.raises(ValueError, match="is an fp8 preset, and a Policy holds only dtypes") as refused:
            view(f" {name}")
        message = str(refused.value)
        assert f"jaxmp.autocast(fn, {name!r})" in message and f"jaxmp.flax.mixed_precision(model, {name!r})" in message
        assert f"jaxmp.get_recipe({name!r})" in message
        assert fp8._recipes.source(recipe.fp8) in message  # the recipe it would have dropped, named
    # The calls it names keep the recipe: the level itself, and the name passed to a door.
    kept = eval(f"jaxmp.get_recipe({name!r})", {"jaxmp": jaxmp})
    assert kept.fp8 == recipe.fp8 and kept.policy == Policy(BF16, BF16, F32)
    # A Recipe object handed over explicitly is the caller's choice: its dtypes, as documented.
    assert as_policy(recipe) == recipe.policy
    if isinstance(recipe.fp8, fp8.CurrentScaling):
        x = jax.numpy.ones((2, 64))
        assert jaxmp.precision_report(jaxmp.autocast(lambda x: x @ x.T, name), x, policy=name).policy == "p=bf16,c=bf16,o=f32"
