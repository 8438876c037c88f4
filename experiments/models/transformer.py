"""A small pre-LayerNorm Transformer encoder classifier for sequences or image patches.

Sequences ``[N, L]`` become ``L`` tokens of one feature; images ``[N, H, W, C]``
become non-overlapping ``patch_size`` patches (ViT-style). Layer norms and the
attention softmax are the ops the mixed-precision recipes keep in fp32.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class EncoderBlock(nn.Module):
    """Pre-LN block: x + MHA(LN(x)), then x + MLP(LN(x)).

    The one Linen Transformer block of the experiments and the benchmarks (``benchmarks/_lm.py``'s
    causal language model uses it with ``causal=True``, ``benchmarks/fp8.py``'s encoder under its
    own sublayer names; ``benchmarks/_gpt2.py`` writes its block as plain functions of a params
    dict, for the sharded steps' layouts).

    Attributes:
      num_heads: attention heads.
      mlp_dim: hidden width of the MLP.
      dropout_rate: dropout in attention and after the MLP (0: no dropout op at all).
      causal: each position attends to itself and the positions before it only.
      names: the sublayers' module names (first norm, attention, second norm, MLP in, MLP out),
        or None for Flax's own (``LayerNorm_0`` ...). Names seed the initialisers, so a model
        recorded under other names keeps its params by passing them.
    """

    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    causal: bool = False
    names: tuple[str, str, str, str, str] | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        ln1, attention, ln2, up, down = self.names or (None,) * 5
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32)) if self.causal else None
        y = nn.LayerNorm(name=ln1)(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, dropout_rate=self.dropout_rate,
                                            deterministic=not train, name=attention)(y, y, mask=mask)
        x = x + y
        y = nn.LayerNorm(name=ln2)(x)
        y = nn.Dense(self.mlp_dim, name=up)(y)
        y = nn.gelu(y)
        y = nn.Dense(x.shape[-1], name=down)(y)
        if self.dropout_rate:
            y = nn.Dropout(self.dropout_rate, deterministic=not train)(y)
        return x + y


class TransformerEncoder(nn.Module):
    """Token embedding + learned positions + ``num_layers`` blocks + mean-pool + linear head.

    Attributes:
      num_classes: number of output logits.
      num_layers: encoder blocks.
      model_dim: token width (a multiple of 8 and of ``num_heads``).
      num_heads: attention heads.
      mlp_dim: hidden width of each MLP.
      patch_size: side of the square patches images are cut into.
      dropout_rate: dropout in attention and MLP.
    """

    num_classes: int = 10
    num_layers: int = 2
    model_dim: int = 64
    num_heads: int = 4
    mlp_dim: int = 128
    patch_size: int = 4
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = True):
        if x.ndim == 2:  # sequences: one scalar feature per token
            x = x[..., None]
        elif x.ndim == 4:  # images: flatten non-overlapping patches into tokens
            n, h, w, c = x.shape
            p = self.patch_size
            if h % p or w % p:
                raise ValueError(f"image size {h}x{w} is not a multiple of patch_size {p}")
            x = x.reshape(n, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(n, -1, p * p * c)
        x = nn.Dense(self.model_dim)(x)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, x.shape[1], self.model_dim))
        x = x + pos
        for _ in range(self.num_layers):
            x = EncoderBlock(self.num_heads, self.mlp_dim, self.dropout_rate)(x, train)
        x = nn.LayerNorm()(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=1))
