"""Casting helpers shared by the Linen and NNX integrations."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxmp.flax.overrides import ModuleRule
from jaxmp.dtypes import cast_floating, is_floating_array

#: A module path as strings, e.g. ``("ResBlock_0", "BatchNorm_0")`` or ``("layers", "0")``.
Path = tuple[str, ...]


def first_floating_dtype(tree: Any) -> np.dtype | None:
    """The dtype of the first floating array leaf of ``tree``.

    Args:
      tree: any pytree (e.g. a module call's ``(args, kwargs)``).

    Returns:
      A numpy dtype, or None if the tree has no floating array leaf.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp.flax.casting import first_floating_dtype
      >>> first_floating_dtype(((jnp.int32(1), jnp.ones(2, jnp.bfloat16)), {}))
      dtype(bfloat16)
    """
    for leaf in jax.tree_util.tree_leaves(tree):
        if is_floating_array(leaf):
            return np.dtype(leaf.dtype)
    return None


def cast_output(out: Any, rule: ModuleRule, input_dtype: np.dtype | None) -> Any:
    """Casts a ruled module's output as its rule says.

    Args:
      out: the module's return value (any pytree; only floating arrays are cast).
      rule: the module's :class:`jaxmp.flax.ModuleRule`.
      input_dtype: the dtype of the module's first floating input, before casting.

    Returns:
      ``out`` unchanged (``"computed"``), cast back to ``input_dtype`` (``"input"``, the
      float32 list), or cast to the rule's dtype (a per-class policy's output dtype).

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jaxmp.flax import ModuleRule
      >>> from jaxmp.flax.casting import cast_output
      >>> rule = ModuleRule(np.dtype("float32"), np.dtype("float32"), "input", "fp32")
      >>> cast_output(jnp.ones(2), rule, np.dtype("float16")).dtype
      dtype('float16')
    """
    if rule.output == "computed":
        return out
    if rule.output == "input":
        return out if input_dtype is None else cast_floating(out, input_dtype)
    return cast_floating(out, rule.output)


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

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jaxmp.flax import ModuleRule
      >>> from jaxmp.flax.casting import cast_by_path
      >>> rules = {("bn",): ModuleRule(np.dtype("float32"), np.dtype("float32"), "input", "fp32")}
      >>> t = cast_by_path({"bn": {"scale": jnp.ones(2)}, "fc": {"w": jnp.ones(2)}}, rules, jnp.bfloat16, "compute_dtype")
      >>> t["bn"]["scale"].dtype, t["fc"]["w"].dtype
      (dtype('float32'), dtype(bfloat16))
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
