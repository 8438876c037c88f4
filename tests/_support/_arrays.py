"""Test helper: arrays on the device without compiling, and the bits of a pytree.

An eager ``jax.random`` draw compiles threefry for every new shape, and ``jnp.asarray``,
``jnp.eye`` or eager arithmetic each compile a small program per shape; ``jax.device_put`` of a
numpy array compiles nothing. The tests that only need *some* numbers draw them here.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def on_device(a) -> jax.Array:
    """A numpy array on the device as is, with the dtype ``jnp.asarray`` would give it.

    Args:
      a: an array-like; float64 becomes float32 and int64 int32 (JAX's default 32-bit types).

    Returns:
      The array on the default device.

    Example:
      >>> on_device(np.ones(2)).dtype
      dtype('float32')
    """
    a = np.asarray(a)
    a = a.astype(np.float32) if a.dtype == np.float64 else a.astype(np.int32) if a.dtype == np.int64 else a
    return jax.device_put(a)


def normal(seed: int, shape, scale: float = 1.0) -> jax.Array:
    """A float32 standard-normal array drawn by numpy (times ``scale``, in numpy), on the device.

    Args:
      seed: the numpy generator's seed.
      shape: the array's shape.
      scale: a factor applied in float32 before the transfer.

    Returns:
      The array on the default device.

    Example:
      >>> normal(0, (2, 3)).shape
      (2, 3)
    """
    return on_device(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(scale))


def leaf_bytes(tree: Any) -> list[bytes]:
    """The raw bytes of each leaf of ``tree``, fetched to the host: equal lists mean bitwise
    equal trees (the same leaves, shapes and values to the last bit, NaN payloads included).

    Args:
      tree: a pytree of arrays.

    Returns:
      One ``bytes`` per leaf, in ``jax.tree_util.tree_leaves`` order.

    Example:
      >>> leaf_bytes({"a": np.float32(1.0)}) == leaf_bytes({"a": np.float32(1.0)})
      True
    """
    return [np.asarray(jax.device_get(x)).tobytes() for x in jax.tree_util.tree_leaves(tree)]
