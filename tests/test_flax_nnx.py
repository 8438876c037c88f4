"""NNX models under a policy: op dtypes, gradients, storage, nnx.Optimizer training and skipped steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _op_dtypes import (
    assert_matmuls_in,
    assert_scope_fp32,
    op_dtypes,
)
from flax import nnx

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
    rules = jaxmp.flax.nnx.module_rules(o1.model, o1.policy, o1.overrides)
    assert rules[("bn0",)].kind == "fp32" and rules[("conv0",)].kind == "half"


def test_bad_models():
    with pytest.raises(TypeError, match="instantiate"):
        jaxmp.flax.mixed_precision(TinyResNet, "O1")

    class NoCall(nnx.Module):
        pass

    with pytest.raises(TypeError, match="__call__"):
        jaxmp.flax.mixed_precision(NoCall(), "O1")
    with pytest.raises(TypeError, match="Module subclass"):
        jaxmp.flax.PrecisionOverrides().with_fp32("nnx.BatchNorm")


def same_bits(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


@pytest.mark.parametrize("kind", ["cnn", "transformer"])
@pytest.mark.parametrize("level", ["O1-fp16", "O1-bf16"])
def test_training_with_nnx_optimizer(kind, level):
    recipe = jaxmp.get_recipe(level)

    def build():
        model = jaxmp.flax.mixed_precision(MODELS[kind](nnx.Rngs(0)), recipe)
        return model, nnx.Optimizer(model, jaxmp.loss_scaling(optax.adam(1e-2), recipe.loss_scale), wrt=nnx.Param)

    # NNX's functional API: one compiled init and one compiled step instead of many eager ops.
    graphdef, _ = nnx.split(nnx.eval_shape(build))
    model, optimizer = nnx.merge(graphdef, jax.jit(lambda: nnx.state(build()), compiler_options=FAST)())

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
        assert bool(metrics["finite"])
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert all(p.dtype == F32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))

    before = jax.tree.map(np.asarray, (nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat),
                                      jaxmp.flax.nnx.optimizer_state(optimizer).inner_state))
    x = x.copy()
    x[0] = np.inf
    metrics = step(model, optimizer, (x, y))
    assert not bool(metrics["finite"])
    after = (nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat),
             jaxmp.flax.nnx.optimizer_state(optimizer).inner_state)
    assert same_bits(after, before)
    assert int(optimizer.step[...]) == 5  # applied steps only
    stats = jaxmp.scaling_stats(jaxmp.flax.nnx.optimizer_state(optimizer))
    assert int(stats["total_skips"]) == 1
