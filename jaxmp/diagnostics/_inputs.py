"""What the precision debugger is handed, checked and normalised once for all its entry points.

A jaxmp train step is replaced by the loss it wraps (`jaxmp._scaling._loss_view`: the debugger cannot
see into its ``shard_map`` or ``pmap``); non-array arguments (strings, Python numbers, objects)
are static; a loss scale may be an array (the run's own ``get_loss_scale(opt_state).loss_scale``)
but must be finite and positive; an input that already holds inf/NaN is named.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from jaxmp._scaling import _loss_view


class Prepared(NamedTuple):
    """The function the debugger runs, on which arguments, and what it says about them.

    Attributes:
      fn: the function (the step's loss for a step; non-array arguments bound into it).
      args, kwargs: its array arguments (static leaves removed: ``None`` in their place).
      loss_scale: the step's loss scale (a float) when ``fn`` was a step, else None.
      note: a line for the report when the debugger ran something else than ``fn`` (a step's loss).
    """

    fn: Callable
    args: tuple
    kwargs: dict
    loss_scale: float | None
    note: str


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type))


def _is_none(x: Any) -> bool:
    return x is None


def check_loss_scale(name: str, loss_scale: Any) -> float:
    """``loss_scale`` (a number or a 0-d/one-element array) as a float; finite and positive, or a ValueError."""
    if isinstance(loss_scale, bool):
        raise TypeError(f"{name}: loss_scale must be a number or a one-element array, got {loss_scale!r}")
    try:
        array = np.asarray(jax.device_get(loss_scale), dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: loss_scale must be a number or a one-element array (e.g. "
                        f"jaxmp.get_loss_scale(opt_state).loss_scale), got {type(loss_scale).__name__}") from None
    if array.size != 1:
        raise ValueError(f"{name}: loss_scale must hold one value, got shape {array.shape}")
    value = float(array.reshape(()))
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: loss_scale must be a finite positive number, got {value!r}: an infinite scale "
                         "overflows every gradient, so nothing could be located; pass the run's scale, e.g. "
                         "jaxmp.get_loss_scale(opt_state).loss_scale")
    return value


def check_rules(name: str, rules: Any) -> None:
    """``rules`` is None or a `jaxmp.AutocastRules`, else a TypeError saying how to build one."""
    if rules is None:
        return
    from jaxmp.engine._seams import AutocastRules

    if not isinstance(rules, AutocastRules):
        raise TypeError(f"{name}: rules must be a jaxmp.AutocastRules, got {type(rules).__name__}: build one with "
                        "jaxmp.AutocastRules().with_scope('name', 'float32') (or jaxmp.default_rules(policy))")


def check_optimizer(name: str, optimizer: Any) -> None:
    if optimizer is not None and not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"{name}: optimizer must be an optax GradientTransformation, got "
                        f"{type(optimizer).__name__} {optimizer!r}: pass e.g. optax.adam(1e-3), not a name")


def prepare(name: str, fn: Any, args: tuple, kwargs: dict, *, need_args: bool = True) -> Prepared:
    """Checks ``fn`` and its arguments; a jaxmp step becomes its loss (see the module doc).

    Args:
      name: the entry point, for messages.
      fn: what the user handed over.
      args, kwargs: its arguments.
      need_args: raise when ``fn`` is given no arguments (the comparison differentiates ``args[0]``).

    Raises:
      TypeError: ``fn`` is not callable, or no arguments where some are needed.
      ValueError: an argument already holds inf/NaN (named by its path).
    """
    if not callable(fn):
        raise TypeError(f"{name} expects a callable (a loss function or a train step), got "
                        f"{type(fn).__name__}: {fn!r}")
    note, scale = "", None
    view = _loss_view.find_view(fn)
    if view is not None:
        v = view(*args, **kwargs)
        scale = float(np.asarray(jax.device_get(v.loss_scale)))
        fn, args, kwargs = v.fn, tuple(v.args), {}
        note = (f"{v.step}: the loss it wraps (step.loss_fn, the loss its shard_map/pmap/model call runs) on the "
                f"step's parameters and batch, differentiated at the step's loss scale {scale:g}")
    if need_args and not args and not kwargs:
        raise TypeError(f"{name}: fn was given no inputs. Pass them as arguments, {name}(fn, params, batch, ...): "
                        "the parameters first (the comparison differentiates args[0]); arrays a function closes "
                        "over are constants to it")
    from jaxmp._scaling._opt_state import first_non_finite

    bad = first_non_finite((args, kwargs) if kwargs else tuple(args))
    if bad is not None:
        raise ValueError(f"{name}: the input {bad} already holds inf/NaN, so the run is not finite before any op "
                         "rounds; locate where it came from first (the data, or the previous step: "
                         "jaxmp.diagnostics.locate_non_finite on that step)")
    fn, args, kwargs = bind_static(fn, args, kwargs)
    return Prepared(fn, args, kwargs, scale, note)


def bind_static(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """Binds the non-array leaves of ``(args, kwargs)`` into ``fn`` (``None`` stays in their place).

    Strings, Python numbers and other objects are static to the debugger, as ``jax.jit``'s
    ``static_argnums`` are: they are not traced, so a function that branches on them (or a
    ``jax.jit(f, static_argnums=...)``) is traced with their values.
    """
    leaves, tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)), is_leaf=_is_none)
    static = {i: x for i, x in enumerate(leaves) if x is not None and not _is_array(x)}
    if not static:
        return fn, tuple(args), dict(kwargs)
    dynamic = [None if i in static else x for i, x in enumerate(leaves)]
    args2, kwargs2 = jax.tree_util.tree_unflatten(tree, dynamic)

    def bound(*a, **k):
        cur = jax.tree_util.tree_flatten((tuple(a), dict(k)), is_leaf=_is_none)[0]
        for i, x in static.items():
            cur[i] = x
        a, k = jax.tree_util.tree_unflatten(tree, cur)
        return fn(*a, **k)

    setattr(bound, "__wrapped__", fn)  # find_view and inspect look through it
    return bound, tuple(args2), dict(kwargs2)


def bind_non_floating_params(fn: Callable, args: tuple) -> tuple[Callable, tuple]:
    """Binds the non-floating leaves of ``args[0]`` (ints, PRNG keys) into ``fn`` as constants.

    The comparison differentiates ``args[0]`` and trains it: only its floating leaves take part
    (JAX refuses to differentiate an int without ``allow_int``; an optimizer cannot step a key).
    """
    if not args:
        return fn, args
    leaves, tree = jax.tree_util.tree_flatten(args[0], is_leaf=_is_none)
    fixed = {i: x for i, x in enumerate(leaves) if x is not None and not _floating(x)}
    if not fixed:
        return fn, tuple(args)
    params = jax.tree_util.tree_unflatten(tree, [None if i in fixed else x for i, x in enumerate(leaves)])

    def bound(p, *a, **k):
        cur = jax.tree_util.tree_flatten(p, is_leaf=_is_none)[0]
        for i, x in fixed.items():
            cur[i] = x
        return fn(jax.tree_util.tree_unflatten(tree, cur), *a, **k)

    return bound, (params, *args[1:])


def _floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and np.issubdtype(np.dtype(dtype), np.inexact) if not _is_key(x) else False


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def scaled_like_the_step(grads: Any, opt_state: Any) -> Any:
    """``grads`` times the loss scale in ``opt_state`` when it holds a `jaxmp.loss_scaling` state.

    The debugger differentiates the unscaled loss; a user's ``jaxmp.loss_scaling`` optimizer
    divides the gradients by its scale, so they are handed over scaled (and the scale marked as
    having scaled them: no "never multiplied a loss" warning), as ``jaxmp.value_and_grad`` does.
    """
    from jaxmp._scaling._opt_state import get_loss_scale

    try:
        scale = get_loss_scale(opt_state)
    except ValueError:  # a plain optax state
        return grads
    return scale.scale(grads)
