"""Pytree helpers shared by the optax transforms, the state readers, the lean recipes and the Flax doors.

Private: jaxmp's own modules import it as ``from jaxmp import _tree``. optax's ``tree_utils``
finds states by field name (``tree_get``), not by class, and has no check that names the first
leaf where two trees differ, so these two small helpers stay here; and `ShardsItself`, the
protocol through which a state node tells jaxmp.parallel's layouts how to split it.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

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


@runtime_checkable
class ShardsItself(Protocol):
    """An optimizer-state node that says how a data-parallel layout splits it.

    jaxmp.parallel's ZeRO and FSDP layouts (``jaxmp.parallel.state_specs``) call these methods on
    every node of an optimizer state that has them, and name no state type or field: a state
    whose leaves are not plain moments (jaxmp.lean's quantized ones: codes and a scale a block)
    carries its own layout, as torchao's ``OptimState8bit`` carries its distributed behaviour.
    """

    def split_axes(self, params_def: jax.tree_util.PyTreeDef, param_shapes: Sequence[tuple], n: int) -> dict[int, set]:
        """``{param index: axes}``: the params (leaves of ``params_def``, of ``param_shapes``)
        whose state this node holds in a form that only some splits keep whole, with the axes of
        each that may be split ``n`` ways. The layout splits a param (and so its state) only on
        an axis every node allows; a param no node names splits anywhere."""
        ...

    def partition_specs(self, specs_of: Callable[[Any], Any]) -> Any:
        """This node with a ``PartitionSpec`` for each leaf: ``specs_of`` lays out a plain
        sub-tree (moments shaped like the params take their param's split; scalars stay
        replicated)."""
        ...
