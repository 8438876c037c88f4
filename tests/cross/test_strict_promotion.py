"""A user who runs JAX with strict dtype promotion can use jaxmp end to end.

Strict promotion (``jax.numpy_dtype_promotion("strict")``) turns every implicit mix of dtypes
into an error: the setting careful mixed-precision users choose so that an fp16 value never
meets an fp32 one by accident. jaxmp's own code must therefore never promote implicitly. These
tests set strict promotion themselves (as the user would), on top of the suite-wide default in
conftest.py, and run forward, gradient and a loss-scaled optax step through ``jaxmp.autocast``
and the Flax front door (Linen and NNX). The optimizer is ``optax.sgd``: optax's Adam is not
strict-clean itself (its bias correction raises a Python float to an int32 count).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tests._support._numpy_init import numpy_variables

import jaxmp

F32, BF16, F16 = np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float16")
# numpy inputs: an eager jax.random draw compiles a program per shape (test data only).
_RNG = np.random.default_rng(1)
X = _RNG.normal(size=(16, 8)).astype(np.float32)
Y = np.argmax(X[:, :4], axis=-1).astype(np.int32)


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


@pytest.fixture(autouse=True)
def _strict():
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.mark.parametrize("level", ["O1-bf16", "O2-fp16"])
def test_autocast_forward_grad_and_scaled_step_under_strict_promotion(level):
    def net(params, x):
        h = jax.nn.gelu(x @ params["w1"] + params["b1"])
        h = h - jnp.mean(h, axis=-1, keepdims=True)
        return jax.nn.log_softmax(h @ params["w2"])

    rng = np.random.default_rng(0)
    params = {"w1": (rng.normal(size=(8, 16)) * 0.3).astype(np.float32), "b1": np.zeros(16, np.float32),
              "w2": (rng.normal(size=(16, 4)) * 0.3).astype(np.float32)}
    fwd = jaxmp.autocast(net, level)
    # Traced, not compiled: each op's promotion is checked under strict promotion at trace time, and
    # only dtypes are asserted here (the jitted step below runs forward and gradient for real).
    assert jax.eval_shape(fwd, params, X).dtype == F32

    def loss(p):
        return -jnp.mean(jnp.take_along_axis(fwd(p, X), Y[:, None], axis=-1))

    grads = jax.eval_shape(jax.grad(loss), params)
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
    tx = jaxmp.loss_scaling(optax.sgd(0.5), "dynamic")
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        value, grads = jaxmp.value_and_grad(loss, opt)(params)
        updates, opt = tx.update(grads, opt, params)
        return jaxmp.apply_updates(params, updates, opt), opt, value

    losses = []
    for _ in range(15):
        params, opt, value = step(params, opt)
        losses.append(float(value))
    assert np.isfinite(losses[-1]) and losses[-1] < losses[0]


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.LayerNorm()(nn.Dense(16)(x))
        x = nn.BatchNorm(use_running_average=not train)(jax.nn.relu(x))
        x = nn.MultiHeadDotProductAttention(num_heads=2)(x[:, None, :].repeat(4, axis=1))[:, 0]
        return nn.Dense(4)(x)


# One level in the default tier, the other in the slow tier (each ~5-9 s here).
@pytest.mark.parametrize("level", ["O1-bf16", pytest.param("O2-fp16", marks=pytest.mark.slow)])
def test_flax_linen_front_door_under_strict_promotion(level):
    model = jaxmp.flax.mixed_precision(LinenNet(), level)
    recipe = jaxmp.get_recipe(level)
    # The init is traced (its promotion checked under strict promotion, its dtypes read) and its
    # values made in numpy: compiling it would cost a program (~1.5 s) the assertions do not need.
    variables = numpy_variables(jax.eval_shape(lambda key: model.init(key, X, train=False), jax.random.key(0)))
    assert variables["params"]["LayerNorm_0"]["scale"].dtype == F32
    assert variables["params"]["Dense_0"]["kernel"].dtype == recipe.policy.param_dtype
    # Traced (promotion is checked at trace time), not compiled: only the dtype is asserted.
    assert jax.eval_shape(lambda v: model.apply(v, X, train=False), variables).dtype == F32
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.make_loss_scale(recipe.loss_scale),
                            master_weights=recipe.master_weights)
    state = jaxmp.flax.TrainState.create(model, variables, tx)
    step = jax.jit(jaxmp.flax.make_train_step())
    first = None
    for _ in range(10):
        state, metrics = step(state, (X, Y))
        first = float(metrics["loss"]) if first is None else first
    assert bool(metrics["last_step_finite"]) and float(metrics["loss"]) < first
    assert all(x.dtype == F32 for x in jax.tree.leaves(state.model_state["batch_stats"]))


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.fc1, self.norm = nnx.Linear(8, 16, rngs=rngs), nnx.LayerNorm(16, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.norm(self.fc1(x)))
        h = self.attn(h[:, None, :].repeat(4, axis=1))[:, 0]
        return self.out(h)


@pytest.mark.slow  # ~10 s per level; the Linen front door and autocast stay in the default tier
@pytest.mark.parametrize("level", ["O1-bf16", "O2-fp16"])
def test_flax_nnx_front_door_under_strict_promotion(level):
    model = jaxmp.flax.mixed_precision(NNXNet(nnx.Rngs(0)), level)
    recipe = jaxmp.get_recipe(level)
    assert nnx.jit(lambda m: m(X))(model).dtype == F32  # jitted: traced under strict promotion all the same
    grads = nnx.jit(nnx.grad(lambda m: _xent(m(X), Y)))(model)
    assert all(g.dtype == p.dtype for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(nnx.state(model, nnx.Param))))
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.make_loss_scale(recipe.loss_scale),
                            master_weights=recipe.master_weights)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = nnx.jit(jaxmp.flax.nnx.train_step)
    metrics = [step(model, optimizer, (X, Y)) for _ in range(10)]
    assert all(bool(m["last_step_finite"]) for m in metrics)
    assert float(metrics[-1]["loss"]) < float(metrics[0]["loss"])
