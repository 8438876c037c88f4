"""The uniform source interface every dataset implements.

A *source* is one split of one dataset. The training loop sees every dataset
the same way: an iterator of dict batches of numpy arrays with an input key
(``"image"`` for images, ``"x"`` for sequences) and ``"label"``, plus a
*data position* (the number of training batches already drawn) from which the
stream can be resumed exactly. Evaluation batches are padded to a fixed shape
and carry a ``"mask"`` so a jitted eval step compiles once and padding never
counts.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Protocol

import numpy as np

Batch = dict[str, np.ndarray]


class DatasetUnavailableError(RuntimeError):
    """A dataset is not available offline; the message says what to do."""


class Source(Protocol):
    """One split of a dataset, as the loop sees it."""

    name: str
    input_key: str            # "image" or "x"
    input_shape: tuple        # shape of one example's input
    num_classes: int
    num_examples: int

    def train_batches(self, batch_size: int, *, seed: int, start: int = 0) -> Iterator[Batch]:
        """Endless shuffled (and augmented) batches, starting at data position ``start``."""

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """One ordered pass over the split, padded to ``batch_size`` with a ``"mask"``."""


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Full batches per epoch (the last partial batch is dropped in training)."""
    return max(1, num_examples // batch_size)


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffle order of one epoch: a pure function of (seed, epoch).

    Deriving the order from (seed, epoch) instead of carrying an RNG forward is
    what makes a resumed run draw exactly the batches an uninterrupted one would.
    """
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def pad_batch(batch: Batch, batch_size: int) -> Batch:
    """Pads every array of ``batch`` to ``batch_size`` rows and adds a 0/1 ``"mask"``."""
    n = len(batch["label"])
    out = {}
    for k, v in batch.items():
        pad = [(0, batch_size - n)] + [(0, 0)] * (v.ndim - 1)
        out[k] = np.pad(v, pad)
    out["mask"] = np.concatenate([np.ones(n, np.float32), np.zeros(batch_size - n, np.float32)])
    return out


@dataclasses.dataclass
class ArraySource:
    """A split held in memory as numpy arrays (embedded datasets and fake data).

    Attributes:
      name: the dataset name.
      inputs: ``[N, ...]`` float32 inputs.
      labels: ``[N]`` int32 labels.
      num_classes: number of classes.
      input_key: the batch key of the inputs (``"x"`` or ``"image"``).
      augment: optional ``(inputs, rng) -> inputs`` applied to training batches.
      shuffle: whether training batches are shuffled (fake data needs not be).
    """

    name: str
    inputs: np.ndarray
    labels: np.ndarray
    num_classes: int
    input_key: str = "x"
    augment: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None
    shuffle: bool = True

    @property
    def num_examples(self) -> int:
        return len(self.labels)

    @property
    def input_shape(self) -> tuple:
        return tuple(self.inputs.shape[1:])

    def train_batches(self, batch_size: int, *, seed: int, start: int = 0) -> Iterator[Batch]:
        if batch_size > self.num_examples:
            raise ValueError(
                f"batch size {batch_size} is larger than the {self.num_examples} training examples "
                f"of {self.name}; lower --config.per_device_batch_size."
            )
        spe = steps_per_epoch(self.num_examples, batch_size)
        position = start
        while True:
            epoch, i = divmod(position, spe)
            order = (epoch_permutation(self.num_examples, seed, epoch) if self.shuffle
                     else np.arange(self.num_examples))
            idx = order[i * batch_size:(i + 1) * batch_size]
            x = self.inputs[idx]
            if self.augment is not None:
                # The augmentation RNG is keyed on the data position for exact resumption.
                x = self.augment(x, np.random.default_rng([seed, epoch, i, 1]))
            yield {self.input_key: x, "label": self.labels[idx]}
            position += 1

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        for s in range(0, self.num_examples, batch_size):
            batch = {self.input_key: self.inputs[s:s + batch_size], "label": self.labels[s:s + batch_size]}
            yield pad_batch(batch, batch_size)
