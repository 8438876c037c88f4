"""Wide-ResNet (Zagoruyko & Komodakis 2016): WRN-28-10 as in the T4/P100/A100 studies, WRN-16-4 for small runs.

Pre-activation basic blocks (BN-ReLU-conv), three groups of widths
16k / 32k / 64k. With k = 10 (160/320/640) and k = 4 (64/128/256) every width is a
multiple of 8.
"""

from __future__ import annotations

import flax.linen as nn


class WideBlock(nn.Module):
    """Pre-activation basic block; a 1x1 projection when shape changes."""

    features: int
    strides: int = 1
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x, train: bool = True):
        bn = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)  # noqa: E731
        out = nn.relu(bn()(x))
        shortcut = x
        if self.strides != 1 or x.shape[-1] != self.features:
            # The projection reads the pre-activated input, as in the reference code.
            shortcut = nn.Conv(self.features, (1, 1), (self.strides, self.strides), use_bias=False)(out)
        y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), use_bias=False)(out)
        y = nn.relu(bn()(y))
        if self.dropout_rate:
            y = nn.Dropout(self.dropout_rate, deterministic=not train)(y)
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        return y + shortcut


class WideResNet(nn.Module):
    """WRN-depth-widen.

    Attributes:
      depth: total depth, ``6n + 4`` (28 -> 4 blocks per group, 16 -> 2).
      widen_factor: width multiplier k.
      num_classes: number of output logits.
      dropout_rate: dropout between the two convs of a block.
      stem_features: channels of the first conv (16 in the paper).
    """

    depth: int = 28
    widen_factor: int = 10
    num_classes: int = 10
    dropout_rate: float = 0.0
    stem_features: int = 16

    @nn.compact
    def __call__(self, x, train: bool = True):
        if (self.depth - 4) % 6:
            raise ValueError(f"Wide-ResNet depth must be 6n+4 (16, 22, 28, 40...), got {self.depth}")
        n = (self.depth - 4) // 6
        x = nn.Conv(self.stem_features, (3, 3), use_bias=False)(x)
        for group, width in enumerate((16, 32, 64)):
            for i in range(n):
                strides = 2 if (group > 0 and i == 0) else 1
                x = WideBlock(width * self.widen_factor, strides, self.dropout_rate)(x, train)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.num_classes)(x)
