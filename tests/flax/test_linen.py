"""Linen models under a policy: the dtype of every matmul, conv, norm and softmax, and the rules API.

Dtypes are read from the traced program (``jax.make_jaxpr``), which is the ground truth for
what precision each primitive ran in; Linen's name stack tells which module emitted it.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tests._support._op_dtypes import (
    assert_matmuls_in,
    assert_scope_fp32,
    op_dtypes,
)

import jaxmp
from jaxmp.flax import default_rules

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


class ResBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        y = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        y = nn.BatchNorm(use_running_average=not train)(y)
        return nn.relu(x + y)


class TinyResNet(nn.Module):
    """Conv + BatchNorm + residual + Dense: the ResNet pattern in miniature."""

    num_classes: int = 4

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = ResBlock(8)(nn.relu(x), train)
        return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))


class TinyTransformer(nn.Module):
    """Pre-LN Transformer block (LayerNorm + self-attention + MLP) with a classifier head."""

    num_classes: int = 4

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(h, h)
        h = nn.LayerNorm()(x)
        x = x + nn.Dense(d)(nn.gelu(nn.Dense(2 * d)(h)))
        return nn.Dense(self.num_classes)(x.mean(axis=1))


# numpy inputs: eager jnp arithmetic compiles a program per op (test data only).
IMG = np.ones((2, 6, 6, 3), np.float32) * np.linspace(-1, 1, 3, dtype=np.float32)
SEQ = np.ones((2, 5, 8), np.float32) * np.linspace(-1, 1, 8, dtype=np.float32)
LABELS = np.array([0, 3], np.int32)


@pytest.fixture(scope="module")
def resnet():
    model = jaxmp.flax.mixed_precision(TinyResNet(), "O1-fp16")
    return model, jax.eval_shape(lambda key: model.init(key, IMG, train=False), jax.random.key(0))


@pytest.fixture(scope="module")
def transformer():
    model = jaxmp.flax.mixed_precision(TinyTransformer(), "O1-fp16")
    return model, jax.eval_shape(lambda key: model.init(key, SEQ), jax.random.key(0))


@pytest.mark.standard_promotion(reason="shows plain Flax promoting float16 inputs with float32 params (Flax's promote_dtype)")
def test_plain_flax_promotion_undoes_half_inputs():
    # The pitfall the integration exists for: float32 params + float16 inputs => float32 matmul.
    dense = nn.Dense(3)
    params = jax.eval_shape(dense.init, jax.random.key(0), np.ones((1, 4), np.float32))
    ops = op_dtypes(lambda p: dense.apply(p, jnp.ones((1, 4), jnp.float16)), params)
    assert [op.in_dtypes for op in ops if op.primitive == "dot_general"] == [(F32, F32)]
    model = jaxmp.flax.mixed_precision(dense, "O1-fp16")
    assert_matmuls_in(op_dtypes(lambda p: model.apply(p, jnp.ones((1, 4))), params), F16)


def test_resnet_op_dtypes(resnet, strict_promotion):
    model, variables = resnet

    def forward(v):
        return model.apply(v, IMG, train=True, mutable=["batch_stats"])

    ops = op_dtypes(forward, variables)
    assert_matmuls_in(ops, F16)
    assert_scope_fp32(ops, "BatchNorm_0")
    logits, updates = jax.eval_shape(forward, variables)  # dtypes only: no need to run it
    assert logits.dtype == F32
    assert all(x.dtype == F32 for x in jax.tree.leaves(updates["batch_stats"]))


def test_resnet_module_outputs_and_grads(resnet, strict_promotion):
    model, variables = resnet
    seen = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__":
            seen["/".join(context.module.path) or "root"] = out.dtype
        return out

    def loss_fn(params, batch_stats):
        with nn.intercept_methods(record):
            logits, _ = model.apply({"params": params, "batch_stats": batch_stats}, IMG, train=True,
                                    mutable=["batch_stats"])
        return jaxmp.flax.softmax_cross_entropy(logits, LABELS)

    loss, grads = jax.eval_shape(jax.value_and_grad(loss_fn), variables["params"], variables["batch_stats"])
    assert loss.dtype == F32
    # O1 casts only the weights (kernels) before the model runs: a float32 bias makes Flax's own
    # promote_dtype trace each layer's output float32 (the engine runs the convs in half:
    # test_resnet_op_dtypes); BatchNorm hands back its input's dtype.
    assert seen["Conv_0"] == F32 and seen["ResBlock_0/Conv_0"] == F32 and seen["Dense_0"] == F32
    assert seen["BatchNorm_0"] == F32 and seen["ResBlock_0/BatchNorm_0"] == F32
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))


def test_transformer_op_dtypes(transformer, strict_promotion):
    model, variables = transformer

    def loss_fn(params):
        logits = model.apply({"params": params}, SEQ)
        return jaxmp.flax.softmax_cross_entropy(logits, LABELS)

    ops = op_dtypes(loss_fn, variables["params"])
    # Attention is fused: on a GPU one cuDNN call in half; XLA:CPU has no float16 x float16 ->
    # float32 dot, so there the routed attention computes in float32.
    attention = [op for op in ops if "jaxmp[keep]:dot_product_attention" in op.scope]
    assert attention and all(op.in_dtypes[0] == F32 for op in attention if op.primitive == "dot_general")
    assert_matmuls_in([op for op in ops if op not in attention], F16)
    assert_scope_fp32(ops, "LayerNorm_0")
    assert_scope_fp32(ops, "LayerNorm_1")
    exps = [op for op in ops if op.primitive == "exp"]
    assert any("MultiHeadDotProductAttention" in op.scope for op in exps)
    assert all(op.in_dtypes == (F32,) for op in exps), exps  # attention softmax and the loss
    grads = jax.eval_shape(jax.grad(loss_fn), variables["params"])
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))


@pytest.mark.standard_promotion(reason="O3 leaves LayerNorm to Flax, whose _normalize mixes its float32 statistics with float16 params")
def test_recipes_choose_categories(transformer):
    _, variables = transformer
    ops = {}
    for level in ("O2-fp16", "O3-fp16"):
        model = jaxmp.flax.mixed_precision(TinyTransformer(), level)
        ops[level] = op_dtypes(lambda p: model.apply(p, SEQ), variables)
    # O2: norms still float32; attention is fused (cuDNN on a GPU, XLA with a float32 softmax
    # here); with Flax's own attention instead, the softmax follows the compute dtype.
    assert_scope_fp32(ops["O2-fp16"], "LayerNorm_0")
    assert [op.in_dtypes for op in ops["O2-fp16"] if op.primitive == "exp"] == [(F32,)]
    assert any("jaxmp[keep]:dot_product_attention" in op.scope for op in ops["O2-fp16"])
    unfused = jaxmp.flax.mixed_precision(
        TinyTransformer(), "O2-fp16", dataclasses.replace(default_rules("O2"), fused_attention=False))
    assert [op.in_dtypes for op in op_dtypes(lambda p: unfused.apply(p, SEQ), variables)
            if op.primitive == "exp"] == [(F16,)]
    # O3: nothing kept in float32 by jaxmp: LayerNorm's scale and bias arrive in half (Flax
    # itself still upcasts for its statistics).
    norm = [op for op in ops["O3-fp16"] if "LayerNorm_0" in op.scope]
    assert any(op.primitive == "reshape" and op.in_dtypes == (F16,) for op in norm)


def test_storage_dtypes_follow_the_recipe():
    o2 = jaxmp.flax.mixed_precision(TinyResNet(), "O2-bf16")
    v2 = jax.eval_shape(lambda k: o2.init(k, IMG, train=False), jax.random.key(0))
    p = v2["params"]
    assert p["Conv_0"]["kernel"].dtype == BF16 and p["Dense_0"]["kernel"].dtype == BF16
    assert p["BatchNorm_0"]["scale"].dtype == F32 and p["ResBlock_0"]["BatchNorm_0"]["bias"].dtype == F32
    assert all(x.dtype == F32 for x in jax.tree.leaves(v2["batch_stats"]))
    o3 = jaxmp.flax.mixed_precision(TinyResNet(), "O3-bf16")
    v3 = jax.eval_shape(lambda k: o3.init(k, IMG, train=False), jax.random.key(0))
    assert all(x.dtype == BF16 for x in jax.tree.leaves(v3["params"]))


class MyNorm(nn.Module):
    """A user's own normalisation with a param and a Dense inside."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x = nn.Dense(x.shape[-1])(x)
        return x * scale / (jnp.abs(x).mean(-1, keepdims=True) + 1e-3)


class UsesMyNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(MyNorm()(nn.Dense(8)(x)))


def test_user_class_overrides(strict_promotion):
    x = np.ones((2, 8), np.float32)
    rules = default_rules("O1").with_class(MyNorm, "float32").with_class(nn.Dense, jaxmp.get_policy("f32"))
    model = jaxmp.flax.mixed_precision(UsesMyNorm(), "O1-bf16", rules)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    rules = model.module_rules(variables, x)
    assert rules[("MyNorm_0",)].action == "float32" and rules[("Dense_0",)].action == "policy"
    ops = op_dtypes(lambda v: model.apply(v, x), variables)
    # Every Dense has its own float32 policy, under a bf16 model policy; MyNorm runs in float32.
    assert [op.in_dtypes for op in ops if op.primitive == "dot_general"] == [(F32, F32)] * 3
    assert jax.eval_shape(model.apply, variables, x).dtype == F32
    # Default lists: MyNorm is in none, so it follows its inputs. Its own param is no weight
    # (a mul, not a matmul, uses it): it enters float32, and so does the Dense output it meets,
    # which a float32 mean also reads (O1 keeps a value float32 where one is needed).
    plain = jaxmp.flax.mixed_precision(UsesMyNorm(), "O1-bf16")
    assert ("MyNorm_0",) not in plain.module_rules(variables, x)
    ops = op_dtypes(lambda v: plain.apply(v, x), variables)
    assert_matmuls_in(ops, BF16)
    muls = [op for op in ops if "MyNorm_0" in op.scope and op.primitive == "mul"]
    assert muls and all(d == F32 for op in muls for d in op.in_dtypes)


def test_class_rules_edit():
    rules, policy = default_rules(), jaxmp.get_policy("O1-bf16")
    assert dict(rules.class_rules)[nn.BatchNorm] == "float32" and dict(rules.class_rules)[nn.Dense] == "half"
    moved = rules.with_class(nn.BatchNorm, "half")
    assert dict(moved.class_rules)[nn.BatchNorm] == "half"
    gone = rules.with_class(nn.Dense, "follow").with_class(nn.LayerNorm, "follow")
    assert nn.Dense not in dict(gone.class_rules) and nn.LayerNorm not in dict(gone.class_rules)
    assert gone.module_rules(policy).rule_for(nn.Dense(3)) is None
    assert rules.module_rules(policy).rule_for(nn.SelfAttention).action == "half"  # subclass
    assert hash(rules) == hash(default_rules())
    assert default_rules(keep_float32=("norm", "loss")) == default_rules("O2")
    assert "float32" not in dict(default_rules("O3").class_rules).values()


@pytest.mark.parametrize("bad", ["BatchNorm", nn.BatchNorm(), jnp.tanh])
def test_a_class_rule_must_name_a_class(bad):
    with pytest.raises(TypeError, match="module class"):
        default_rules().with_class(bad, "float32")
    with pytest.raises(TypeError, match="module class"):
        jaxmp.AutocastRules(class_rules=((bad, "float32"),))


def test_bad_arguments():
    with pytest.raises(ValueError, match="categories"):
        default_rules(keep_float32=("norm", "matmul"))
    with pytest.raises(ValueError, match="int8"):
        jaxmp.flax.mixed_precision(nn.Dense(3), "p=f32,c=int8")
    with pytest.raises(TypeError, match="floating"):
        jaxmp.flax.mixed_precision(nn.Dense(3), type("P", (), {"param_dtype": jnp.float32,
                                                              "compute_dtype": jnp.int32,
                                                              "output_dtype": jnp.float32})())
    with pytest.raises(TypeError, match="instantiate"):
        jaxmp.flax.mixed_precision(nn.Dense, "O1")
    with pytest.raises(TypeError, match="Module instance"):
        jaxmp.flax.mixed_precision(lambda x: x, "O1")
    with pytest.raises(TypeError, match="rules must be a jaxmp.AutocastRules"):
        jaxmp.flax.mixed_precision(nn.Dense(3), "O1", rules=3)


class ScannedLayers(nn.Module):
    """Lifted transforms: params of scanned / rematerialised layers live under the transform's path."""

    @nn.compact
    def __call__(self, x):
        def layer(mdl, x, _):
            return nn.Dense(8)(nn.LayerNorm()(x)), None

        x, _ = nn.scan(nn.remat(type("Layer", (nn.Module,), {"__call__": nn.compact(layer)})),
                       variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()(x, None)
        return nn.Dense(2)(x)


def test_lifted_transforms(strict_promotion):
    x = np.ones((2, 8), np.float32)
    model = jaxmp.flax.mixed_precision(ScannedLayers(), "O1-bf16")
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    assert {rule.action for rule in model.module_rules(variables, x).values()} == {"half", "float32"}
    ops = op_dtypes(lambda v: model.apply(v, x), variables)
    assert_matmuls_in(ops, BF16)
    assert {op.in_dtypes for op in ops if op.primitive == "rsqrt"} == {(F32,)}


def test_float32_softmax_attention_matches_flax():
    q, k, v = (np.random.default_rng(i).normal(size=(2, 5, 2, 4)).astype(np.float32) for i in range(3))
    mask = np.tril(np.ones((5, 5), bool))[None, None]

    @jax.jit
    def both(q, k, v):
        ref = nn.dot_product_attention(q, k, v, mask=mask)
        out = jaxmp.flax.float32_softmax_attention(q, k, v, mask=mask)
        half = jaxmp.flax.float32_softmax_attention(q.astype(F16), k.astype(F16), v.astype(F16), is_causal=True)
        return ref, out, half

    ref, out, half = both(q, k, v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert half.dtype == F16
    np.testing.assert_allclose(half.astype(F32), ref, atol=2e-2)


# -- a layer's explicit dtype=float32 (issue 23 item 2): the policy wins, with a per-layer route --------


class F32Head(nn.Module):
    """A body Dense left to the policy and a head built with ``dtype=float32``, as Flax's examples build layers."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="body")(x)
        x = nn.Dense(8, dtype=jnp.float32, name="head")(x)
        return nn.Dense(4, name="out")(x)


def _dots(fn, *args):
    """{layer name: dot_general input dtypes} from the traced program."""
    return {op.scope.split("/F32Head/")[1].split("/")[0]: op.in_dtypes
            for op in op_dtypes(fn, *args) if op.primitive == "dot_general"}


def _overridden_warnings(record):
    return [w for w in record if issubclass(w.category, jaxmp.MixedPrecisionWarning)
            and "set dtype=float32" in str(w.message)]


@pytest.fixture(scope="module")
def f32_head():
    x = np.ones((2, 3), np.float32)
    # The tests read dtypes and warnings, not values: numpy values in the init's structure (an eager
    # Flax init would compile a random draw per kernel shape, a jitted one a whole program).
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(F32Head().init, jax.random.key(0), x)
    return x, jax.tree.map(lambda s: (0.3 * rng.normal(size=s.shape)).astype(s.dtype), shapes)


def test_explicit_float32_layer_runs_in_half_and_warns_once(f32_head):
    x, variables = f32_head
    model = jaxmp.flax.mixed_precision(F32Head(), "O1-bf16")
    with pytest.warns(jaxmp.MixedPrecisionWarning) as record:
        dots = _dots(model.apply, variables, x)     # first trace
        # Two more calls, traced afresh (a new lambda each: no trace cache), so the wrapper's Python,
        # where the warning is decided, runs again without compiling anything: no second warning.
        jax.eval_shape(lambda v, a: model.apply(v, a), variables, x)
        jax.eval_shape(lambda v, a: model.apply(v, a), variables, x)
    assert dots == {"body": (BF16, BF16), "head": (BF16, BF16), "out": (BF16, BF16)}
    [w] = _overridden_warnings(record)
    message = str(w.message)
    assert "'head' (Dense)" in message and "with_path('head', 'float32')" in message and "bfloat16" in message
    assert "'body'" not in message and "'out'" not in message


@pytest.mark.parametrize("overrides", [default_rules().with_path("head", "float32"),
                                       default_rules().with_path("he*", "float32")],
                         ids=["path", "glob"])
def test_path_rule_keeps_exactly_that_layer_float32(f32_head, overrides, recwarn):
    x, variables = f32_head
    model = jaxmp.flax.mixed_precision(F32Head(), "O1-bf16", overrides)
    assert _dots(model.apply, variables, x) == {"body": (BF16, BF16), "head": (F32, F32), "out": (BF16, BF16)}
    assert jax.eval_shape(model.apply, variables, x).dtype == F32  # a dtype: traced, not run
    assert not _overridden_warnings(recwarn.list)
    rules = model.module_rules(variables, x)
    assert rules[("head",)].action == "float32" and rules[("body",)].action == "half"


def test_path_rule_covers_a_subtree_and_o2_storage(recwarn):
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="keep")(F32Head(name="block")(x))

    x = np.ones((2, 3), np.float32)
    model = jaxmp.flax.mixed_precision(Outer(), "O2-bf16", default_rules("O2").with_path("block", "float32"))
    variables = jax.eval_shape(model.init, jax.random.key(0), x)  # storage dtypes and a trace: no values needed
    params = variables["params"]
    assert {params["block"][k]["kernel"].dtype for k in ("body", "head", "out")} == {F32}   # stored float32
    assert params["keep"]["kernel"].dtype == BF16
    dots = [op.in_dtypes for op in op_dtypes(model.apply, variables, x) if op.primitive == "dot_general"]
    assert dots == [(F32, F32)] * 3 + [(BF16, BF16)]
    assert not _overridden_warnings(recwarn.list)


def test_class_rule_keeps_explicit_float32_layers_float32(f32_head, recwarn):
    x, variables = f32_head
    model = jaxmp.flax.mixed_precision(F32Head(), "O1-bf16", default_rules().with_class(nn.Dense, "float32"))
    assert set(_dots(model.apply, variables, x).values()) == {(F32, F32)}
    assert not _overridden_warnings(recwarn.list)


def test_float32_policy_does_not_warn(f32_head, recwarn):
    x, variables = f32_head
    jax.eval_shape(jaxmp.flax.mixed_precision(F32Head(), "O0").apply, variables, x)  # the warning is decided at trace
    assert not _overridden_warnings(recwarn.list)


@pytest.mark.parametrize("bad, error, match", [
    (("decoder", "head"), TypeError, "pass 'decoder/head'"),
    (nn.Dense, TypeError, r"with_class\(Dense, 'float32'\)"),
    (3, TypeError, "module path string"),
    ("", ValueError, "empty module path"),
    ("/head", ValueError, "empty component"),
    ("decoder//head", ValueError, "empty component"),
    ("head/", ValueError, "empty component"),
    (" head", ValueError, "whitespace"),
])
def test_path_rule_rejects_bad_paths(bad, error, match):
    with pytest.raises(error, match=match):
        default_rules().with_path(bad, "float32")
    with pytest.raises(error, match=match):
        jaxmp.AutocastRules(path_rules=((bad, "float32"),))


def test_path_rule_is_immutable_and_hashable():
    base = jaxmp.AutocastRules()
    rules = base.with_path("a/b", "float32").with_path("*/logits", "float32").with_path("a/b", "float32")
    assert base.path_rules == () and rules.path_rules == (("a/b", "float32"), ("*/logits", "float32"))
    assert hash(rules) == hash(jaxmp.AutocastRules(path_rules=(("a/b", "float32"), ("*/logits", "float32"))))
    assert rules != base
    with pytest.raises(ValueError, match="keeps a layer in 'float32'"):
        base.with_path("a", "half")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rules.path_rules = ()


# -- O2 at the two front doors: autocast keeps softmax in float32, jaxmp.flax runs it in half ----------


class SoftmaxHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jax.nn.softmax(nn.Dense(4)(x), axis=-1)


def _softmax_decisions(report):
    return {op.primitive: (op.in_dtypes, op.rule) for op in report.decisions
            if op.primitive in ("reduce_max", "exp", "reduce_sum")}


def test_o2_softmax_differs_between_the_front_doors_and_the_report_shows_it():
    x = np.ones((2, 3), np.float32)
    net = SoftmaxHead()
    # precision_report only traces: shapes and dtypes of the variables are all it needs.
    variables = jax.eval_shape(net.init, jax.random.key(0), x)
    autocast = _softmax_decisions(jaxmp.precision_report(jaxmp.autocast(net.apply, "O2-bf16"), variables, x))
    wrapped = jaxmp.flax.mixed_precision(net, "O2-bf16")
    flax_o2 = _softmax_decisions(jaxmp.precision_report(wrapped.apply, jax.eval_shape(wrapped.init, jax.random.key(0), x), x))
    # autocast: the O1 lists plus half weights -- the softmax's max, exp and sum on the float32 list.
    assert autocast == {p: (("f32",), "float32 list") for p in ("reduce_max", "exp", "reduce_sum")}
    # jaxmp.flax (Apex O2): pure half outside norms -- the max and exp in bf16 (JAX's own sum upcasts).
    assert flax_o2["reduce_max"] == (("bf16",), "follow") and flax_o2["exp"] == (("bf16",), "follow")
    assert flax_o2["reduce_sum"][1] != "float32 list"
    # The documented route to autocast's O2 behind jaxmp.flax: keep the "softmax" category.
    same = jaxmp.flax.mixed_precision(net, "O2-bf16", default_rules("O2-bf16", ("norm", "softmax", "loss")))
    assert _softmax_decisions(jaxmp.precision_report(same.apply, jax.eval_shape(same.init, jax.random.key(0), x),
                                                     x)) == autocast


def test_overrides_and_autocast_class_rules_are_one_rule_system():
    """Both front doors compile to the engine's ModuleRules; rule_at is the one decision."""
    from flax import nnx

    from jaxmp.engine._config import flax_config, resolve_config
    from jaxmp.engine._modules import install_call_hooks
    from jaxmp.engine._module_rules import ModuleRules

    policy = jaxmp.get_policy("O1-bf16")
    ov = default_rules("O1").with_path("head", "float32").with_class(nn.Embed, jaxmp.get_policy("f32"))
    rules = ov.module_rules(policy)
    assert isinstance(rules, ModuleRules) and flax_config(policy, ov).modules == rules
    assert [rules.rule_at(p, c).action for p, c in [(("body",), nn.LayerNorm), (("head",), nn.Dense),
                                                     (("body",), nn.Dense), (("x",), nn.Embed)]] == \
        ["float32", "float32", "half", "policy"]
    config = resolve_config("O1-bf16", jaxmp.AutocastRules().with_class(nn.LayerNorm, "float32"))
    assert config.modules.rule_for(nn.LayerNorm).region == "float32"
    assert config.modules.rule_for(nn.LayerNorm).action == "region"
    # The Flax door's rules are refused by autocast by name, not run half-way.
    with pytest.raises(ValueError, match="path rules"):
        resolve_config("O1-bf16", ov.with_class(nn.Embed, "follow"))
    with pytest.raises(TypeError, match="Flax door rule"):
        resolve_config("O1-bf16", jaxmp.AutocastRules().with_class(nn.Embed, jaxmp.get_policy("f32")))
    # The NNX / Equinox hook is installed once per class and stays Flax's call outside a trace.
    install_call_hooks([nnx.LayerNorm])
    hook = nnx.LayerNorm.__call__
    install_call_hooks([nnx.LayerNorm])
    assert nnx.LayerNorm.__call__ is hook and hook.__wrapped__ is not None
    assert not hasattr(nn.Module.param, "__wrapped__")  # Linen params are cast by path, not by a patch


@pytest.mark.parametrize("override", ["class", "policy"])
def test_a_block_kept_in_float32_by_a_class_rule_stores_its_layers_params_in_float32_under_o2(override):
    # with_class(Block, "float32") names the whole block: its Dense (a half-list layer) computed in float32
    # but was stored, and so rounded, in bfloat16, 6e-3 off plain float32 Flax.
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16, name="inner")(x)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(Block(name="enc")(x))

    base = default_rules("O2")
    ov = base.with_class(Block, "float32" if override == "class" else jaxmp.get_policy("float32"))
    # Storage dtypes only: traced, not run.
    variables = jax.eval_shape(jaxmp.flax.mixed_precision(Net(), "O2-bf16", ov).init, jax.random.key(0),
                               np.ones((2, 8), np.float32))
    params = variables["params"]
    assert params["enc"]["inner"]["kernel"].dtype == np.float32
    assert params["head"]["kernel"].dtype == jnp.bfloat16


# ---- issue 48, defect 4: a rules object at the Flax door keeps the preset's rules ----

class _NormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.LayerNorm()(nn.Dense(4)(x)))


@pytest.mark.parametrize("name", __import__("jaxmp._precision._presets", fromlist=["_"]).PRESET_NAMES)
def test_flax_door_merges_a_rules_object_onto_the_presets_rules(name):
    base = default_rules(name)
    wrapped = jaxmp.flax.mixed_precision(_NormNet(), name, jaxmp.AutocastRules().with_float32("tanh"))
    rules = wrapped.rules
    expected = "narrow" if name.startswith(("O2", "O3")) else "demand"
    assert base.promote == rules.promote == expected, (name, rules.promote)
    assert rules.class_rules == base.class_rules                 # norms in float32 stay (O3: none)
    assert rules.float32_ops == base.float32_ops | {"tanh"}      # the preset's op list, plus the edit
    assert rules.float32_loss == base.float32_loss and rules.fp8_matmuls == base.fp8_matmuls
    # a whole rule set (default_rules edited) is used as given
    whole = default_rules("O1").with_path("head", "float32")
    assert jaxmp.flax.mixed_precision(_NormNet(), name, whole).rules == whole


def test_flax_door_with_a_rules_object_keeps_layernorm_params_in_float32_at_o2():
    x = np.ones((2, 3), np.float32)
    for rules, norm in ((jaxmp.AutocastRules().with_float32("tanh"), F32),
                        (jaxmp.AutocastRules().with_class(nn.LayerNorm, "follow"), BF16)):
        wrapped = jaxmp.flax.mixed_precision(_NormNet(), "O2-bf16", rules)
        params = jax.eval_shape(wrapped.init, jax.random.key(0), x)["params"]
        # O2 stores half params; the preset's float32 class rule keeps the norm's in float32
        # ("follow" takes that rule off), and the Dense stays half either way
        assert params["LayerNorm_0"]["scale"].dtype == norm, rules
        assert params["Dense_0"]["kernel"].dtype == BF16
