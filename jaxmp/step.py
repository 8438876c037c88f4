"""The one train-step builder: scaled gradients, all-reduce, the fused skip-aware update.

The Linen and NNX steps (`jaxmp.flax`) and the pmap and sharded-jit steps
(`jaxmp.parallel`) are thin adapters over `make_step`: each turns its model into a
loss function of ``(params, model_state, batch, rng)`` and calls the step this returns. One
step, in order:

1. ``jaxmp.value_and_grad`` differentiates the loss times the scale held in the optimizer
   state (and, with delayed fp8 scaling, the fp8 state, whose gradient is the observed amaxes);
2. with ``axis_name`` (pmap / shard_map) the gradients are averaged in ``reduce_dtype``
   (float32) *before* the update, so every replica checks the same gradients;
3. `jaxmp.transform.update_and_apply`: unscale, check, run the optimizer and step the
   params inside one skip (``lax.cond`` off GPU, ``lax.select`` on GPU), so the compiled update
   makes the passes of a bare optax step plus one finiteness reduction;
4. the new model state (BatchNorm statistics, fp8 scales) is kept only if the step was applied
   (`jaxmp.skip.keep_if_finite`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxmp import fp8
from jaxmp.collectives import all_reduce_gradients, optional_axis_name
from jaxmp.grad import value_and_grad
from jaxmp.opt_state import find_loss_scaling_state, get_loss_scale
from jaxmp.skip import keep_if_finite
from jaxmp.transform import update_and_apply


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
              pass_value: bool = True) -> Callable[..., StepResult]:
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
        (default `jaxmp.skip.keep_if_finite`; NNX keeps RNG counters moving).
      pass_value: give ``tx.update`` the loss as ``value`` (``skip_reason`` then tells a
        non-finite loss from non-finite gradients).

    Returns:
      The step function (not jitted).

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> from jaxmp.step import make_step
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), "dynamic")
      >>> loss_fn = lambda p, s, b, rng: (jnp.mean((b @ p["w"]) ** 2), (s, None))
      >>> params = {"w": jnp.ones(3)}
      >>> out = make_step(loss_fn, tx)(params, {}, tx.init(params), jnp.ones((4, 3)))
      >>> float(out.loss), bool(out.finite)
      (9.0, True)
    """
    axis_name = optional_axis_name(axis_name)
    if reduce_grads is None:
        def reduce_grads(grads):
            return grads if axis_name is None else all_reduce_gradients(grads, axis_name, reduce_dtype)

    if reduce_loss is None:
        def reduce_loss(loss):
            return loss if axis_name is None else jax.lax.pmean(loss, axis_name)

    def step(params, model_state, opt_state, batch, rng=None) -> StepResult:
        scale = jnp.asarray(get_loss_scale(opt_state).loss_scale, jnp.float32)
        fp8_state, rest = fp8_hooks.split(model_state) if fp8_hooks is not None else (None, model_state)

        def scaled(p, f):
            with fp8.gradient_loss_scale(scale):  # delayed-scaling fp8 ops report unscaled amaxes
                return loss_fn(p, model_state if fp8_hooks is None else fp8_hooks.merge(rest, f), batch, rng)

        # With delayed fp8 scaling, the gradient with respect to the fp8 state is the amaxes this
        # step observed (jaxmp.fp8.update_state); it never reaches the optimizer.
        (loss, (new_model_state, aux)), (grads, observed) = value_and_grad(
            scaled, opt_state, argnums=(0, 1), has_aux=True)(params, fp8_state)
        # Reduce before the update: a NaN on one replica, or an overflowing half-precision sum, is
        # then seen by every replica's finite check.
        grads = reduce_grads(grads)
        loss = reduce_loss(jnp.asarray(loss, jnp.float32))
        if reduce_model_state is not None:
            new_model_state = reduce_model_state(new_model_state)
        if fp8_hooks is not None:
            new_fp8 = fp8_hooks.update(fp8_state, observed)
            new_model_state = fp8_hooks.merge(fp8_hooks.split(new_model_state)[1], new_fp8)
        extra = {"value": loss} if pass_value else {}
        new_params, new_opt_state = update_and_apply(tx, grads, opt_state, params, **extra)
        finite = find_loss_scaling_state(new_opt_state).last_step_finite
        new_model_state = keep_model_state(finite, new_model_state, model_state)
        return StepResult(new_params, new_model_state, new_opt_state, loss, aux, finite, scale)

    return step
