"""The skip decision: is a step finite, and keep the new state or the old one.

One owner for "finite? then the new state, else the old one": the loss-scaling
transform, both Flax train states and the parallel helpers call `jaxmp._scaling._skip.keep_if_finite`.

Why not ``optax.apply_if_finite``: it also skips non-finite updates, but after
``max_consecutive_errors`` failures in a row it *applies* the non-finite update, and it
has no loss scale to back off, so a half-precision run that keeps overflowing would
write inf/NaN into the params. jaxmp never applies a non-finite update; a run stuck
skipping is reported by [`jaxmp.check_health`][jaxmp.check_health] instead.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxmp._typing import PyTree

from jaxmp._dtypes import is_inexact_array

T = TypeVar("T")


def check_flag(flag: ArrayLike) -> jax.Array:
    """Returns ``flag`` as a boolean scalar array, or raises naming what is wrong."""
    flag = jnp.asarray(flag)
    if flag.shape != ():
        raise ValueError(f"expected a boolean scalar, got shape {flag.shape}")
    if flag.dtype != jnp.bool_:
        raise TypeError(f"expected a boolean scalar, got dtype {flag.dtype}")
    return flag


def all_finite(tree: PyTree) -> jax.Array:
    """Whether every floating or complex leaf of ``tree`` is free of inf and NaN.

    Non-inexact leaves (ints, bools, PRNG keys, float0) are ignored.

    Args:
      tree: any pytree, typically gradients.

    Returns:
      A boolean scalar array (``True`` for a tree with no inexact leaves).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> bool(jaxmp.all_finite({"a": jnp.ones(2), "b": jnp.array([jnp.inf])}))
      False
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_inexact_array(x)]
    if not leaves:
        return jnp.array(True)
    # isfinite per element, reduced per leaf: XLA fuses the mask into the gradient's producer
    # (a weight gradient cast up from half precision and transposed is read once, in half
    # precision, never written out as float32 for the check). A float reduction such as
    # sum(x - x) is cheaper on a gradient already in memory, but XLA:CPU's reduction kernels
    # take their operand from memory, so it writes such a gradient out first (measured: the
    # O1 MLP train step moved 7% more bytes than the floor).
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def select_tree(pred: ArrayLike, a: T, b: T) -> T:
    """Selects ``a`` where ``pred`` is true else ``b``, leaf by leaf (``lax.select``).

    Args:
      pred: a boolean scalar.
      a: a pytree.
      b: a pytree of the same structure, shapes and dtypes.

    Returns:
      ``a`` or ``b``, chosen without Python branching (usable under ``jit``).

    Raises:
      ValueError / TypeError: ``pred`` is not a boolean scalar, or the trees differ.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.select_tree(jnp.array(False), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})["x"]
      Array([0., 0.], dtype=float32)
    """
    pred = check_flag(pred)
    ta, tb = jax.tree_util.tree_structure(a), jax.tree_util.tree_structure(b)
    if ta != tb:
        raise ValueError(f"select_tree needs two trees of the same structure, got {ta} and {tb}")

    def sel(x, y):
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(f"select_tree leaves differ: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        return jax.lax.select(pred, x, y) if x.shape == () else jax.lax.select(jnp.broadcast_to(pred, x.shape), x, y)

    return jax.tree_util.tree_map(sel, a, b)


def keep_if_finite(finite: ArrayLike, new: T, old: T) -> T:
    """The skip decision for any state pytree: ``new`` if the step was finite, else ``old`` bit for bit.

    Args:
      finite: the step's boolean scalar verdict (from the loss-scaling state).
      new: the state after the step (params, optimizer state, BatchNorm statistics ...).
      old: the state before it, same structure, shapes and dtypes.

    Returns:
      ``new`` or ``old``, selected leaf by leaf without Python branching.
    """
    return select_tree(finite, new, old)
