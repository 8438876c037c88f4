"""The one train-step builder: scaled gradients, all-reduce, the fused skip-aware update.

The Linen and NNX steps (`jaxmp.flax._steps`) and the pmap and sharded-jit steps (`jaxmp.parallel`)
are thin adapters over `make_step`; every step reports the same metrics (`step_metrics`).
What one step does, in order: see docs/design.md#the-train-step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmp import fp8
from jaxmp._collectives import all_reduce_gradients, optional_axis_name
from jaxmp.fp8._seams import FP8_COLLECTION
from jaxmp._grad import value_and_grad
from jaxmp._opt_state import find_loss_scaling_state, get_loss_scale, scaling_stats
from jaxmp._skip import keep_if_finite
from jaxmp._transform import update_and_apply


class Fp8Hooks(NamedTuple):
    """How a step finds, feeds and updates delayed-scaling fp8 state inside its model state.

    Attributes:
      split: ``model_state -> (fp8_state, rest)``; ``fp8_state`` is differentiated (its
        gradient is the amaxes the step observed), ``rest`` is not.
      merge: ``(rest, fp8_state) -> model_state``, what the loss function is given (also used
        to put the updated fp8 state into the new model state).
      update: ``(fp8_state, observed) -> new fp8_state`` ([`jaxmp.fp8.update_state`][jaxmp.fp8.update_state]).
    """

    split: Callable[[Any], tuple[Any, Any]]
    merge: Callable[[Any, Any], Any]
    update: Callable[[Any, Any], Any]


class StepResult(NamedTuple):
    """What one step returns.

    Attributes:
      params: the new params (bitwise the old ones on a skipped step).
      model_state: the new model state (bitwise the old one on a skipped step).
      opt_state: the new optimizer state (inner state bitwise unchanged on a skipped step).
      loss: the true (unscaled) loss, float32, averaged over ``axis_name`` when given.
      aux: the loss function's auxiliary output (per replica).
      finite: bool [], whether the step was applied.
      loss_scale: float32 [], the scale this step's loss was multiplied by.
    """

    params: Any
    model_state: Any
    opt_state: Any
    loss: jax.Array
    aux: Any
    finite: jax.Array
    loss_scale: jax.Array


def make_step(loss_fn: Callable[..., Any], tx: Any, *, axis_name: Any = None, reduce_dtype: Any = jnp.float32,
              reduce_grads: Callable | None = None, reduce_loss: Callable | None = None,
              reduce_model_state: Callable | None = None,
              fp8_hooks: Fp8Hooks | None = None, keep_model_state: Callable = keep_if_finite,
              pass_value: bool = True, differentiate: Callable | None = None,
              place_params: Callable | None = None) -> Callable[..., StepResult]:
    """Builds ``step(params, model_state, opt_state, batch, rng=None) -> StepResult``.

    Args:
      loss_fn: ``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, aux))``,
        the loss a scalar (computed in float32).
      tx: the optax transformation holding a [`jaxmp.loss_scaling`][jaxmp.loss_scaling] state.
      axis_name: a bound pmap / shard_map axis: gradients are averaged over it in
        ``reduce_dtype`` and the loss is ``pmean``-ed. ``None`` under plain or sharded ``jit``.
      reduce_dtype: dtype of the gradient all-reduce (float32; None: each gradient's own).
      reduce_grads: replaces the all-reduce (e.g. identity); default from ``axis_name``.
      reduce_loss: replaces the loss's ``pmean``; default from ``axis_name``. The reduced loss
        is what ``tx.update`` sees, so every replica records the same reason for a skip.
      reduce_model_state: applied to the new model state before it is kept (e.g. a mean of
        BatchNorm statistics over the replicas); default none.
      fp8_hooks: delayed-scaling fp8 state inside the model state (`Fp8Hooks`).
      keep_model_state: ``(finite, new, old) -> kept``, the skip rule of the model state
        (default `jaxmp._skip.keep_if_finite`; NNX keeps RNG counters moving).
      pass_value: give ``tx.update`` the loss as ``value`` (``skip_reason`` then tells a
        non-finite loss from non-finite gradients).
      differentiate: takes the gradient itself, in place of ``jaxmp.value_and_grad``:
        ``differentiate(loss_fn, opt_state, params, model_state, batch, rng) -> ((loss,
        (new_model_state, aux)), grads)`` with ``grads`` those of the loss scaled by the loss
        scale in ``opt_state`` (the sharded layouts: each data shard differentiates its own loss
        inside one ``shard_map`` and reduces its gradients there). Not with ``fp8_hooks``.
      place_params: maps the new params before they are returned (the sharded layouts: a
        sharding constraint onto the master's slices, so half params are gathered as such).

    Returns:
      The step function (not jitted).
    """
    axis_name = optional_axis_name(axis_name)
    if reduce_grads is None:
        def reduce_grads(grads):
            return grads if axis_name is None else all_reduce_gradients(grads, axis_name, reduce_dtype)

    if reduce_loss is None:
        def reduce_loss(loss):
            return loss if axis_name is None else jax.lax.pmean(loss, axis_name)

    if differentiate is not None and fp8_hooks is not None:
        raise ValueError("make_step: differentiate and fp8_hooks exclude each other (the fp8 state's gradient "
                         "is taken by the default differentiation)")

    def step(params, model_state, opt_state, batch, rng=None) -> StepResult:
        scale = jnp.asarray(get_loss_scale(opt_state).loss_scale, jnp.float32)
        if differentiate is not None:
            with fp8.gradient_loss_scale(scale):
                (loss, (new_model_state, aux)), grads = differentiate(loss_fn, opt_state, params, model_state,
                                                                      batch, rng)
            return finish(params, model_state, opt_state, scale, loss, new_model_state, aux, grads, None)
        fp8_state, rest = fp8_hooks.split(model_state) if fp8_hooks is not None else (None, model_state)

        def scaled(p, f):
            with fp8.gradient_loss_scale(scale):  # delayed-scaling fp8 ops report unscaled amaxes
                return loss_fn(p, model_state if fp8_hooks is None else fp8_hooks.merge(rest, f), batch, rng)

        # With delayed fp8 scaling, the gradient with respect to the fp8 state is the amaxes this
        # step observed (jaxmp.fp8.update_state); it never reaches the optimizer.
        (loss, (new_model_state, aux)), (grads, observed) = value_and_grad(
            scaled, opt_state, argnums=(0, 1), has_aux=True)(params, fp8_state)
        return finish(params, model_state, opt_state, scale, loss, new_model_state, aux, grads,
                      (fp8_state, observed))

    def finish(params, model_state, opt_state, scale, loss, new_model_state, aux, grads, fp8_observed):
        # Reduce before the update: a NaN on one replica, or an overflowing half-precision sum, is
        # then seen by every replica's finite check.
        grads = reduce_grads(grads)
        loss = reduce_loss(jnp.asarray(loss, jnp.float32))
        if reduce_model_state is not None:
            new_model_state = reduce_model_state(new_model_state)
        if fp8_hooks is not None:
            fp8_state, observed = fp8_observed
            new_fp8 = fp8_hooks.update(fp8_state, observed)
            new_model_state = fp8_hooks.merge(fp8_hooks.split(new_model_state)[1], new_fp8)
        extra = {"value": loss} if pass_value else {}
        new_params, new_opt_state = update_and_apply(tx, grads, opt_state, params, **extra)
        if place_params is not None:
            new_params = place_params(new_params)
        finite = find_loss_scaling_state(new_opt_state).last_step_finite
        new_model_state = keep_model_state(finite, new_model_state, model_state)
        return StepResult(new_params, new_model_state, new_opt_state, loss, aux, finite, scale)

    return step


def step_metrics(out: StepResult, **extra: Any) -> dict[str, Any]:
    """The metrics of one step, the same keys with the same meaning for every step (Flax, NNX,
    pmap, sharded).

    ``loss_scale`` is the scale this step's loss was multiplied by, the one its
    ``last_step_finite`` and ``loss`` belong to (as torch's ``GradScaler.get_scale()`` read
    before ``scaler.update()``): on an overflow it is the scale that overflowed, and the backed-off
    scale the next step uses is in the returned optimizer state
    (``jaxmp.scaling_stats(opt_state)["loss_scale"]``). The skip counters are after this step.

    Args:
      out: the step's `StepResult`.
      **extra: further entries (``accuracy``, ``aux``).

    Returns:
      A dict: ``loss``, ``loss_scale``, ``last_step_finite`` (whether the step was
      applied), ``consecutive_skips``, ``total_skips``, and ``extra``.
    """
    stats = scaling_stats(out.opt_state)
    stats["loss_scale"] = out.loss_scale
    return dict(loss=out.loss, **stats, **extra)


def check_no_model_state_in_aux(aux: Any) -> None:
    """Raises when a per-replica ``aux`` carries BatchNorm statistics (they would drift apart)."""
    if isinstance(aux, Mapping) and "batch_stats" in aux:
        raise ValueError(
            "loss_fn returned 'batch_stats' in its aux: under pmap aux is per replica and never reduced, so each "
            "replica's BatchNorm statistics would drift apart. Build the step with model_state=True and return "
            "(loss, new_model_state): the statistics are then averaged over the replicas (bitwise equal on every "
            "one) and kept unchanged on skipped steps."
        )


def check_differentiable_params(params: Any) -> None:
    """A TypeError naming the first params leaf the step cannot differentiate (integer, bool, key).

    Checked at trace time; without it ``jax.grad`` fails with a message that names no leaf.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(
                f"params leaf at {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}: the step differentiates "
                "every params leaf, so each must be floating. Keep integer arrays (indices, counters, masks) out of "
                "the params: close over them in loss_fn, pass them in the batch, or carry them as model state "
                "(model_state=True)")


def make_loss_fn_step(loss_fn: Callable, tx: Any, *, has_aux: bool, reduce_grads: Callable, reduce_loss: Callable,
                      with_rng: bool, rng_transform: Callable | None = None, with_model_state: bool = False,
                      reduce_model_state: Callable | None = None, per_replica_aux: bool = False,
                      wrap_loss: Callable | None = None, differentiate: Callable | None = None,
                      place_params: Callable | None = None) -> Callable:
    """`make_step` for a user's ``loss_fn(params[, model_state], batch[, rng])``: the pmap and sharded-jit steps.

    Args:
      loss_fn: ``loss_fn(params, batch)``, with ``model_state`` after the params and ``rng``
        last when asked; returns the loss, ``(loss, aux)`` with ``has_aux``, ``(loss,
        new_model_state)`` with ``with_model_state``, or ``(loss, (new_model_state, aux))`` with both.
      tx: the optax transformation holding a [`jaxmp.loss_scaling`][jaxmp.loss_scaling] state.
      has_aux: whether ``loss_fn`` returns ``aux`` (reported as ``metrics["aux"]``).
      reduce_grads: the gradient all-reduce (pmean under pmap; a sharding constraint under
        sharded jit, where the global-view mean already is the all-reduce). It runs before
        ``tx.update``, so a NaN on one replica is seen by every replica's finite check.
      reduce_loss: the loss's reduction over the replicas.
      with_rng: whether the step takes an rng (passed to ``loss_fn`` last).
      rng_transform: maps the step's rng to this replica's (e.g. folds in the axis index).
      with_model_state: the step's first argument is ``(params, model_state)``.
      reduce_model_state: averages the new model state over the replicas before it is kept.
      per_replica_aux: refuse an ``aux`` dict holding ``batch_stats`` (pmap: it would drift).
      wrap_loss: maps the canonical loss ``(params, model_state, batch, rng) -> (loss,
        (model_state, aux))`` to another of the same signature (the sharded-jit layouts' global view).
      differentiate: takes the gradient of the canonical loss itself (`make_step`; the
        sharded-jit layouts' per-shard reduce).
      place_params: maps the new params to where they are made (`make_step`): the sharded-jit
        layouts put them on the master's slices, so that each device casts its slice and the
        params are gathered in their own (half) dtype, not as float32 masters.

    Returns:
      ``body(state, opt_state, batch, rng=None) -> (state, opt_state, metrics)`` (not
      jitted), ``metrics`` from `step_metrics`.
    """
    # optax's name for the loss; the loss-scaling state then tells a NaN loss from NaN gradients.
    pass_value = isinstance(tx, optax.GradientTransformationExtraArgs)

    def canonical(params, model_state, batch, key):
        # The builder's loss signature, (params, model_state, batch, rng) -> (loss, (state, aux)).
        args = ((model_state,) if with_model_state else ()) + (batch,) + ((key,) if with_rng else ())
        out = loss_fn(params, *args)
        if not (has_aux or with_model_state):
            return out, (model_state, None)
        loss, aux = out
        if per_replica_aux and has_aux and not with_model_state:
            check_no_model_state_in_aux(aux)
        if with_model_state:
            new_model_state, aux = aux if has_aux else (aux, None)
            return loss, (new_model_state, aux)
        return loss, (model_state, aux)

    step = make_step(canonical if wrap_loss is None else wrap_loss(canonical), tx,
                     reduce_grads=reduce_grads, reduce_loss=reduce_loss,
                     reduce_model_state=reduce_model_state if with_model_state else None, pass_value=pass_value,
                     differentiate=differentiate, place_params=place_params)

    def body(state, opt_state, batch, rng=None):
        params, model_state = state if with_model_state else (state, None)
        check_differentiable_params(params)
        if isinstance(model_state, Mapping) and FP8_COLLECTION in model_state:
            # Its update comes from the amaxes the step observes, which this generic step
            # cannot see: the scales would stay at their initial value without a word.
            raise ValueError(f"the model state holds delayed fp8 scaling state ({FP8_COLLECTION!r}), which this "
                             "generic step would never update: use jaxmp.flax.make_train_step(axis_name=...) "
                             "under pmap, or the 'O2-fp8-current' preset (no state)")
        key = (rng_transform(rng) if rng_transform is not None else rng) if with_rng else None
        out = step(params, model_state, opt_state, batch, key)
        metrics = step_metrics(out, **({"aux": out.aux} if has_aux else {}))
        if with_model_state:
            return (out.params, out.model_state), out.opt_state, metrics
        return out.params, out.opt_state, metrics

    return body
