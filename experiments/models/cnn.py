"""Small CNNs: a 2-D CNN for MNIST-like images and a 1-D CNN for MNIST-1D.

Plain Linen modules with no dtype arguments: the jaxmp Flax integration decides
in which precision they run. Feature counts are multiples of 8 so that
half-precision matmuls and convolutions map onto Tensor Cores .
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn


class CNN(nn.Module):
    """The Flax MNIST example's CNN (conv32-pool-conv64-pool-dense256-dense).

    Attributes:
      num_classes: number of output logits.
      features: channels of the two conv layers.
      hidden: width of the dense layer.
    """

    num_classes: int = 10
    features: Sequence[int] = (32, 64)
    hidden: int = 256

    @nn.compact
    def __call__(self, x, train: bool = True):
        del train  # no dropout or batch statistics
        for f in self.features:
            x = nn.relu(nn.Conv(f, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2), padding="SAME")
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.num_classes)(x)


class CNN1D(nn.Module):
    """A 1-D CNN for MNIST-1D (after the dataset paper's ConvBase, widths rounded to 8).

    Three strided convolutions with batch normalisation, then a linear head. The
    paper's ConvBase (25 channels, no norm) reaches ~94% test accuracy; batch norm
    here also exercises the fp32-norm rule of the mixed-precision recipes.

    Attributes:
      num_classes: number of output logits.
      features: channels per conv layer.
      kernel_sizes: kernel width per conv layer.
      use_batchnorm: whether to normalise after each conv.
    """

    num_classes: int = 10
    features: Sequence[int] = (32, 32, 32)
    kernel_sizes: Sequence[int] = (5, 3, 3)
    use_batchnorm: bool = True

    @nn.compact
    def __call__(self, x, train: bool = True):
        if x.ndim == 2:  # [N, L] sequences -> [N, L, 1] channels-last
            x = x[..., None]
        for f, k in zip(self.features, self.kernel_sizes):
            x = nn.Conv(f, (k,), strides=(2,), padding=[(1, 1)], use_bias=not self.use_batchnorm)(x)
            if self.use_batchnorm:
                x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(self.num_classes)(x)
