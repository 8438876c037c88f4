"""The gradient all-reduce over a named axis, in float32 by default (pmap, shard_map).

Below both the train-step builder (`jaxmp._step`) and the data-parallel helpers, so that
neither the Flax steps nor the builder import `jaxmp.parallel`; the public name stays
``jaxmp.parallel.all_reduce_gradients``.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxmp._typing import AxisName, PyTree

from jaxmp._dtypes import accumulation_dtype, float_dtype, is_floating_array


def check_axis_name(axis_name: AxisName) -> AxisName:
    """``axis_name`` if it can name a pmap axis (not None, hashable), else a clear error.

    A list of axis names (``["data", "model"]``) is taken as the tuple JAX's collectives
    accept; a list is not hashable and ``lax.pmin`` would fail on it deep inside JAX.

    Args:
      axis_name: a str (or any hashable name), or a tuple/list of them.

    Returns:
      ``axis_name``, a list turned into a tuple.
    """
    if axis_name is None:
        raise ValueError("axis_name must name the pmap axis (e.g. 'batch'), got None")
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for name in names:
        try:
            hash(name)
        except TypeError as e:
            raise TypeError(f"axis_name must be a str, or a tuple or list of str, got {axis_name!r} (a "
                            f"{type(name).__name__} in it is not hashable)") from e
    if not names:
        raise ValueError("axis_name must name at least one axis, got an empty sequence")
    return axis_name


def optional_axis_name(axis_name: AxisName | None) -> AxisName | None:
    """``None`` (no axis), or ``axis_name`` checked by `check_axis_name` (a list becomes a tuple)."""
    return None if axis_name is None else check_axis_name(axis_name)


def check_reduce_dtype(dtype: DTypeLike | None) -> np.dtype | None:
    """``None`` (reduce in each gradient's own dtype) or a floating dtype that can hold gradients.

    Every step and `all_reduce_gradients` call the setting ``reduce_dtype``; the errors name it so.

    Args:
      dtype: the user's reduce dtype.

    Returns:
      None or the numpy dtype (float16, bfloat16, float32 or float64).

    Raises:
      TypeError: not a floating dtype.
      ValueError: a float narrower than 16 bits (fp8, fp4), whose sums round and overflow.
    """
    if dtype is None:
        return None
    dt = float_dtype(dtype, "reduce_dtype")
    if dt.itemsize < 2:
        raise ValueError(
            f"reduce_dtype={dt.name} cannot hold gradients: {jnp.finfo(dt).nmant + 1} significant bits and a largest "
            f"value of {float(jnp.finfo(dt).max):g}, so their sum rounds or overflows; reduce in float32 (the "
            "default), or bfloat16/float16 to halve the traffic (fp8 is for matmul operands, jaxmp.fp8)")
    return dt


def all_reduce_gradients(grads: PyTree, axis_name: AxisName,
                         reduce_dtype: DTypeLike | None = jnp.float32) -> PyTree:
    """Mean of the gradients over a pmap/shard_map axis, communicated in ``reduce_dtype``.

    Floating leaves are cast to ``reduce_dtype``, summed in one ``lax.psum``, divided by the axis
    size in at least float32 and cast back; other leaves pass through. A float16 sum can overflow
    (every replica then skips together); bfloat16 keeps 8 mantissa bits.
    See docs/parallel.md#gradient-reduce-dtype.

    Args:
      grads: a pytree of per-replica gradients (scaled, as from [`jaxmp.value_and_grad`][jaxmp.value_and_grad]).
      axis_name: the bound pmap/shard_map axis to reduce over.
      reduce_dtype: dtype of the all-reduce; ``None`` reduces each leaf in its own dtype.

    Returns:
      The mean gradients, identical on every replica, each leaf in its original dtype.

    Raises:
      ValueError: ``axis_name`` is not bound, or ``reduce_dtype`` is an 8-bit (or narrower) float.
      TypeError: ``reduce_dtype`` is not a floating dtype or None.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> all_reduce = lambda g: jaxmp.parallel.all_reduce_gradients(g, "batch")
      >>> f = jax.pmap(all_reduce, axis_name="batch")
      >>> n = jax.local_device_count()
      >>> f(jnp.arange(n, dtype=jnp.float32))[0] == (n - 1) / 2
      Array(True, dtype=bool)
    """
    axis_name = check_axis_name(axis_name)
    reduce_dtype = check_reduce_dtype(reduce_dtype)
    floating = [is_floating_array(g) for g in jax.tree_util.tree_leaves(grads)]
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    send = [g.astype(reduce_dtype or g.dtype) for g, f in zip(leaves, floating) if f]
    try:
        summed = jax.lax.psum(send, axis_name)
        n = jax.lax.psum(1, axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name={axis_name!r} is not bound here: all-reduce gradients inside jax.pmap(..., axis_name={axis_name!r}) "
            "or shard_map over a mesh with that axis (under plain jit with sharded inputs there is nothing to reduce)"
        ) from e
    out, it = [], iter(summed)
    for g, f in zip(leaves, floating):
        if not f:
            out.append(g)
            continue
        s = next(it)
        acc = accumulation_dtype(g.dtype)
        # Divide after the sum and in float32: dividing half-precision gradients first would
        # avoid the sum's overflow but flush the small ones to zero, which the loss scale
        # cannot detect (underflow is silent, overflow is not).
        out.append((s.astype(acc) / jnp.asarray(n, acc)).astype(g.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def mean_model_state(state: PyTree, axis_name: AxisName) -> PyTree:
    """The model state (BatchNorm statistics) averaged over a pmap axis, bitwise equal on every replica.

    Floating leaves are averaged in float32; a leaf every replica holds bitwise the same is returned
    as it is (a mean of equal values can drift); other leaves pass through.

    Args:
      state: the per-replica model state.
      axis_name: the bound pmap axis.

    Returns:
      The averaged model state.
    """
    mean = all_reduce_gradients(state, axis_name, jnp.float32)

    def keep_equal(x, m):
        if not is_floating_array(x):
            return m
        # Bitwise equal on every replica iff every replica equals the elementwise max; one
        # collective of the leaf's size plus a scalar one.
        same = jnp.all(x == jax.lax.pmax(x, axis_name))
        same = jax.lax.pmin(same.astype(jnp.int32), axis_name) == 1
        return jnp.where(same, x, m)

    return jax.tree_util.tree_map(keep_equal, state, mean)
