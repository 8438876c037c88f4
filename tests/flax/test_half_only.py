"""jaxmp.flax without a float32 trace: a layer that refuses float32 trains under O1 and O2
(bf16 and fp16), for Linen and NNX; attention under a policy matches float32 with and without masks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tests._support._numpy_init import numpy_variables

import jaxmp


def _refuse_float32(*xs):
    for x in xs:
        if x.dtype == jnp.float32:
            raise NotImplementedError(f"half-only layer got {x.dtype} (like cuDNN attention or fp8 dots)")


class HalfOnlyDense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        _refuse_float32(x, kernel)
        return x @ kernel


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(jax.nn.relu(HalfOnlyDense(16)(nn.LayerNorm()(x))))


class NNXHalfOnly(nnx.Module):
    def __init__(self, din, dout, rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))

    def __call__(self, x):
        _refuse_float32(x, self.kernel[...])
        return x @ self.kernel[...]


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.norm, self.half, self.out = nnx.LayerNorm(8, rngs=rngs), NNXHalfOnly(8, 16, rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.half(self.norm(x))))


# numpy data: an eager jax.random draw compiles a program per shape.
X = np.random.default_rng(1).normal(size=(64, 8)).astype(np.float32)
Y = np.argmax(X[:, :4], axis=-1).astype(np.int32)

LEVELS = ["O1-bf16", "O1-fp16", "O2-bf16", "O2-fp16"]


def _loss(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), Y).mean()


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_linen_half_only_layer_trains(level):
    with pytest.raises(NotImplementedError):
        LinenNet().init(jax.random.key(0), X)  # the layer really refuses float32
    model = jaxmp.flax.mixed_precision(LinenNet(), level)
    recipe = jaxmp.get_recipe(level)
    params = model.init(jax.random.key(0), X)["params"]  # init runs under the same casts as apply
    assert params["LayerNorm_0"]["scale"].dtype == jnp.float32
    assert params["HalfOnlyDense_0"]["kernel"].dtype == recipe.policy.param_dtype
    tx = jaxmp.loss_scaling(optax.adam(0.02), jaxmp.make_loss_scale(recipe.loss_scale),
                            master_weights=recipe.master_weights)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        loss, grads = jaxmp.value_and_grad(lambda p: _loss(model.apply({"params": p}, X)), opt)(params)
        updates, opt = tx.update(grads, opt, params)
        return jaxmp.apply_updates(params, updates, opt), opt, loss

    losses = []
    for _ in range(40):
        params, opt, loss = step(params, opt)
        losses.append(float(loss))
    assert np.isfinite(losses[-1]) and losses[-1] < 0.7 * losses[0]


@pytest.mark.standard_promotion(reason="optax.adam: bias correction is a Python float ** int32 count")
@pytest.mark.parametrize("level", LEVELS[:1] + [pytest.param(lv, marks=pytest.mark.slow) for lv in LEVELS[1:]])
def test_nnx_half_only_layer_trains(level):
    # The model's init traced and filled in numpy (an eager NNX init compiles every random draw).
    graphdef, state = nnx.split(nnx.eval_shape(lambda: jaxmp.flax.mixed_precision(NNXNet(nnx.Rngs(0)), level)))
    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, numpy_variables(state)))
    recipe = jaxmp.get_recipe(level)
    tx = jaxmp.loss_scaling(optax.adam(0.02), jaxmp.make_loss_scale(recipe.loss_scale),
                            master_weights=recipe.master_weights)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = nnx.jit(jaxmp.flax.nnx.train_step)
    losses = [float(step(model, optimizer, (X, Y))["loss"]) for _ in range(40)]
    assert np.isfinite(losses[-1]) and losses[-1] < 0.7 * losses[0]


class Attn(nn.Module):
    @nn.compact
    def __call__(self, x, mask=None):
        return nn.MultiHeadDotProductAttention(num_heads=2)(x, x, mask=mask)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("level", ["O1-bf16", pytest.param("O2-bf16", marks=pytest.mark.slow),
                                   pytest.param("O1-fp16", marks=pytest.mark.slow)])
def test_attention_under_policy_matches_float32(level, masked):
    # numpy input and jitted init/apply: eagerly, every op (and every random draw's shape)
    # would be compiled on its own; the attention path chosen is recorded at trace time.
    x = np.random.default_rng(3).normal(size=(2, 8, 16)).astype(np.float32)
    # nn.make_causal_mask(np.ones((2, 8))) in numpy: query i sees keys j <= i.
    mask = np.broadcast_to(np.tril(np.ones((8, 8), bool)), (2, 1, 8, 8)) if masked else None
    # The init traced and filled in numpy; the float32 reference and the policy's output in one program.
    variables = numpy_variables(jax.eval_shape(Attn().init, jax.random.key(0), x, mask))
    model = jaxmp.flax.mixed_precision(Attn(), level)
    ref, out = jax.jit(lambda v, x, m: (Attn().apply(v, x, m), model.apply(v, x, m)))(variables, x, mask)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, atol=0.05 if "bf16" in level else 0.01)
    from jaxmp.engine import _attention as attention

    assert attention.last_choice["implementation"] == "xla"  # CPU: the XLA fallback with a float32 softmax
