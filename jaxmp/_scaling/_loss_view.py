"""What a jaxmp train step tells the precision debugger: the loss it wraps, on the step's own arguments.

A step runs its loss inside a ``shard_map`` (sharded layouts), a ``pmap`` or a Flax model call,
and differentiates it at the loss scale kept in the optimizer state. The debugger
(`jaxmp.diagnostics`) treats a ``shard_map`` or ``pmap`` as one op, so every step exposes
the loss instead (fields of the `jaxmp._step.TrainStep` record the builders return):
``step.loss_fn`` (the user's loss, or the model's) and
``step.loss_view(*step_args) -> LossView``, the same loss as one function of plain arrays, on
the arguments the step was called with, and the scale the step multiplies it by. The debugger
reads the view when it is handed a step (`find_view`) and says so in its report.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

#: Every step builder's public name; each exposes its loss (`expose`). The debugger's tests run
#: each one and fail on a public ``*train_step`` builder missing here.
STEP_BUILDERS = ("jaxmp.parallel.make_sharded_train_step", "jaxmp.parallel.make_pmap_train_step",
                 "jaxmp.flax.make_train_step", "jaxmp.flax.nnx.train_step")


class LossView(NamedTuple):
    """The loss a step differentiates, as the debugger runs it.

    Attributes:
      fn: ``fn(*args) -> loss``, a float32 scalar (the step's aux and model state dropped).
      args: its arguments, taken from the step's: ``args[0]`` are the parameters the step differentiates.
      loss_scale: the scale the step multiplies the loss by (a 0-d float32 array from the optimizer state).
      step: which step it came from, for the report (``"make_sharded_train_step(layout='zero')"``).
    """

    fn: Callable
    args: tuple
    loss_scale: Any
    step: str


def expose(step: Callable, loss_fn: Callable | None, view: Callable[..., LossView]) -> Callable:
    """Sets ``step.loss_fn`` and ``step.loss_view``; returns ``step``.

    For the one step that is a module-level function with its own API page,
    ``jaxmp.flax.nnx.train_step``; the built steps are `jaxmp._step.TrainStep` records, whose
    fields these are.
    """
    # setattr: a function object takes attributes, which a type checker cannot see on Callable.
    setattr(step, "loss_fn", loss_fn)
    setattr(step, "loss_view", view)
    return step


def find_view(fn: Any) -> Callable[..., LossView] | None:
    """``fn.loss_view``, looking through wrappers (``jax.jit``, ``functools.wraps``), or None."""
    seen = 0
    while fn is not None and seen < 16:
        view = getattr(fn, "loss_view", None)
        if callable(view):
            return view
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return None


def loss_only(loss_fn: Callable, with_aux: bool) -> Callable:
    """``loss_fn`` returning the loss alone (its first output when it returns ``(loss, aux)``)."""
    if not with_aux:
        return loss_fn

    def loss(*args):
        return loss_fn(*args)[0]

    loss.__name__ = getattr(loss_fn, "__name__", "loss")
    return loss


def scale_of(opt_state: Any) -> jax.Array:
    """The loss scale in ``opt_state`` (1 when it holds no loss-scaling state), float32 0-d."""
    from jaxmp._scaling._opt_state import get_loss_scale

    try:
        scale = get_loss_scale(opt_state).loss_scale
    except ValueError:  # a plain optax state: the step differentiates the loss unscaled
        return jnp.ones((), jnp.float32)
    return jnp.asarray(scale, jnp.float32).reshape(())


def generic_view(loss_fn: Callable, *, has_aux: bool, model_state: bool, name: str,
                 per_device: bool = False) -> Callable[..., LossView]:
    """The `LossView` of a ``step(params[, model_state], opt_state, batch[, rng])`` over ``loss_fn``.

    Args:
      loss_fn: the user's ``loss_fn(params[, model_state], batch[, rng])``.
      has_aux, model_state: as the builder's (``loss_fn`` then returns a tuple: the loss first).
      name: the builder, for the report.
      per_device: the step's arguments are pmap-laid (params and state replicated on a leading
        device axis, the batch ``[devices, per_device, ...]``): the view takes replica 0's
        state and the whole batch, one leading axis (the mean of equal shards' losses).
    """
    fn = loss_only(loss_fn, has_aux or model_state)

    def view(*args, **kwargs) -> LossView:
        names = ("params", "model_state", "opt_state", "batch", "rng") if model_state else \
            ("params", "opt_state", "batch", "rng")
        if len(args) > len(names) or any(k not in names for k in kwargs):
            raise TypeError(f"{name}: the step takes ({', '.join(names)}), got {len(args)} positional and "
                            f"{sorted(kwargs)} keyword arguments")
        bound = dict(zip(names, args), **kwargs)
        missing = [n for n in names[:-1] if n not in bound]
        if missing:
            raise TypeError(f"{name}: the step's arguments lack {', '.join(missing)}")
        state = [bound[n] for n in names[:-2]]  # params[, model_state], opt_state
        batch, rng = bound["batch"], bound.get("rng")
        if per_device:
            state = [jax.tree_util.tree_map(lambda x: x[0], s) for s in state]
            batch = jax.tree_util.tree_map(lambda x: jnp.reshape(x, (-1, *jnp.shape(x)[2:])), batch)
        opt_state = state.pop()
        loss_args = (*state, batch) + (() if rng is None else (rng,))
        return LossView(fn, loss_args, scale_of(opt_state), name)

    return view
