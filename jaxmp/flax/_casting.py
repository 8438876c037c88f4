"""Casting by module path, shared by the Linen and NNX integrations (the per-call casts live in the engine)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxmp._dtypes import is_floating_array
from jaxmp.engine._seams import ModuleRule

#: A module path as strings, e.g. ``("ResBlock_0", "BatchNorm_0")`` or ``("layers", "0")``.
Path = tuple[str, ...]


def is_float32_rule(rule: ModuleRule) -> bool:
    """Whether ``rule`` runs its module in float32 or wider (a ``"float32"`` class or path rule, a float32 policy).
    """
    return np.dtype(rule.compute_dtype).itemsize >= 4


def enclosing_float32(path: Path, float32_rules: dict[Path, ModuleRule]) -> ModuleRule | None:
    """The rule of the nearest module strictly above ``path`` that ``float32_rules`` holds, or None.

    A half-list layer inside a block a class rule keeps in float32 takes the block's rule, for
    its compute and its params' storage alike: the rule names the whole block, as a path rule
    does (Linen and NNX both ask here).
    """
    # Longest proper prefix first: the nearest block's rule, as cast_by_path picks for params.
    return next((float32_rules[path[:n]] for n in range(len(path) - 1, -1, -1) if path[:n] in float32_rules), None)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def cast_by_path(tree: Any, rules: dict[Path, ModuleRule], default: np.dtype, field: str) -> Any:
    """Casts each floating leaf of a params tree to the dtype of its nearest ruled module.

    A leaf at ``("ResBlock_0", "BatchNorm_0", "scale")`` takes the rule of the longest
    prefix found in ``rules`` (here the BatchNorm's), else ``default``; so the params of an
    unlisted helper module inside a float32 module stay float32 too.

    Args:
      tree: a params tree nested by module path (Linen ``params``, NNX ``State``).
      rules: module path -> rule, for the modules that have one.
      default: the dtype for leaves under no ruled module.
      field: ``"compute_dtype"`` (for a forward pass) or ``"param_dtype"`` (for storage).

    Returns:
      The cast tree (``astype`` inside the caller's trace, so gradients flow back).
    """

    def cast(path, leaf):
        if not is_floating_array(leaf):
            return leaf
        names = tuple(_key_name(k) for k in path)
        dtype = default
        for n in range(len(names) - 1, -1, -1):  # longest module-path prefix wins; () is the root
            rule = rules.get(names[:n])
            if rule is not None:
                dtype = getattr(rule, field)
                break
        return leaf if leaf.dtype == dtype else leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, tree)
