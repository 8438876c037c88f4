"""Dot-product attention whose softmax runs in float32, for Linen and NNX attention modules.

Flax's own ``force_fp32_for_softmax`` (Linen) leaves the attention weights in float32,
so the weights-times-values matmul silently runs in float32 too (and fails under strict
dtype promotion). Here only the softmax is float32: the two matmuls take half operands
and the QK^T logits are accumulated straight into float32 (``preferred_element_type``),
so large logits cannot overflow float16 before the softmax sees them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxmp._dtypes import float32_backward

if TYPE_CHECKING:  # flax is imported where it is used
    import flax.linen as nn
    from flax import nnx


def _sow_weights(module: Any, weights: jax.Array) -> None:
    # Linen and NNX both have ``sow`` but name the collection differently.
    from flax import nnx

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def float32_softmax_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: DTypeLike | None = None,
    precision: jax.lax.PrecisionLike = None,
    module: nn.Module | nnx.Module | None = None,
    is_causal: bool = False,
    **unused: Any,
) -> jax.Array:
    """``flax.linen.dot_product_attention`` / ``flax.nnx.dot_product_attention`` with a float32 softmax.

    A drop-in ``attention_fn`` for ``nn.MultiHeadDotProductAttention`` and
    ``nnx.MultiHeadAttention``; [`jaxmp.flax.mixed_precision`][jaxmp.flax.mixed_precision] installs it in the
    attention modules of the half list when the rules keep softmax in float32.

    Args:
      query: ``[batch..., q_length, num_heads, qk_depth]``.
      key: ``[batch..., kv_length, num_heads, qk_depth]``.
      value: ``[batch..., kv_length, num_heads, v_depth]``.
      bias: added to the logits (broadcastable to ``[batch..., heads, q, kv]``).
      mask: boolean, broadcastable to the logits; False entries are masked out.
      broadcast_dropout: dropout mask shared across batch and heads.
      dropout_rng: PRNG key for attention dropout.
      dropout_rate: attention dropout probability.
      deterministic: disables dropout.
      dtype: compute dtype of the matmuls (default: the promoted dtype of q, k, v).
      precision: ``jax.lax.Precision`` for the matmuls.
      module: if given, the attention weights are sown into its intermediates.
      is_causal: apply a causal mask.
      **unused: other keyword arguments attention modules may pass (ignored).

    Returns:
      ``[batch..., q_length, num_heads, v_depth]`` in the compute dtype.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp.flax
      >>> attn = nn.MultiHeadDotProductAttention(
      ...     2, dtype=jnp.bfloat16, attention_fn=jaxmp.flax.float32_softmax_attention)
      >>> x = jnp.ones((1, 4, 8), jnp.bfloat16)
      >>> attn.apply(attn.init(jax.random.key(0), x), x).shape
      (1, 4, 8)
    """
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    dtype = np.dtype(dtype)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    depth = query.shape[-1]
    query = query / jnp.sqrt(depth).astype(dtype)
    # Half operands, float32 accumulation and result: the logits never exist in float16. The
    # gradient is taken in float32 (float32_backward): the transpose of a half x half -> float32
    # matmul mixes a float32 cotangent with a half operand, which strict promotion refuses.
    logits = float32_backward(functools.partial(jnp.einsum, "...qhd,...khd->...hqk", precision=precision,
                                                preferred_element_type=jnp.float32))(query, key)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if is_causal:
        q_len, kv_len = logits.shape[-2:]
        causal = jnp.tril(jnp.ones((q_len, kv_len), jnp.bool_))
        mask = causal if mask is None else jnp.logical_and(mask.astype(jnp.bool_), causal)
    if mask is not None:
        logits = jnp.where(mask.astype(jnp.bool_), logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
    if module is not None:
        _sow_weights(module, weights)
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError(f"fp32_softmax_attention: dropout_rate={dropout_rate} outside deterministic mode needs "
                             "dropout_rng (a PRNG key), or pass deterministic=True")
        keep_prob = 1.0 - dropout_rate
        shape = (1,) * (key.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype))
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


def fused_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: DTypeLike | None = None,
    precision: jax.lax.PrecisionLike = None,
    module: nn.Module | nnx.Module | None = None,
    **unused: Any,
) -> jax.Array:
    """The ``attention_fn`` [`jaxmp.flax.mixed_precision`][jaxmp.flax.mixed_precision] gives attention modules.

    Calls a fused kernel can take (4-D inputs; no bias, dropout, sown weights or non-default
    precision) go through ``jax.nn.dot_product_attention`` (cuDNN on GPUs under
    [`jaxmp.autocast`][jaxmp.autocast]); others run Flax's attention with a float32 softmax.
    See docs/autocast.md#half-only-kernels-and-attention.

    Args:
      query: ``[batch, q_length, num_heads, depth]``.
      key: ``[batch, kv_length, num_heads, depth]``.
      value: ``[batch, kv_length, num_heads, v_depth]``.
      bias: added to the logits (forces the Flax path).
      mask: boolean, broadcastable to ``[batch, heads, q_length, kv_length]``.
      broadcast_dropout: as for Flax.
      dropout_rng: as for Flax.
      dropout_rate: attention dropout (a non-zero rate in training forces the Flax path).
      deterministic: disables dropout.
      dtype: as for Flax.
      precision: a non-default precision forces the Flax path.
      module: when given (sown attention weights), the Flax path.
      **unused: other keyword arguments attention modules may pass.

    Returns:
      ``[batch, q_length, num_heads, v_depth]``.

    Example:
      >>> import jax.numpy as jnp, jaxmp.flax
      >>> q = jnp.ones((1, 4, 2, 8))
      >>> jaxmp.flax.fused_attention(q, q, q).shape
      (1, 4, 2, 8)
    """
    fusable = (bias is None and module is None and precision is None and query.ndim == 4
               and (deterministic or dropout_rate == 0.0) and key.shape[-2] == query.shape[-2])
    if not fusable:
        from flax import linen

        return linen.dot_product_attention(query, key, value, bias=bias, mask=mask,
                                           broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
                                           dropout_rate=dropout_rate, deterministic=deterministic,
                                           dtype=dtype, precision=precision, module=module)
    if mask is not None:
        b, t, n, _ = query.shape
        mask = jnp.broadcast_to(mask.astype(jnp.bool_), (b, n, t, key.shape[1]))
    # JAX's attention promotes half inputs with float32 itself (its logits): a deliberate
    # promotion, allowed here so that a caller's strict promotion only checks the caller's code.
    with jax.numpy_dtype_promotion("standard"):
        out = jax.nn.dot_product_attention(query, key, value, mask=mask)
    return out if dtype is None else out.astype(dtype)
