"""NNX models under a policy: op dtypes, gradients, storage, nnx.Optimizer training and skipped steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tests._support._op_dtypes import (
    assert_matmuls_in,
    assert_scope_fp32,
    op_dtypes,
)
from flax import nnx
from tests._support._numpy_init import numpy_variables

import jaxmp

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


class TinyResNet(nnx.Module):
    def __init__(self, rngs):
        self.conv0 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn0 = nnx.BatchNorm(8, rngs=rngs)
        self.conv1 = nnx.Conv(8, 8, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn0(self.conv0(x)))
        x = nnx.relu(x + self.bn1(self.conv1(x)))
        return self.head(x.mean(axis=(1, 2)))


class TinyTransformer(nnx.Module):
    def __init__(self, rngs, d=8):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
        self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)
        self.head = nnx.Linear(d, 4, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))
        return self.head(x.mean(axis=1))


MODELS = {"cnn": TinyResNet, "transformer": TinyTransformer}


def make_batch(kind, n=8):
    rng = np.random.default_rng(1)
    shape = (n, 6, 6, 3) if kind == "cnn" else (n, 5, 8)
    return rng.normal(size=shape).astype(np.float32), rng.integers(0, 4, n).astype(np.int32)


def abstract_model(kind, level):
    """The wrapped model with abstract (shape-only) state: tracing needs no real init."""
    return nnx.eval_shape(lambda: jaxmp.flax.mixed_precision(MODELS[kind](nnx.Rngs(0)), level))


def traced_ops(model, x, y):
    graphdef, state = nnx.split(model)

    def loss_fn(state):
        logits = nnx.merge(graphdef, state)(x)
        return jaxmp.flax.softmax_cross_entropy(logits, y)

    return op_dtypes(loss_fn, state)


def grad_dtypes(model, x, y):
    graphdef, state = nnx.split(model)

    def grads(state):
        loss_fn = lambda m: jaxmp.flax.softmax_cross_entropy(m(x), y)
        return nnx.grad(loss_fn)(nnx.merge(graphdef, state))  # w.r.t. the nnx.Param leaves

    return jax.eval_shape(grads, state)


def test_resnet_op_dtypes(strict_promotion):
    model = abstract_model("cnn", "O1-fp16")
    x, y = make_batch("cnn")
    ops = traced_ops(model, x, y)
    assert_matmuls_in(ops, F16)
    assert_scope_fp32(ops, "BatchNorm")
    assert [op.out_dtypes for op in ops if op.primitive == "log"][-1:] == [(F32,)]  # the loss
    grads = grad_dtypes(model, x, y)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    assert all(s.dtype == F32 for s in jax.tree.leaves(nnx.state(model, nnx.BatchStat)))


def test_transformer_op_dtypes(strict_promotion):
    model = abstract_model("transformer", "O1-fp16")
    x, y = make_batch("transformer")
    ops = traced_ops(model, x, y)
    # Fused attention: cuDNN in half on a GPU; on XLA:CPU (no f16 x f16 -> f32 dot) in float32.
    attention = [op for op in ops if "jaxmp[keep]:dot_product_attention" in op.scope]
    assert attention
    assert_matmuls_in([op for op in ops if op not in attention], F16)
    assert_scope_fp32(ops, "LayerNorm")
    exps = [op for op in ops if op.primitive == "exp"]
    assert any("MultiHeadAttention" in op.scope for op in exps)
    assert all(op.in_dtypes == (F32,) for op in exps)  # attention softmax and the loss
    assert all(g.dtype == F32 for g in jax.tree.leaves(grad_dtypes(model, x, y)))


def test_storage_and_wrapper_behaviour():
    o2 = abstract_model("cnn", "O2-bf16")
    assert o2.model.conv0.kernel.dtype == BF16 and o2.model.head.kernel.dtype == BF16
    assert o2.model.bn0.scale.dtype == F32 and o2.model.bn0.mean.dtype == F32
    o1 = abstract_model("cnn", "O1-bf16")
    assert o1.model.conv0.kernel.dtype == F32
    # The user's model object is never re-classed; only the throw-away copy is.
    assert type(o1.model.bn0) is nnx.BatchNorm
    rules = jaxmp.flax.nnx.module_rules(o1.model, o1.policy, o1.rules)
    assert rules[("bn0",)].action == "float32" and rules[("conv0",)].action == "half"


def test_bad_models():
    with pytest.raises(TypeError, match="instantiate"):
        jaxmp.flax.mixed_precision(TinyResNet, "O1")

    class NoCall(nnx.Module):
        pass

    with pytest.raises(TypeError, match="__call__"):
        jaxmp.flax.mixed_precision(NoCall(), "O1")
    with pytest.raises(TypeError, match="pass the class itself"):
        jaxmp.flax.default_rules().with_class("nnx.BatchNorm", "float32")


def same_bits(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("kind,level", [("cnn", "O1-fp16"), ("cnn", "O1-bf16"),
                                        pytest.param("transformer", "O1-bf16", marks=pytest.mark.slow),
                                        pytest.param("transformer", "O1-fp16", marks=pytest.mark.slow)])
def test_training_with_nnx_optimizer(kind, level):
    recipe = jaxmp.get_recipe(level)

    # The model's init traced and filled in numpy (compiling it, random draws included, costs more
    # than the step); the optimizer's state is built for real, eagerly (a few zeros and scalars).
    mgraph, mstate = nnx.split(nnx.eval_shape(lambda: jaxmp.flax.mixed_precision(MODELS[kind](nnx.Rngs(0)), recipe)))
    model = nnx.merge(mgraph, jax.tree.map(jnp.asarray, numpy_variables(mstate)))
    optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.adam(1e-2), recipe.loss_scale), wrt=nnx.Param)
    # NNX's functional API: one compiled step instead of many eager ops.
    graphdef, _ = nnx.split((model, optimizer))

    @functools.partial(jax.jit, compiler_options=FAST)
    def pure_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = jaxmp.flax.nnx.train_step(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics

    def step(model, optimizer, batch):
        state, metrics = pure_step(nnx.state((model, optimizer)), batch)
        nnx.update((model, optimizer), state)
        return metrics

    x, y = make_batch(kind)
    losses = []
    for _ in range(5):
        metrics = step(model, optimizer, (x, y))
        assert bool(metrics["last_step_finite"])
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert all(p.dtype == F32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))

    before = jax.tree.map(np.asarray, (nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat),
                                      jaxmp.flax.nnx.optimizer_state(optimizer).inner_state))
    x = x.copy()
    x[0] = np.inf
    metrics = step(model, optimizer, (x, y))
    assert not bool(metrics["last_step_finite"])
    after = (nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat),
             jaxmp.flax.nnx.optimizer_state(optimizer).inner_state)
    assert same_bits(after, before)
    assert int(optimizer.step[...]) == 5  # applied steps only
    stats = jaxmp.scaling_stats(jaxmp.flax.nnx.optimizer_state(optimizer))
    assert int(stats["total_skips"]) == 1


# -- a layer's explicit dtype=float32 (issue 23 item 2): the policy wins, with a per-layer route --------


class F32Head(nnx.Module):
    """A body Linear left to the policy and a head built with ``dtype=float32``, as Flax's examples build layers."""

    def __init__(self, rngs):
        self.body = nnx.Linear(3, 8, rngs=rngs)
        self.head = nnx.Linear(8, 8, dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.head(self.body(x)))


@pytest.fixture(scope="module")
def f32_head():
    """One F32Head with numpy-valued params; tests wrap ``nnx.clone`` copies of it.

    The tests read dtypes and warnings, not values: an eager NNX init would compile a random draw
    per kernel shape."""
    rng = np.random.default_rng(0)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: F32Head(nnx.Rngs(0))))
    return nnx.merge(graphdef, jax.tree.map(lambda s: jnp.asarray((0.3 * rng.normal(size=s.shape)).astype(s.dtype)),
                                            state))


def _dots(model, x):
    """dot_general input dtypes in program order: body, head, out."""
    return [op.in_dtypes for op in op_dtypes(lambda x: model(x), x) if op.primitive == "dot_general"]


def _abstract_dots(model, x):
    """``_dots`` for a model with abstract (``nnx.eval_shape``) state: the state is a traced argument."""
    graphdef, state = nnx.split(model)
    return [op.in_dtypes for op in op_dtypes(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
            if op.primitive == "dot_general"]


def _overridden_warnings(record):
    return [w for w in record if issubclass(w.category, jaxmp.MixedPrecisionWarning)
            and "set dtype=float32" in str(w.message)]


def test_explicit_float32_layer_runs_in_half_and_warns_once(f32_head):
    x = np.ones((2, 3), np.float32)
    with pytest.warns(jaxmp.MixedPrecisionWarning) as record:
        model = jaxmp.flax.mixed_precision(nnx.clone(f32_head), "O1-bf16")
        dots = _dots(model, x)
        # Two more calls, traced (the warning is decided in the wrapper's Python, which runs on
        # every trace; nothing compiled): no second warning.
        jax.eval_shape(lambda a: model(a), x)
        jax.eval_shape(lambda a: model(a), x)
    assert dots == [(BF16, BF16)] * 3
    [w] = _overridden_warnings(record)
    message = str(w.message)
    assert "'head' (Linear)" in message and "with_path('head', 'float32')" in message
    assert "'body'" not in message and "'out'" not in message


def test_functional_call_warns_once_per_model(f32_head):
    x, model = np.ones((2, 3), np.float32), nnx.clone(f32_head)
    with pytest.warns(jaxmp.MixedPrecisionWarning) as record:  # traced calls: the warning is decided at trace
        jax.eval_shape(lambda a: jaxmp.flax.nnx.call(model, a, policy="O1-bf16"), x)
        jax.eval_shape(lambda a: jaxmp.flax.nnx.call(model, a, policy="O1-bf16"), x)
    assert len(_overridden_warnings(record)) == 1


@pytest.mark.parametrize("overrides", [jaxmp.flax.default_rules().with_path("head", "float32"),
                                       jaxmp.flax.default_rules().with_path("h*d", "float32")],
                         ids=["path", "glob"])
def test_path_rule_keeps_exactly_that_layer_float32(f32_head, overrides, recwarn):
    x = np.ones((2, 3), np.float32)
    model = jaxmp.flax.mixed_precision(nnx.clone(f32_head), "O1-bf16", overrides)
    assert _dots(model, x) == [(BF16, BF16), (F32, F32), (BF16, BF16)]
    assert jax.eval_shape(lambda a: model(a), x).dtype == F32  # a dtype: traced, not run
    assert not _overridden_warnings(recwarn.list)


def test_path_rule_o2_storage_and_subtree(recwarn):
    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.block = F32Head(rngs)
            self.keep = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.keep(self.block(x))

    x = np.ones((2, 3), np.float32)
    ov = jaxmp.flax.default_rules("O2").with_path("block", "float32")
    # Storage dtypes and a trace: abstract state, no random init compiled.
    model = nnx.eval_shape(lambda: jaxmp.flax.mixed_precision(Outer(nnx.Rngs(0)), "O2-bf16", ov))
    assert {model.model.block.body.kernel.dtype, model.model.block.head.kernel.dtype} == {F32}
    assert model.model.keep.kernel.dtype == BF16
    assert _abstract_dots(model, x) == [(F32, F32)] * 3 + [(BF16, BF16)]
    assert not _overridden_warnings(recwarn.list)


def test_class_rule_keeps_explicit_float32_layers_float32(f32_head, recwarn):
    x = np.ones((2, 3), np.float32)
    model = jaxmp.flax.mixed_precision(nnx.clone(f32_head), "O1-bf16",
                                       jaxmp.flax.default_rules().with_class(nnx.Linear, "float32"))
    assert _dots(model, x) == [(F32, F32)] * 3
    assert not _overridden_warnings(recwarn.list)


def test_path_rule_bad_inputs():
    with pytest.raises(TypeError, match="pass 'layers/0'"):
        jaxmp.flax.default_rules().with_path(("layers", 0), "float32")
    with pytest.raises(TypeError, match=r"with_class\(Linear, 'float32'\)"):
        jaxmp.flax.default_rules().with_path(nnx.Linear, "float32")
    with pytest.raises(ValueError, match="empty component"):
        jaxmp.flax.default_rules().with_path("layers//0", "float32")


class _SeenMask(nnx.Variable):
    """Where the test reads the dropout mask the step drew (an integer: passed through, per replica)."""


class _DropoutBN(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(16, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)
        self.seen = _SeenMask(jnp.zeros((8, 8), jnp.int32))

    def __call__(self, x):
        h = self.drop(nnx.relu(self.bn(self.fc(x))))
        self.seen[...] = (h != 0).astype(jnp.int32)
        return self.head(h)


@pytest.mark.slow  # ~3 s: a pmap NNX step traced and compiled
def test_pmap_train_step_averages_batch_stats_and_draws_a_dropout_mask_per_replica():
    n = 2
    model = jaxmp.flax.mixed_precision(_DropoutBN(nnx.Rngs(0, dropout=1)), "O1-bf16")
    optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(optax.sgd(0.01), "none", axis_name="b"), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = jaxmp.flax.nnx.train_step(model, optimizer, (x, y), axis_name="b")
        return nnx.state((model, optimizer)), metrics

    rng = np.random.default_rng(0)
    # Rows scaled per replica: each replica's batch statistics really differ.
    x = (rng.normal(size=(16, 16)) * np.repeat(np.arange(1, n + 1), 16 // n)[:, None]).astype(np.float32)
    state, _ = jax.pmap(step, axis_name="b", devices=jax.devices()[:n])(
        jaxmp.parallel.replicate(state, jax.devices()[:n]), *jaxmp.parallel.shard_batch((x, np.arange(16) % 3), n))
    inner = state[0]["model"]
    masks = np.asarray(inner["seen"][...])
    assert all(not np.array_equal(masks[0], masks[i]) for i in range(1, n))  # one mask per replica
    mean = np.asarray(inner["bn"]["mean"][...])
    assert all(mean[i].tobytes() == mean[0].tobytes() for i in range(n)) and np.any(mean[0] != 0)
    # The stored RNG keys and counters, params and optimizer state stay replicated.
    for part in (inner["drop"], inner["bn"], inner["fc"], inner["head"], state[1]):
        jaxmp.parallel.check_replicated(part, num_replicas=n)


def test_a_block_kept_in_float32_by_a_class_rule_stores_its_layers_params_in_float32_under_o2():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.inner = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return self.inner(x)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.enc, self.head = Block(rngs), nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(self.enc(x))

    ov = jaxmp.flax.default_rules("O2").with_class(Block, "float32")
    # Storage dtypes only: abstract state, no random init compiled.
    model = nnx.eval_shape(lambda: jaxmp.flax.nnx.store_params(Net(nnx.Rngs(0)), "O2-bf16", ov))
    assert model.enc.inner.kernel.dtype == np.float32
    assert model.head.kernel.dtype == jnp.bfloat16
