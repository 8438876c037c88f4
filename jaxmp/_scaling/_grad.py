"""``value_and_grad`` that scales the loss with the current loss scale."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxmp import _misuse as misuse
from jaxmp._typing import PyTree
from jaxmp._scaling._loss_scale import LossScale, NoOpLossScale
from jaxmp._scaling._opt_state import get_loss_scale
from jaxmp._scaling._transform import LossScalingState


def _check_loss(loss: Any) -> jax.Array:
    loss = jnp.asarray(loss) if not isinstance(loss, jax.Array) else loss
    if loss.shape != ():
        raise ValueError(f"the loss must be a scalar, got shape {loss.shape}: reduce it (e.g. .mean()) before returning")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"the loss must be floating point, got dtype {loss.dtype}")
    return loss


def value_and_grad(fun: Callable[..., Any], scale_source: LossScale | PyTree, argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, **kwargs) -> Callable[..., Any]:
    """Like ``jax.value_and_grad``, but differentiates ``loss * loss_scale``.

    Returns the true (unscaled) loss and scaled gradients, which [`jaxmp.loss_scaling`][jaxmp.loss_scaling]
    unscales. ``tx.update`` warns when given gradients of a plain ``jax.grad`` under a dynamic scale.

    Args:
      fun: returns a scalar floating loss (or ``(loss, aux)`` with ``has_aux``), best in float32.
      scale_source: the optimizer state of a ``jaxmp.loss_scaling`` transform (or any pytree
        holding it, e.g. a train state), or a loss-scale object.
      argnums: as in ``jax.value_and_grad``.
      has_aux: as in ``jax.value_and_grad``.
      **kwargs: forwarded to ``jax.value_and_grad`` (e.g. ``allow_int``).

    Returns:
      A function with ``fun``'s signature returning ``(loss, grads)`` or ``((loss, aux), grads)``.

    Raises:
      ValueError: no loss scale found in ``scale_source``, or a non-scalar loss.
      TypeError: a non-floating loss.

    Warns:
      MixedPrecisionWarning: a float16 loss (a large scale overflows it: cast it to float32).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> ls = jaxmp.StaticLossScale(4.0)
      >>> loss, g = jaxmp.value_and_grad(lambda w: jnp.sum(w ** 2), ls)(jnp.ones(2))
      >>> float(loss), g.tolist()
      (2.0, [8.0, 8.0])
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got {type(fun).__name__}")
    loss_scale = get_loss_scale(scale_source)
    misuse.check_outermost(scale_source, LossScalingState)

    def scaled(*args, **kw):
        out = fun(*args, **kw)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ValueError("with has_aux=True, fun must return a pair (loss, aux)")
            loss, aux = out
        else:
            loss, aux = out, None
        loss = _check_loss(loss)
        misuse.check_loss_dtype(loss, scaled=not isinstance(loss_scale, NoOpLossScale))
        return loss_scale.scale(loss), (loss, aux)

    grad_fn = jax.value_and_grad(scaled, argnums=argnums, has_aux=True, **kwargs)

    def wrapped(*args, **kw):
        with misuse.loss_scaled_grad():  # float16 autocast regions differentiated here are scaled
            (_, (loss, aux)), grads = grad_fn(*args, **kw)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return wrapped
