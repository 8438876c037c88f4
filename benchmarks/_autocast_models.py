"""Models of ``benchmarks/autocast.py``: loss functions ``loss(params, x, y) -> float32 scalar``.

Each model has a float32 loss and a *hand-cast* loss that assigns dtypes as ``jaxmp.autocast``'s
O1 rules do, written out by hand (see ``benchmarks/autocast.py`` for the rules).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


class Model(NamedTuple):
    """A benchmark model: params and a batch, the float32 loss and its hand-cast twin."""

    params: Any
    batch: tuple
    loss: Callable
    hand_loss: Callable  # (params, x, y, half_dtype) -> loss
    hand_note: str


# ----------------------------------------------------------------------------------------------
# MLPs with a hand-written layer norm and log-softmax loss.


def _layer_norm(h, scale, bias):
    mu = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mu), -1, keepdims=True)
    return (h - mu) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def _nll(logits, y):
    z = logits - jax.lax.stop_gradient(jnp.max(logits, -1, keepdims=True))
    logp = z - jnp.log(jnp.sum(jnp.exp(z), -1, keepdims=True))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], -1))


def mlp_loss(params, x, y):
    h = x
    for layer in params["layers"]:
        h = h @ layer["w"] + layer["b"]
        h = jnp.maximum(_layer_norm(h, layer["scale"], layer["bias"]), 0.0)
    return _nll(h @ params["head"]["w"] + params["head"]["b"], y)


def mlp_hand_loss(params, x, y, half):
    """``mlp_loss`` with O1's dtypes by hand: matmul operands half, bias adds half (a float32
    param meeting a half value), the layer norm from its first reduction on in float32 (the
    reduction's float32 result promotes ``h - mu``), ReLU follows (float32), the logits half,
    the log-softmax and the loss in float32."""
    h = x
    for layer in params["layers"]:
        h = h.astype(half) @ layer["w"].astype(half) + layer["b"].astype(half)
        h32 = h.astype(F32)
        mu = jnp.mean(h32, -1, keepdims=True)
        d = h32 - mu
        var = jnp.mean(jnp.square(d), -1, keepdims=True)
        h = jnp.maximum(d * jax.lax.rsqrt(var + 1e-5) * layer["scale"] + layer["bias"], 0.0)
    logits = h.astype(half) @ params["head"]["w"].astype(half) + params["head"]["b"].astype(half)
    z32 = logits.astype(F32)
    z = z32 - jax.lax.stop_gradient(jnp.max(z32, -1, keepdims=True))
    logp = z - jnp.log(jnp.sum(jnp.exp(z), -1, keepdims=True))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], -1))


def make_mlp(seed: int, depth: int, width: int, batch: int, in_dim: int, classes: int) -> Model:
    """An MLP's params and batch (numpy's generator: eager jax.random compiles op by op)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))

    layers, fan_in = [], in_dim
    for _ in range(depth):
        layers.append({"w": normal(fan_in, width) / np.float32(fan_in**0.5), "b": jnp.zeros((width,), F32),
                       "scale": jnp.ones((width,), F32), "bias": jnp.zeros((width,), F32)})
        fan_in = width
    params = {"layers": layers, "head": {"w": normal(width, classes) / np.float32(width**0.5),
                                         "b": jnp.zeros((classes,), F32)}}
    x = normal(batch, in_dim)
    y = jnp.asarray(rng.integers(0, classes, (batch,), dtype=np.int32))
    return Model(params, (x, y), mlp_loss, mlp_hand_loss, "written out op by op (mlp_hand_loss)")


# ----------------------------------------------------------------------------------------------
# The experiments' Flax models.


def _flax_model(key, module, x, y, classes: int, has_batch_stats: bool) -> Model:
    from benchmarks._native import NativeModel

    variables = jax.jit(lambda k, a: module.init(k, a, train=False))(key, x)
    stats = variables.get("batch_stats")

    def apply(model, params, a):
        v = {"params": params, "batch_stats": stats} if has_batch_stats else {"params": params}
        if has_batch_stats:
            return model.apply(v, a, train=True, mutable=["batch_stats"])[0]
        return model.apply(v, a, train=True)

    def loss(params, a, b):
        return _nll_f32(apply(module, params, a), b)

    def hand_loss(params, a, b, half):
        return _nll_f32(apply(NativeModel(module, half, softmax_fp32=True), params, a), b)

    note = ("Flax's own per-layer dtype=half (params float32; norm statistics and the attention "
            "softmax in float32; norm outputs and GELU in half), log-softmax loss in float32")
    return Model(variables["params"], (x, y), loss, hand_loss, note)


def _nll_f32(logits, y):
    return _nll(logits.astype(F32), y)


def make_transformer(key, layers: int, dim: int, heads: int, mlp: int, seq: int, batch: int, classes: int) -> Model:
    from experiments.models import get_model

    module = get_model("transformer", classes, num_layers=layers, model_dim=dim, num_heads=heads, mlp_dim=mlp)
    kx, ky, kp = jax.random.split(key, 3)
    x = jax.random.normal(kx, (batch, seq), F32)
    y = jax.random.randint(ky, (batch,), 0, classes)
    return _flax_model(kp, module, x, y, classes, has_batch_stats=False)


def make_resnet(key, stages: tuple, width: int, size: int, batch: int, classes: int) -> Model:
    from experiments.models import get_model

    module = get_model("resnet50", classes, stage_sizes=stages, width=width)
    kx, ky, kp = jax.random.split(key, 3)
    x = jax.random.normal(kx, (batch, size, size, 3), F32)
    y = jax.random.randint(ky, (batch,), 0, classes)
    return _flax_model(kp, module, x, y, classes, has_batch_stats=True)
