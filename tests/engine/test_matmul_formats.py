"""A matmul format per module (issue 62): ``with_scope``/``with_path``/``with_class`` given an fp8
recipe or a preset name run that module's matmuls in it, bit for bit as the preset alone would."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp import fp8


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return ({"a": jax.random.normal(k[0], (32, 64)) * 0.2, "b": jax.random.normal(k[1], (64, 16)) * 0.1},
            jax.random.normal(k[2], (8, 32)))


def _a(p, x):
    return jnp.tanh(x @ p["a"])


def _b(p, h):
    return jnp.sum(jnp.square(h @ p["b"]))


def _model(p, x):
    with jax.named_scope("a"):
        h = _a(p, x)
    with jax.named_scope("b"):
        return _b(p, h)


def _value_and_grad(f, p, x):
    return jax.tree.leaves(jax.jit(jax.value_and_grad(f))(p, x))


def _equal(xs, ys) -> bool:
    return all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(xs, ys))


@pytest.mark.parametrize("fmt", ["O2-nvfp4", "O2-mxfp8"])
def test_a_scope_format_runs_the_preset_on_that_module_alone(fmt):
    p, x = _params()
    rules = jaxmp.AutocastRules().with_scope("a", fmt)
    got = _value_and_grad(jaxmp.autocast(_model, "O2-bf16", rules=rules), p, x)

    def alone(p, x):  # the preset on module a alone, bf16 on module b
        return jaxmp.autocast(_b, "O2-bf16")(p, jaxmp.autocast(_a, fmt)(p, x))
    assert _equal(got, _value_and_grad(alone, p, x))
    # and it is not bf16 everywhere, nor the preset everywhere
    assert not _equal(got, _value_and_grad(jaxmp.autocast(_model, "O2-bf16"), p, x))
    assert not _equal(got, _value_and_grad(jaxmp.autocast(_model, fmt), p, x))


def test_a_recipe_object_and_its_preset_name_are_the_same_format():
    p, x = _params()
    by_name = jaxmp.autocast(_model, "O2-bf16", rules=jaxmp.AutocastRules().with_scope("a", "O2-mxfp8"))
    by_recipe = jaxmp.autocast(_model, "O2-bf16",
                               rules=jaxmp.AutocastRules().with_scope("a", jaxmp.get_recipe("O2-mxfp8").fp8))
    assert _equal(_value_and_grad(by_name, p, x), _value_and_grad(by_recipe, p, x))


def test_o2_bf16_as_a_format_takes_a_preset_fp8_off_one_module():
    p, x = _params()
    rules = jaxmp.AutocastRules().with_scope("b", "O2-bf16")
    got = _value_and_grad(jaxmp.autocast(_model, "O2-nvfp4", rules=rules), p, x)

    def alone(p, x):
        return jaxmp.autocast(_b, "O2-bf16")(p, jaxmp.autocast(_a, "O2-nvfp4")(p, x))
    assert _equal(got, _value_and_grad(alone, p, x))


def test_formats_are_rules_data_and_bad_ones_are_refused():
    rules = jaxmp.AutocastRules().with_scope("a", "O2-nvfp4").with_scope("a", "O2-mxfp8").with_scope("b", "float32")
    assert rules.matmul_formats == (("scope", "a", "O2-mxfp8"),)  # a later rule for the same scope replaces
    assert rules.scope_rules == (("b", "float32"),)
    assert hash(rules) == hash(jaxmp.AutocastRules().with_scope("a", "O2-mxfp8").with_scope("b", "float32"))
    with pytest.raises(ValueError, match="O2-nvfp4"):  # a typo of a preset: did you mean
        jaxmp.AutocastRules().with_scope("a", "O2-nvfp5")
    with pytest.raises(ValueError, match="current scaling"):
        jaxmp.AutocastRules().with_scope("a", fp8.DelayedScaling())
    with pytest.raises(ValueError, match="with_scope"):  # a path format needs the Flax door
        jaxmp.autocast(_model, "O2-bf16", rules=jaxmp.AutocastRules().with_path("a", "O2-nvfp4"))(*_params())


class _Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(64, name="a")(x))
        return nn.Dense(16, name="b")(h)


class _One(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(64, name="a")(x)


def test_the_linen_door_runs_a_path_format_on_that_layer_alone():
    x = jax.random.normal(jax.random.key(1), (8, 32))
    variables = _Two().init(jax.random.key(2), x)
    per_module = jaxmp.flax.mixed_precision(_Two(), "O2-bf16", rules=jaxmp.AutocastRules().with_path("a", "O2-nvfp4"))
    out, inter = per_module.apply(variables, x, capture_intermediates=True)
    a_out = inter["intermediates"]["a"]["__call__"][0]
    # layer a as the preset runs it alone
    alone = jaxmp.flax.mixed_precision(_One(), "O2-nvfp4").apply({"params": {"a": variables["params"]["a"]}}, x)
    assert np.array_equal(np.asarray(a_out, np.float32), np.asarray(alone, np.float32))
    # the other layer as bf16: the same as the preset with layer b given O2-bf16 back
    mirrored = jaxmp.flax.mixed_precision(_Two(), "O2-nvfp4", rules=jaxmp.AutocastRules().with_path("b", "O2-bf16"))
    assert np.array_equal(np.asarray(out), np.asarray(mirrored.apply(variables, x)))
    for other in ("O2-bf16", "O2-nvfp4"):
        assert not np.array_equal(np.asarray(out), np.asarray(jaxmp.flax.mixed_precision(_Two(), other).apply(variables, x)))


def test_the_linen_door_runs_a_class_format():
    x = jax.random.normal(jax.random.key(1), (8, 32))
    variables = _Two().init(jax.random.key(2), x)
    by_class = jaxmp.flax.mixed_precision(_Two(), "O2-bf16", rules=jaxmp.AutocastRules().with_class(nn.Dense, "O2-mxfp8"))
    preset = jaxmp.flax.mixed_precision(_Two(), "O2-mxfp8")
    assert np.array_equal(np.asarray(by_class.apply(variables, x)), np.asarray(preset.apply(variables, x)))


def _nested(p, x):
    with jax.named_scope("outer"):
        with jax.named_scope("inner"):
            return jnp.sum(jnp.square(x @ p["a"]))


def test_the_innermost_scope_format_decides_and_a_float32_region_wins():
    p, x = _params()

    def run(policy, rules=None):
        return _value_and_grad(jaxmp.autocast(_nested, policy, rules=rules), p, x)

    outer_only = jaxmp.AutocastRules().with_scope("outer", "O2-mxfp8")
    assert _equal(run("O2-bf16", outer_only), run("O2-mxfp8"))
    inner_back = outer_only.with_scope("inner", "O2-bf16")
    assert _equal(run("O2-bf16", inner_back), run("O2-bf16"))
    region = jaxmp.AutocastRules().with_scope("outer", "float32").with_scope("inner", "O2-mxfp8")
    assert _equal(run("O2-bf16", region), _value_and_grad(_nested, p, x))  # float32, as traced


def test_a_scope_format_that_matches_nothing_warns():
    p, x = _params()
    with pytest.warns(jaxmp.MixedPrecisionWarning, match="'nowhere' matches no name scope"):
        jaxmp.autocast(_model, "O2-bf16", rules=jaxmp.AutocastRules().with_scope("nowhere", "O2-mxfp8"))(p, x)


def test_the_debuggers_rules_code_keeps_the_formats():
    from jaxmp.diagnostics._fix import rules_code

    rules = (jaxmp.AutocastRules().with_scope("a", "O2-nvfp4")
             .with_scope("b", fp8.CurrentScaling(block=(1, 32), scale_format="e8m0", scale_rule="rceil")))
    ns = {"jaxmp": jaxmp, "jnp": jnp}
    exec(rules_code(rules, "head"), ns)
    assert ns["rules"] == rules.with_scope("head", "float32")


class _NnxTwo:
    """Two NNX layers ``a`` and ``b``, built afresh from one seed (a door may store params in place)."""

    @staticmethod
    def make():
        from flax import nnx

        class Two(nnx.Module):
            def __init__(self, rngs):
                self.a = nnx.Linear(32, 64, rngs=rngs)
                self.b = nnx.Linear(64, 16, rngs=rngs)

            def __call__(self, x):
                return self.b(jnp.tanh(self.a(x)))

        return Two(nnx.Rngs(2))


def _nnx_run(policy, rules=None):
    x = jax.random.normal(jax.random.key(1), (8, 32))
    return np.asarray(jaxmp.flax.mixed_precision(_NnxTwo.make(), policy, rules=rules)(x))


def test_the_nnx_door_runs_a_path_format_on_that_layer_alone():
    per_module = _nnx_run("O2-bf16", jaxmp.AutocastRules().with_path("a", "O2-nvfp4"))
    # layer a in NVFP4, b in bf16: the preset with layer b given O2-bf16 back, and not bf16 everywhere
    assert np.array_equal(per_module, _nnx_run("O2-nvfp4", jaxmp.AutocastRules().with_path("b", "O2-bf16")))
    assert not np.array_equal(per_module, _nnx_run("O2-bf16"))


@pytest.mark.slow
def test_the_nnx_door_runs_class_formats_float32_paths_and_refuses_delayed_scaling_with_formats():
    from flax import nnx

    run = _nnx_run
    per_module = run("O2-bf16", jaxmp.AutocastRules().with_path("a", "O2-nvfp4"))
    assert not np.array_equal(per_module, run("O2-nvfp4"))
    # a class format on every Linear: the preset's own whole-model format
    assert np.array_equal(run("O2-bf16", jaxmp.AutocastRules().with_class(nnx.Linear, "O2-mxfp8")), run("O2-mxfp8"))
    # a float32 path keeps its layer out of the preset's format
    f32_b = run("O2-mxfp8", jaxmp.AutocastRules().with_path("b", "float32"))
    assert not np.array_equal(f32_b, run("O2-mxfp8"))
    with pytest.raises(ValueError, match="delayed-scaling"):
        run("O2-fp8", jaxmp.AutocastRules(fp8_matmuls=fp8.DelayedScaling()).with_path("a", "O2-mxfp8"))
