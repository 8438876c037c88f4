"""The loss head of the ready-made train steps: float32 cross-entropy, accuracy, batch unpacking."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

_INPUT_KEYS = ("inputs", "image", "x")
_LABEL_KEYS = ("labels", "label", "y")


def _integer_labels(logits: jax.Array, labels: jax.Array) -> bool:
    """Whether ``labels`` are integer class ids; raises when such ids do not have the batch shape.

    Checked for accuracy too: ``[batch, 1]`` ids would broadcast against the ``[batch]``
    predictions into a ``[batch, batch]`` comparison, a plausible but wrong value.
    """
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        return False
    if labels.shape != logits.shape[:-1]:
        squeeze = " (squeeze the last axis: labels[..., 0])" if labels.shape == (*logits.shape[:-1], 1) else ""
        raise ValueError(f"integer labels must have shape {logits.shape[:-1]}, got {labels.shape}{squeeze}")
    return True


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy, computed in float32 whatever the logits' dtype.

    The loss is on the NVIDIA float32 list: ``log_softmax`` needs float32 range and a
    float16 loss times a large loss scale overflows.

    Args:
      logits: ``[batch..., classes]``, any floating dtype.
      labels: integer class ids ``[batch...]`` or (soft) one-hot ``[batch..., classes]``.

    Returns:
      A float32 scalar; NaN when an integer label is outside ``[0, classes)`` (optax's
      behaviour, with a finite gradient: check labels on the host,
      ``assert 0 <= labels.min() and labels.max() < classes``).

    Raises:
      ValueError: labels whose shape fits neither form.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.flax.softmax_cross_entropy(jnp.zeros((2, 4), jnp.bfloat16), jnp.array([0, 3]))
      Array(1.3862944, dtype=float32)
    """
    logits = logits.astype(jnp.float32)
    if _integer_labels(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    if labels.shape != logits.shape:
        raise ValueError(f"one-hot labels must have the logits' shape {logits.shape}, got {labels.shape}")
    return optax.softmax_cross_entropy(logits, labels.astype(jnp.float32)).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Top-1 accuracy (float32 scalar) for integer or one-hot labels.

    Args:
      logits: ``[batch..., classes]``.
      labels: integer ids ``[batch...]`` or one-hot ``[batch..., classes]``.

    Returns:
      The fraction of correct argmax predictions.

    Raises:
      ValueError: integer labels whose shape is not the logits' batch shape (they would broadcast).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> float(jaxmp.flax.accuracy(jnp.eye(3), jnp.array([0, 1, 0])))
      0.6666666865348816
    """
    if not _integer_labels(logits, labels):
        labels = jnp.argmax(labels, axis=-1)
    return jnp.mean((jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32))


def split_batch(batch: Any) -> tuple[Any, jax.Array]:
    """``(inputs, labels)`` from a pair or from a dict keyed like the Flax / TFDS examples.

    Args:
      batch: ``(inputs, labels)``, or a dict with one of ``inputs``/``image``/``x`` and
        one of ``labels``/``label``/``y``.

    Returns:
      ``(inputs, labels)``.

    Raises:
      ValueError: a dict without those keys, or a sequence that is not a pair.
      TypeError: anything else.
    """
    if isinstance(batch, Mapping):  # a dict, a FrozenDict, any mapping
        inputs = next((batch[k] for k in _INPUT_KEYS if k in batch), None)
        labels = next((batch[k] for k in _LABEL_KEYS if k in batch), None)
        if inputs is None or labels is None:
            raise ValueError(
                f"batch dict needs an input key {_INPUT_KEYS} and a label key {_LABEL_KEYS}; got keys {sorted(batch)}"
            )
        return inputs, labels
    if isinstance(batch, (tuple, list)):
        if len(batch) != 2:
            raise ValueError(f"a batch sequence must be (inputs, labels), got {len(batch)} items")
        return batch[0], batch[1]
    raise TypeError(f"batch must be (inputs, labels) or a dict, got {type(batch).__name__}")
