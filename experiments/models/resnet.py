"""ResNet-50 (the ImageNet large-batch model) and ResNet-9 / DavidNet (the CIFAR TPU-vs-GPU model)."""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1, 3x3 (strided), 1x1 x4; the last BN starts at zero."""

    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = True):
        bn = lambda **kw: nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, **kw)  # noqa: E731
        y = nn.relu(bn()(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
        y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), use_bias=False)(y)
        y = nn.relu(bn()(y))
        y = nn.Conv(self.features * 4, (1, 1), use_bias=False)(y)
        # Zero-init of the last scale makes every block start as the identity (Goyal et al.),
        # part of the large-batch ImageNet recipe.
        y = bn(scale_init=nn.initializers.zeros)(y)
        if x.shape[-1] != self.features * 4 or self.strides != 1:
            x = nn.Conv(self.features * 4, (1, 1), (self.strides, self.strides), use_bias=False)(x)
            x = bn()(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Bottleneck ResNet; the defaults are ResNet-50.

    Attributes:
      stage_sizes: blocks per stage ((3, 4, 6, 3) for ResNet-50).
      num_classes: number of output logits.
      width: channels of the first stage (64).
    """

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    num_classes: int = 1000
    width: int = 64

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(self.stage_sizes):
            for j in range(blocks):
                x = Bottleneck(self.width * 2**i, strides=2 if i > 0 and j == 0 else 1)(x, train)
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class ConvBN(nn.Module):
    """conv3x3 - BN - ReLU, optionally followed by a 2x2 max-pool."""

    features: int
    pool: bool = False

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        if self.pool:
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return x


class ResNet9(nn.Module):
    """ResNet-9 / DavidNet (Page 2018), the model of the TPU-vs-GPU study.

    prep(64) -> layer1(128, pool, +residual) -> layer2(256, pool) ->
    layer3(512, pool, +residual) -> global max-pool -> linear, logits x 0.125.

    Attributes:
      num_classes: number of output logits.
      width: channels of the prep layer (64); later layers use 2x, 4x, 8x.
      logit_scale: the final multiplier DavidNet uses instead of a temperature.
    """

    num_classes: int = 10
    width: int = 64
    logit_scale: float = 0.125

    @nn.compact
    def __call__(self, x, train: bool = True):
        w = self.width
        x = ConvBN(w)(x, train)
        x = ConvBN(2 * w, pool=True)(x, train)
        x = x + ConvBN(2 * w)(ConvBN(2 * w)(x, train), train)
        x = ConvBN(4 * w, pool=True)(x, train)
        x = ConvBN(8 * w, pool=True)(x, train)
        x = x + ConvBN(8 * w)(ConvBN(8 * w)(x, train), train)
        x = jnp.max(x, axis=(1, 2))
        return nn.Dense(self.num_classes, use_bias=False)(x) * self.logit_scale
