"""The zoo's Equinox models, trained under ``jaxmp.autocast`` (see ``test_zoo.py``
for the trainer, the checks and the tolerances); skipped without the ``equinox`` extra."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

import jaxmp
from tests._support._op_dtypes import op_dtypes
from tests.engine.test_autocast import F32
from tests.engine.test_zoo import (  # the zoo's trainer, checks and data
    HEADS, RNG, D, T, V, assert_stats_close, bf16_rounded, ce, check_program, check_training, classification_batch,
    replay_state, sequence_batch, token_batch, train)

# -- Equinox ----------------------------------------------------------------------------------

eqx = pytest.importorskip("equinox")


def eqx_split(model):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return bf16_rounded(params), static


@pytest.fixture(scope="module")
def eqx_mlp():
    """(loss_fn, params, batch, float32 control run) of an Equinox MLP, made once for the module."""
    params, static = eqx_split(eqx.filter_jit(lambda k: eqx.nn.MLP(8, 4, 32, 2, key=k))(jax.random.key(0)))
    batch = classification_batch()

    def loss_fn(params, state, batch, key):
        logits = jax.vmap(eqx.combine(params, static))(batch[0])
        return ce(logits, batch[1]), (state, logits)

    return loss_fn, params, batch, train(loss_fn, params, (), batch, "f32")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["O1-bf16", "O1-fp16"])
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_equinox_mlp(eqx_mlp, preset):
    loss_fn, params, batch, control = eqx_mlp
    check_program(loss_fn, preset, params, (), batch, min_matmuls=3)
    check_training(train(loss_fn, params, (), batch, preset), control, rtol=0.05)


class EqxAttentionBlock(eqx.Module):
    """Embedding + eqx.nn.MultiheadAttention (padding mask) + eqx.nn.LayerNorm, one sequence."""

    embed: eqx.nn.Embedding
    pos: jax.Array
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(V, D, key=k[0])
        self.pos = 0.02 * jax.random.normal(k[1], (T, D))
        self.norm1, self.norm2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k[2])
        self.head = eqx.nn.Linear(D, V, key=k[3])

    def __call__(self, tokens, pad):
        x = jax.vmap(self.embed)(tokens) + self.pos
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h, mask=pad[:, None] & pad[None, :])   # finfo(float32).min mask
        return jax.vmap(self.head)(jax.vmap(self.norm2)(x))


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_equinox_attention_layernorm_block_padded():
    params, static = eqx_split(eqx.filter_jit(EqxAttentionBlock)(jax.random.key(0)))
    batch = token_batch(causal=False)

    def loss_fn(params, state, batch, key):
        tokens, pad, y, w = batch
        logits = jax.vmap(eqx.combine(params, static))(tokens, pad)
        return ce(logits, y, w), (state, logits)

    check_program(loss_fn, "O1-bf16", params, (), batch, min_matmuls=5)
    control = train(loss_fn, params, (), batch, "f32")
    run = train(loss_fn, params, (), batch, "O1-bf16")
    check_training(run, control, rtol=0.1)
    assert np.all(np.isfinite(run.out))                      # fully masked rows: no NaN


class EqxConvBN(eqx.Module):
    conv: eqx.nn.Conv2d
    bn: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 8, 3, padding=1, use_bias=False, key=k1)   # BN follows
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.head = eqx.nn.Linear(8, 4, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.conv(x), state)
        return self.head(jax.nn.relu(h).mean((1, 2))), state


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_equinox_conv_batchnorm_state_under_o2():
    model, state = eqx.filter_jit(eqx.nn.make_with_state(EqxConvBN))(jax.random.key(0))
    params, static = eqx_split(model)
    # Label: the brightest channel. Inputs are centred, as a data pipeline would: with a large
    # common offset (mean 1.0) the bf16 centring of test_equinox_sync_batchnorm_centring_in_float32
    # puts the conv weight gradient 24% off and the loss 11% behind float32 after 50 steps.
    y = RNG(2).integers(0, 3, 16)
    x = RNG(1).normal(size=(16, 3, 8, 8)) + 0.5 * np.eye(3)[y][:, :, None, None]
    batch = (jnp.asarray(x, jnp.float32), jnp.asarray(y))

    def loss_fn(params, state, batch, key):
        model = eqx.combine(params, static)
        logits, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(batch[0], state)
        return ce(logits, batch[1]), (state, logits)

    check_program(loss_fn, "O2-bf16", params, state, batch, min_matmuls=2)
    control = train(loss_fn, params, state, batch, "f32")
    run = train(loss_fn, params, state, batch, "O2-bf16")
    check_training(run, control, rtol=0.1)
    # BatchNorm makes the loss blind to a shift of a channel's mean, so the conv weights drift
    # apart along that direction (10% after 20 steps, with adam or sgd) while the loss curves agree
    # to 2%: the running mean of the O2 run is compared with the float32 statistics of the very
    # params the O2 run visited (its batch statistics, EMA'd in float32).
    assert_stats_close(run.state, replay_state(loss_fn, run, state, batch))


def _abstract_float(leaf):
    return isinstance(leaf, jax.ShapeDtypeStruct) and jnp.issubdtype(leaf.dtype, jnp.inexact)


def test_equinox_sync_batchnorm_centring_in_float32():
    """eqx.nn.BatchNorm averages its statistics with ``lax.pmean`` over the named vmap axis. The mean is
    a reduction (float32 list), so ``x - mean`` must run in float32, as it does without the pmean
    (docs/autocast.md, the promotion rule). Before collectives kept the float32 status, the ``sub``
    ops ran in bfloat16, and on inputs with mean 1.0 the conv weight gradient was 24% off float32's
    (a bf16 jmp-style cast: 1.6%)."""
    # Only a trace is read: the model and its state are abstract (no initialiser compiled and run).
    model, state = eqx.filter_eval_shape(eqx.nn.make_with_state(EqxConvBN), jax.random.key(0))
    params, static = eqx.partition(model, _abstract_float)
    x = jax.ShapeDtypeStruct((16, 3, 8, 8), F32)

    def loss_fn(params, state, x):
        logits, _ = jax.vmap(eqx.combine(params, static), axis_name="batch", in_axes=(0, None),
                             out_axes=(0, None))(x, state)
        return jnp.mean(logits ** 2)

    ops = op_dtypes(jaxmp.autocast(loss_fn, "O1-bf16"), params, state, x)
    centring = [op for op in ops if op.primitive == "sub" and "BatchNorm" in op.scope]
    assert centring and all(set(op.in_dtypes) == {F32} for op in centring), centring


def test_class_rule_on_subclass_inheriting_call():
    """docs/autocast.md: class rules apply to a class and its subclasses. Linen and Haiku honour a rule
    naming ``MyDense(nn.Dense)`` / ``hk.Conv2D``; Equinox and NNX used to ignore one naming
    ``eqx.nn.Conv2d`` (its ``__call__`` is ``eqx.nn.Conv``'s) or an NNX subclass."""
    # Only traces are read: abstract modules and inputs (no initialiser compiled and run).
    conv = eqx.filter_eval_shape(eqx.nn.Conv2d, 3, 4, 3, key=jax.random.key(0))

    class MyLinear(nnx.Linear):
        pass

    lin = nnx.eval_shape(lambda: MyLinear(4, 4, rngs=nnx.Rngs(0)))
    for module, x, cls in ((conv, jax.ShapeDtypeStruct((3, 8, 8), F32), eqx.nn.Conv2d),
                           (lin, jax.ShapeDtypeStruct((1, 4), F32), MyLinear)):
        f = jaxmp.autocast(lambda m, x: m(x), "O1-bf16", rules=jaxmp.AutocastRules().with_class(cls, "float32"))
        mm = [op for op in op_dtypes(f, module, x) if op.primitive in ("conv_general_dilated", "dot_general")]
        assert mm and all(set(op.in_dtypes) == {F32} for op in mm), (cls.__name__, mm)


class EqxGRU(eqx.Module):
    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell, self.head = eqx.nn.GRUCell(4, 16, key=k1), eqx.nn.Linear(16, 2, key=k2)

    def __call__(self, xs, pad):
        def step(h, inp):
            x, real = inp
            return jnp.where(real, self.cell(x, h), h), None       # padded steps keep the state
        h, _ = jax.lax.scan(step, jnp.zeros(16), (xs, pad))
        return self.head(h)


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_equinox_gru_cell_under_scan():
    params, static = eqx_split(eqx.filter_jit(EqxGRU)(jax.random.key(0)))
    batch = sequence_batch()

    def loss_fn(params, state, batch, key):
        logits = jax.vmap(eqx.combine(params, static))(batch[0], batch[1])
        return ce(logits, batch[2]), (state, logits)

    ops = check_program(loss_fn, "O1-bf16", params, (), batch, min_matmuls=3)
    assert any(op.primitive == "scan" for op in ops)
    control = train(loss_fn, params, (), batch, "f32")
    check_training(train(loss_fn, params, (), batch, "O1-bf16"), control, rtol=0.1)
