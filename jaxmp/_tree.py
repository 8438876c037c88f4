"""Pytree helpers shared by the optax transforms, the state readers, the lean recipes and the Flax doors.

Private: jaxmp's own modules import it as ``from jaxmp import _tree``. optax's ``tree_utils``
finds states by field name (``tree_get``), not by class, and has no check that names the first
leaf where two trees differ, so these two small helpers stay here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def find_states(tree: Any, cls: type) -> list:
    """Every ``cls`` instance in a pytree (optax states are nested tuples and NamedTuples)."""
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, cls)) if isinstance(x, cls)]


def check_all_arrays(tree: Any, what: str) -> None:
    """Raises a TypeError naming the first leaf of ``tree`` that is not an array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(f"{what} leaf at {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an array")


def check_same_structure(tree: Any, ref: Any, what: str, ref_what: str) -> None:
    """Raises a ValueError naming the first leaf where two trees differ in structure or shape."""
    tg, tr = jax.tree_util.tree_structure(tree), jax.tree_util.tree_structure(ref)
    if tg != tr:
        raise ValueError(f"{what} and {ref_what} have different tree structures:\n  {what}: {tg}\n  {ref_what}: {tr}")
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree_util.tree_leaves(ref)):
        if jnp.shape(g) != jnp.shape(r):
            raise ValueError(
                f"{what} leaf at {jax.tree_util.keystr(path)} has shape {jnp.shape(g)} but the {ref_what} leaf "
                f"has {jnp.shape(r)}"
            )
