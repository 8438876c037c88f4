"""Test helper: Flax-like initial values in numpy for an abstract (``jax.eval_shape``) variable tree.

A model's init, run eagerly, compiles a program per op and random draw; jitted, it is one more
program to compile. Tests that need *some* sensible values but do not test the init itself trace
the init with ``jax.eval_shape`` (its structure and dtypes stay the real ones) and fill it here.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def numpy_variables(shapes: Any, seed: int = 0) -> Any:
    """Numpy values for every ``jax.ShapeDtypeStruct`` leaf of ``shapes``, by the leaf's name.

    Args:
      shapes: a pytree of ``jax.ShapeDtypeStruct`` (e.g. ``jax.eval_shape(model.init, key, x)``).
      seed: the numpy generator's seed.

    Returns:
      The same tree of numpy arrays: norm scales and running variances 1, biases and running
      means 0, every other leaf (kernels, embeddings) normal with a 1/sqrt(fan-in) scale, each
      in its leaf's dtype.

    Example:
      >>> numpy_variables({"bias": jax.ShapeDtypeStruct((2,), np.float32)})
      {'bias': array([0., 0.], dtype=float32)}
    """
    rng = np.random.default_rng(seed)

    def value(path, leaf):
        # The leaf's own name: the last path entry, past NNX's ``.value`` attribute.
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        name = next((n for n in reversed(names) if n not in ("", "value")), "")
        if "scale" in name or "var" in name:
            return np.ones(leaf.shape, leaf.dtype)
        if "bias" in name or "mean" in name:
            return np.zeros(leaf.shape, leaf.dtype)
        fan_in = max(int(np.prod(leaf.shape[:-1])), 1)
        return (rng.normal(size=leaf.shape) / np.sqrt(fan_in)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(value, shapes)
