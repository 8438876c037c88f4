"""Reading a loss-scaling optimizer state: the loss scale, telemetry, masters, health.

Works on any pytree holding a [`jaxmp.LossScalingState`][jaxmp.LossScalingState] (``optax.chain`` and
``MultiSteps`` states, train states).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._typing import PyTree

from jaxmp import _tree
from jaxmp._dtypes import is_inexact_array
from jaxmp._scaling._loss_scale import LOSS_SCALE_TYPES, DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale
from jaxmp._scaling._transform import (NON_FINITE_GRADIENTS, NON_FINITE_LOSS, NON_FINITE_UPDATES, LossScalingState,
                             MasterWeightsState, apply_to_params)


class TrainingDivergedError(FloatingPointError):
    """Raised by [`check_health`][jaxmp.check_health] when too many steps in a row were skipped."""


def find_loss_scaling_state(tree: PyTree) -> LossScalingState:
    """Finds the single [`LossScalingState`][jaxmp.LossScalingState] inside an optimizer state (or train state).

    Args:
      tree: an optax state, possibly nested (``optax.chain``, ``MultiSteps``), or any
        pytree holding one (e.g. a train state).

    Returns:
      The [`LossScalingState`][jaxmp.LossScalingState].

    Raises:
      ValueError: none or several are found.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> state = jaxmp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> jaxmp._scaling._opt_state.find_loss_scaling_state((state,)) is state
      True
    """
    if isinstance(tree, LossScalingState):
        return tree
    found = _tree.find_states(tree, LossScalingState)
    if not found:
        raise ValueError("no jaxmp.loss_scaling state found: build the optimizer with jaxmp.loss_scaling(...)")
    if len(found) > 1:
        raise ValueError(f"found {len(found)} jaxmp.loss_scaling states; pass the one you mean")
    return found[0]


def get_loss_scale(source: LossScale | PyTree) -> LossScale:
    """Returns the current loss-scale object from an optimizer state, or ``source`` if it is one.

    Args:
      source: a loss-scale object, a [`LossScalingState`][jaxmp.LossScalingState], or a pytree holding one.

    Returns:
      The loss-scale pytree.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> state = jaxmp.loss_scaling(optax.sgd(0.1), "static:8").init({"w": jnp.ones(2)})
      >>> float(jaxmp.get_loss_scale(state).loss_scale)
      8.0
    """
    if isinstance(source, LOSS_SCALE_TYPES):
        return source
    return find_loss_scaling_state(source).loss_scale


def scaling_stats(opt_state: optax.OptState) -> dict[str, jax.Array]:
    """Loss-scaling telemetry for logging; works inside ``jit``.

    Args:
      opt_state: an optimizer state holding a [`LossScalingState`][jaxmp.LossScalingState].

    Returns:
      ``{"loss_scale": f32, "last_step_finite": bool, "consecutive_skips": i32, "total_skips": i32}``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> state = jaxmp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
      >>> int(jaxmp.scaling_stats(state)["total_skips"])
      0
    """
    s = find_loss_scaling_state(opt_state)
    return {
        "loss_scale": jnp.asarray(s.loss_scale.loss_scale, jnp.float32),
        "last_step_finite": s.last_step_finite,
        "consecutive_skips": s.consecutive_skips,
        "total_skips": s.total_skips,
    }


def master_params(opt_state: optax.OptState) -> optax.Params:
    """The float32 master copy kept by `jaxmp._scaling._transform.master_weights` (``loss_scaling(..., master_weights=True)``).

    Args:
      opt_state: an optimizer state holding a [`LossScalingState`][jaxmp.LossScalingState].

    Returns:
      The master params pytree.

    Raises:
      ValueError: the transform keeps no master copy.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), master_weights=True)
      >>> jaxmp.master_params(tx.init({"w": jnp.ones(2, jnp.float16)}))["w"].dtype
      dtype('float32')
    """
    found = _tree.find_states(opt_state, MasterWeightsState)
    if not found:
        raise ValueError("this optimizer keeps no master weights: build it with jaxmp.loss_scaling(..., master_weights=True)")
    return found[0].master_params


def apply_updates(params: optax.Params, updates: optax.Updates,
                  opt_state: optax.OptState | None = None) -> optax.Params:
    """Applies updates; with master weights, returns the master cast to each param's dtype exactly.

    Without a master copy in ``opt_state`` this is ``optax.apply_updates``, but non-floating leaves
    (``float0`` updates) pass through.

    Args:
      params: the current params.
      updates: the updates from ``tx.update``.
      opt_state: the new optimizer state returned by the same ``tx.update`` (optional).

    Returns:
      The new params, each leaf in its previous dtype.

    Raises:
      ValueError: an optax chain runs transforms after the one keeping master weights.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), "none", master_weights=True)
      >>> params = {"w": jnp.ones(2, jnp.float16)}
      >>> updates, state = tx.update({"w": jnp.ones(2, jnp.float16)}, tx.init(params), params)
      >>> jaxmp.apply_updates(params, updates, state)["w"]
      Array([0.9, 0.9], dtype=float16)
    """
    return apply_to_params(params, updates, opt_state)


_REASONS = {
    NON_FINITE_LOSS: ("the loss itself was inf/NaN",
                      "Check the input batch for NaN/inf and compute the loss in float32 (policy.cast_to_output)."),
    NON_FINITE_GRADIENTS: ("non-finite gradients",
                           "Check the input batch and the loss for NaN/inf (compute the loss in float32), lower the "
                           "learning rate, keep normalisation and softmax in float32, or train in bfloat16 instead "
                           "of float16."),
    NON_FINITE_UPDATES: ("finite gradients but non-finite updates (the optimizer's own arithmetic overflowed)",
                         "Keep the optimizer in float32: use master_weights=True (O2) instead of pure half "
                         "params, raise Adam's eps above float16's smallest normal (~6e-5), or check the learning "
                         "rate and other hyperparameters for NaN/inf."),
}


def first_non_finite(tree: PyTree) -> str | None:
    """The path of the first floating or complex leaf of ``tree`` holding inf or NaN (host-side).

    Args:
      tree: gradients, updates or params.

    Returns:
      The leaf's path (``jax.tree_util.keystr``), or None if every leaf is finite.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> tree = {"a": jnp.ones(2), "b": jnp.array([jnp.nan])}
      >>> jaxmp._scaling._opt_state.first_non_finite(tree)
      "['b']"
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if is_inexact_array(leaf) and not bool(np.all(np.isfinite(np.asarray(jax.device_get(leaf))))):
            return jax.tree_util.keystr(path)
    return None


#: How far below the largest loss scale at which a located step is finite a suggested scale
#: sits: gradients grow as training goes on (8x, three powers of two of headroom).
SCALE_HEADROOM = 8.0


def scale_literal(x: float) -> str:
    """``x`` as code: ``4096`` for an integer value, else its repr (``0.125``)."""
    x = float(x)
    return str(int(x)) if x >= 1 and x == int(x) else repr(x)


def scale_overflow_fix(scale: float, fits: float, dtype: str, current: LossScale | None = None) -> str:
    """The fix when the loss scale itself overflows a gradient: a scale that fits, as pasteable code.

    Args:
      scale: the loss scale the overflowing step ran at.
      fits: the largest power of two at which the same step is finite (> 0).
      dtype: the dtype it overflowed (``"float16"``).
      current: the run's loss-scale object, when known: a dynamic one is told where to start.

    Returns:
      One sentence, ``tx`` standing for the optimizer ``jaxmp.loss_scaling`` wraps.

    Example:
      >>> import jaxmp
      >>> jaxmp._scaling._opt_state.scale_overflow_fix(1e9, 65536.0, "float16")[:58]
      'the loss scale 1e+09 overflows float16 in this gradient (t'
    """
    suggested = max(fits / SCALE_HEADROOM, 2.0 ** -10)
    cause = (f"the loss scale {scale:g} overflows {dtype} in this gradient (the same step is finite unscaled "
             f"and at every scale up to {scale_literal(fits)})")
    if isinstance(current, DynamicLossScale):
        suggested = min(max(suggested, current.min_loss_scale), fits)  # a start its floor accepts
        return (f"{cause}: a dynamic scale backs off by itself (x{current.backoff_factor:g} per skipped step), but "
                f"this one started above what fits; start it lower, jaxmp.loss_scaling(tx, "
                f"jaxmp.DynamicLossScale({float(suggested)!r})) ({SCALE_HEADROOM:g}x below the largest scale that "
                "fits this step)")
    return (f"{cause}: pass jaxmp.loss_scaling(tx, \"dynamic\") (it backs off by itself) or "
            f"jaxmp.loss_scaling(tx, \"static:{scale_literal(suggested)}\") ({SCALE_HEADROOM:g}x below the largest scale that fits "
            "this step)")


def _scale_hint(found: Any, current: LossScale, scale: float, reason: int) -> tuple[str, bool]:
    """What the located culprit says about the loss scale as the cause (a sentence, or ""), and
    whether the scale is the cause (then the usual fixes cannot help)."""
    if reason != NON_FINITE_GRADIENTS or found is None:
        return "", False
    fits, seeded = getattr(found, "fits_scale", None), getattr(found, "loss_scale", None)
    advice = found.scale_advice(current) if fits and callable(getattr(found, "scale_advice", None)) else ""
    if advice:
        return f" {advice[:1].upper()}{advice[1:]}, tx being the optimizer you wrap.", True
    if fits == 0.0:
        return " The located gradient overflows unscaled too, so lowering the loss scale cannot help.", False
    if getattr(found, "found", True) is False and seeded is not None and seeded < scale:
        return (f" The locator ran the backward pass at a loss scale of {seeded:g}, where this step is finite, but "
                f"the run's scale is {scale:g}: pass loss_scale=jaxmp.get_loss_scale(opt_state).loss_scale to "
                "locate_non_finite to name the op the scale overflows.", False)
    return "", False


def check_health(opt_state: optax.OptState, max_consecutive_skips: int = 50, *, tree: PyTree = None,
                 locate: Callable[[], Any] | None = None) -> None:
    """Host-side check that raises when training keeps skipping steps, saying why.

    Names the cause the state recorded (non-finite loss, gradients or updates) and the usual fix.
    With ``locate``, the culprit op; when that op overflowed only because of the loss scale (the
    locator finds the same step finite unscaled), the loss scale is named as the cause and a
    scale that fits is given as code. Call it every few steps outside ``jit`` (it syncs);
    replicated states are checked on every replica.

    Args:
      opt_state: an optimizer state holding a [`jaxmp.LossScalingState`][jaxmp.LossScalingState].
      max_consecutive_skips: how many skipped steps in a row are tolerated (>= 1).
      tree: optionally the last step's gradients (or updates): the message names the first inf/NaN leaf.
      locate: optionally a function of no arguments that finds the culprit op, called only when the
        check fires, e.g. ``lambda: jaxmp.diagnostics.locate_non_finite(loss_fn, params, batch,
        loss_scale=jaxmp.get_loss_scale(opt_state).loss_scale)``.

    Raises:
      TrainingDivergedError: more than ``max_consecutive_skips`` consecutive skips.
      ValueError: ``max_consecutive_skips`` < 1.
      TypeError: ``locate`` is not callable.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), "static:1")
      >>> state = tx.init({"w": jnp.ones(2)})
      >>> for _ in range(2):  # two overflowed steps in a row
      ...     _, state = tx.update({"w": jnp.full(2, jnp.inf)}, state, {"w": jnp.ones(2)})
      >>> jaxmp.check_health(state, max_consecutive_skips=1)
      Traceback (most recent call last):
      ...
      jaxmp._scaling._opt_state.TrainingDivergedError: 2 consecutive steps were skipped for
      non-finite gradients ...
    """
    if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, (int, np.integer)) or max_consecutive_skips < 1:
        raise ValueError(f"max_consecutive_skips must be an int >= 1, got {max_consecutive_skips!r}")
    s = find_loss_scaling_state(opt_state)
    consecutive = int(np.max(np.asarray(jax.device_get(s.consecutive_skips))))
    if consecutive <= max_consecutive_skips:
        return
    if locate is not None and not callable(locate):
        raise TypeError(f"check_health(locate=...) expects a function of no arguments, got {type(locate).__name__}")
    total = int(np.max(np.asarray(jax.device_get(s.total_skips))))
    reason = int(np.max(np.asarray(jax.device_get(s.skip_reason))))
    what, fix = _REASONS.get(reason, _REASONS[NON_FINITE_GRADIENTS])
    scale = float(np.min(np.asarray(jax.device_get(s.loss_scale.loss_scale))))
    floor = getattr(s.loss_scale, "min_loss_scale", None)
    if isinstance(s.loss_scale, NoOpLossScale):
        hint = "No loss scaling is in use, so scaling is not the cause."
    elif isinstance(s.loss_scale, DynamicLossScale) and floor is not None and scale <= floor:
        hint = f"The loss scale has backed off to its floor ({scale:g}), so scaling is not the cause."
    else:
        hint = f"The loss scale is now {scale:g}."
    leaf = first_non_finite(tree) if tree is not None else None
    where = f" The first non-finite leaf is {leaf}." if leaf is not None else ""
    culprit, found = "", None
    if locate is not None:
        try:
            found = locate()
            line = found.summary() if hasattr(found, "summary") else str(found)
            culprit = f" Culprit: {line}."
        except Exception as e:  # noqa: BLE001 - the diagnosis must not hide the divergence it explains
            culprit = f" (locating the culprit failed: {type(e).__name__}: {e})"
    cause, by_scale = _scale_hint(found, s.loss_scale, scale, reason)
    if by_scale:
        fix = ""  # the learning rate, data or norms cannot help a gradient the scale overflows
    elif (not cause and locate is None and reason == NON_FINITE_GRADIENTS and isinstance(s.loss_scale, StaticLossScale)
          and scale > 1):
        cause = (f" A static loss scale multiplies every gradient before the finite check: if they are finite "
                 f"unscaled, the scale {scale:g} is the cause (check_health(..., locate=...) with "
                 "jaxmp.diagnostics.locate_non_finite tells; jaxmp.loss_scaling(tx, \"dynamic\") backs off by itself).")
    raise TrainingDivergedError(
        f"{consecutive} consecutive steps were skipped for {what} ({total} skipped in total); "
        f"params and optimizer state were left unchanged each time. {hint}{where}{culprit}{cause}"
        f"{' ' + fix if fix else ''} See docs/debugging.md."
    )
