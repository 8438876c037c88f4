"""Marking regions: float32 or half regions, and half-input kernels (``custom_fwd``).

A region is a ``jax.named_scope`` whose name the engine reads (``jaxmp[float32]``,
``jaxmp[half]``, ``jaxmp[keep]``), so the marks survive ``jit``, ``scan``, ``remat`` and every
other transformation and show up in profiles.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax.typing import DTypeLike

from jaxmp._typing import PyTree

from jaxmp.engine import _config
from jaxmp.engine._rules import _region_dtype, marker
from jaxmp._dtypes import cast_floating


def _label(fn: Callable) -> str:
    return getattr(fn, "__qualname__", getattr(fn, "__name__", type(fn).__name__))


def region(dtype: DTypeLike) -> Callable[[Callable], Callable]:
    """Decorator: every floating op of the function runs in ``dtype`` under autocast.

    Outside autocast the function is unchanged. ``"keep"`` leaves its ops exactly as traced
    (use it to pin a choice a float32 trace cannot show, such as ``x.astype(jnp.float32)`` of
    a value that is already float32).

    Args:
      dtype: ``"float32"``, ``"half"`` (the autocast compute dtype), ``"keep"`` or a
        floating dtype.

    Returns:
      A decorator.

    Raises:
      TypeError: ``dtype`` is not floating, ``"half"`` or ``"keep"``.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> @jaxmp.autocast_region("float32")
      ... def head(x, w):
      ...     return x @ w
      >>> f = jaxmp.autocast(lambda x, w: head(x, w), "O1-bf16")
      >>> f(jnp.ones((2, 2)), jnp.ones((2, 2))).dtype
      dtype('float32')
    """
    name = _region_dtype(dtype, "autocast_region")

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"autocast_region expects a function, got {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with jax.named_scope(marker(name, _label(fn))):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


float32_region = region("float32")
float32_region.__doc__ = """Decorator: the function's ops run in float32 under autocast (``region("float32")``).

Example:
  >>> import jax.numpy as jnp, jaxmp
  >>> @jaxmp.float32_region
  ... def head(x, w):
  ...     return x @ w
  >>> jaxmp.autocast(lambda x: head(x, x), "O1-bf16")(jnp.ones((2, 2))).dtype
  dtype('float32')
"""


def half_inputs(fn: Callable | None = None, *, dtype: DTypeLike | None = None) -> Callable:
    """Decorator for kernels that refuse float32 (cuDNN attention, fp8 dots, Pallas kernels).

    Like ``torch.amp.custom_fwd(cast_inputs=...)``: under autocast the function is traced with its
    floating inputs in the compute dtype (or ``dtype``) and its ops are left as traced; outside
    autocast it is called unchanged. See docs/autocast.md#half-only-kernels-and-attention.

    Args:
      fn: the function (or use ``@half_inputs(dtype=...)``).
      dtype: the dtype for the inputs; None for the autocast compute dtype.

    Returns:
      The wrapped function.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> @jaxmp.half_inputs
      ... def kernel(q, k):
      ...     assert q.dtype != jnp.float32, "half only"
      ...     return q @ k.T
      >>> jaxmp.autocast(kernel, "O1-bf16")(jnp.ones((2, 4)), jnp.ones((3, 4))).shape
      (2, 3)
    """
    if fn is None:
        return functools.partial(half_inputs, dtype=dtype)
    if not callable(fn):
        raise TypeError(f"half_inputs expects a function, got {type(fn).__name__}")
    fixed = None if dtype is None else _region_dtype(dtype, "half_inputs")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        cfg = _config.current()
        if cfg is None:
            return fn(*args, **kwargs)
        target = cfg.compute_dtype if fixed in (None, "half") else fixed
        args, kwargs = cast_floating((args, kwargs), target)
        with _config.TRACING(None), jax.named_scope(marker("keep", _label(fn))):
            return fn(*args, **kwargs)

    return wrapper


def _check_accumulate(total: Any, delta: Any) -> None:
    """Raises naming the leaf where ``accumulate(total, delta)`` cannot be an accumulator's update.

    The total must be an array (it fixes the dtype of the sum: a Python float has none), both
    trees must have one structure, and ``delta`` must not change ``total``'s shape: a loop carry
    updated to another shape fails inside ``scan``/``while_loop`` far from the call.
    """
    t_def, d_def = jax.tree_util.tree_structure(total), jax.tree_util.tree_structure(delta)
    if t_def != d_def:
        raise ValueError(f"jaxmp.accumulate: total and delta must have the same tree structure, got\n"
                         f"  total: {t_def}\n  delta: {d_def}")
    for (path, t), d in zip(jax.tree_util.tree_leaves_with_path(total), jax.tree_util.tree_leaves(delta)):
        where = f" at {jax.tree_util.keystr(path)}" if path else ""
        if not hasattr(t, "dtype") or not hasattr(t, "shape"):
            raise TypeError(f"jaxmp.accumulate: total{where} must be an array, got the {type(t).__name__} {t!r}: "
                            "its dtype is the accumulator's, so make it one, e.g. jnp.float32(0.0) or "
                            "jnp.zeros(shape, jnp.float32)")
        d_shape = jax.numpy.shape(d)
        try:
            out = jax.numpy.broadcast_shapes(t.shape, d_shape)
        except ValueError:
            out = None
        if out != tuple(t.shape):
            raise ValueError(f"jaxmp.accumulate: delta{where} has shape {d_shape}, which would change total's shape "
                             f"{tuple(t.shape)}{'' if out is None else f' to {out}'}; a running total (a loop carry) "
                             "keeps its shape: reduce delta first (e.g. delta.sum(0)) or give total the full shape")


def accumulate(total: PyTree, delta: PyTree) -> PyTree:
    """``total + delta`` computed in ``total``'s dtype under autocast: an explicit accumulator.

    For a loop carry autocast cannot see is an accumulator (it is also read elsewhere, as ``y`` in
    ``y = y + h * f(y)``). Outside autocast it is ``total + delta.astype(total.dtype)``.
    See docs/autocast.md#control-flow-differentiation-and-parallelism.

    Args:
      total: the running value (e.g. a float32 loop carry); a pytree of arrays.
      delta: what to add, the same structure; cast to ``total``'s dtypes.

    Returns:
      ``total + delta``, leaf by leaf, in ``total``'s dtypes.

    Raises:
      TypeError: a floating (or complex) ``delta`` into an integer or boolean ``total``, or a
        complex one into a real total: the cast to ``total``'s dtype would drop the fraction
        (``0.7`` adds 0) or the imaginary part.
      ValueError: the trees differ, or ``delta`` would change ``total``'s shape.
      TypeError: a ``total`` leaf is not an array (a Python float has no dtype to keep).

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> def euler(w, y):
      ...     step = lambda i, y: jaxmp.accumulate(y, 1e-3 * jnp.tanh(y @ w))
      ...     return jax.lax.fori_loop(0, 1000, step, y)
      >>> y = jaxmp.autocast(euler, "O1-bf16")(jnp.eye(4), jnp.ones((2, 4)))
      >>> y.dtype, bool(jnp.allclose(y, euler(jnp.eye(4), jnp.ones((2, 4))), rtol=1e-2))
      (dtype('float32'), True)
    """
    _check_accumulate(total, delta)

    def add(t, d):
        _check_accumulable(t, d)
        with jax.named_scope(marker(jax.numpy.dtype(t.dtype).name, "accumulate")):
            return t + jax.numpy.asarray(d).astype(t.dtype)

    return jax.tree_util.tree_map(add, total, delta)


def _check_accumulable(total: Any, delta: Any) -> None:
    """Refuses a ``delta`` whose cast to ``total``'s dtype would lose it (see `accumulate`)."""
    t, d = jax.numpy.result_type(total), jax.numpy.result_type(delta)
    kind = lambda dt: ("complex" if jax.numpy.issubdtype(dt, jax.numpy.complexfloating) else
                       "float" if jax.numpy.issubdtype(dt, jax.numpy.floating) else "exact")
    if (kind(d), kind(t)) in {("float", "exact"), ("complex", "exact"), ("complex", "float")}:
        raise TypeError(
            f"jaxmp.accumulate: a {d} delta cannot be added into a total of dtype {t}: the add runs in the total's dtype, "
            f"which would drop the delta's {'imaginary part' if kind(d) == 'complex' and kind(t) == 'float' else 'fraction'} "
            f"(0.7 into an integer adds 0); make the total {d} (e.g. jnp.zeros(n, jnp.float32)), or round the delta "
            "yourself first")
