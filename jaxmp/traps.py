"""Misuse that would train silently wrong: detected while tracing and reported once.

Each check runs in Python at trace time (or in ``init``), so it costs nothing per step:

* gradients that were never multiplied by the loss scale, given to a scaling transform
  (``jax.grad`` instead of :func:`jaxmp.value_and_grad`): warn;
* float16 params with loss scaling but no master copy (O2-fp16 without master weights,
  where small updates round away): warn;
* ``loss_scaling`` nested in ``loss_scaling`` (gradients unscaled twice): raise;
* integer or boolean gradient leaves, which optax would treat as numbers: raise;
* an inner update that multiplies by a NaN/inf constant, or a fresh optimizer state holding
  a NaN/inf hyperparameter (a NaN learning rate, which float32 updates would otherwise carry
  into the params unchecked): raise.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxprs_in_params


class MixedPrecisionWarning(UserWarning):
    """A mixed-precision set-up that runs but probably does not do what was meant."""


# How many losses were multiplied by a jaxmp loss scale in this process. update() checks it
# while tracing: gradients handed to a scaling transform before any loss was ever scaled were
# never scaled. (Matching the exact scale object is not reliable: optax.MultiSteps and other
# wrappers pass the state through lax.cond, which gives the update fresh tracers.)
_SCALE_CALLS = [0]


def note_scaled(loss_scale_array: Any) -> None:
    """Records that a loss was multiplied by a loss scale (called by ``LossScale.scale``)."""
    _SCALE_CALLS[0] += 1


def _warn(message: str) -> None:
    warnings.warn(message, MixedPrecisionWarning, stacklevel=4)


def check_gradients(grads: Any, loss_scale: Any) -> None:
    """Trace-time checks of the gradients given to ``unscale_and_skip.update``."""
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        dtype = jnp.asarray(g).dtype if not isinstance(g, np.ndarray) else g.dtype
        if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
            raise TypeError(
                f"gradient leaf at {jax.tree_util.keystr(path)} has dtype {dtype}: integer and boolean leaves have no "
                "gradient. Differentiate with allow_int=True (their gradients are float0) or leave them out of the params."
            )
    scale = getattr(loss_scale, "loss_scale", None)
    if type(loss_scale).__name__ == "NoOpLossScale" or not isinstance(scale, jax.core.Tracer):
        # Checked while tracing only: an eager update may get gradients from a cached jitted step.
        return
    if _SCALE_CALLS[0] == 0:
        _warn("loss_scaling got gradients while no loss has been multiplied by a loss scale in this process. "
              "Compute them with jaxmp.value_and_grad(loss_fn, opt_state), or multiply the loss by "
              "jaxmp.get_loss_scale(opt_state).scale(loss) yourself; otherwise they are divided by a scale they "
              "never carried. Use loss_scale='none' if you do not want loss scaling.")


def check_init(params: Any, inner_state: Any, loss_scale: Any, scaling_state: type, master_state: type) -> None:
    """Checks at ``init``: nested loss scaling (raise), float16 params without a master copy (warn)."""
    nested = [x for x in jax.tree_util.tree_leaves(inner_state, is_leaf=lambda x: isinstance(x, scaling_state))
              if isinstance(x, scaling_state)]
    if nested:
        raise ValueError(
            "loss_scaling wraps another loss_scaling: the gradients would be unscaled twice and checked twice. "
            "Use a single jaxmp.loss_scaling as the outermost transform."
        )
    has_master = any(isinstance(x, master_state) for x in
                     jax.tree_util.tree_leaves(inner_state, is_leaf=lambda x: isinstance(x, master_state)))
    fp16 = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(params)
            if hasattr(x, "dtype") and x.dtype == jnp.float16]
    if fp16 and not has_master and type(loss_scale).__name__ != "NoOpLossScale":
        _warn(f"{len(fp16)} float16 param(s) (first: {fp16[0]}) are updated without a float32 master copy: updates "
              "smaller than float16's resolution round away and the params stop moving. Pass master_weights=True "
              "(the O2 recipe does) or keep the params in float32.")


def _non_finite_literals(jaxpr: Any) -> list:
    """Non-finite scalar constants (literals and concrete consts) in a jaxpr and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        # Only products and quotients: inf is a legitimate operand of max/min/select.
        for v in (eqn.invars if eqn.primitive.name in ("mul", "div") else ()):
            val = getattr(v, "val", None)
            if val is not None and np.ndim(val) == 0 and np.issubdtype(np.asarray(val).dtype, np.inexact) \
                    and not np.isfinite(val):
                found.append((eqn.primitive.name, float(np.real(val))))
        for sub in jaxprs_in_params(eqn.params):
            found += _non_finite_literals(sub)
    return found


def check_update_constants(closed_jaxpr: Any) -> None:
    """Raises when the inner optimizer's update multiplies by inf/NaN constants (a NaN learning rate).

    Traced once per compilation, so it costs nothing per step. Float32 updates are not checked
    at run time by default (that costs a pass over the updates), so this is what catches them.
    """
    found = _non_finite_literals(closed_jaxpr.jaxpr)
    if found:
        raise ValueError(
            f"the optimizer's update uses a non-finite constant ({found[0][1]} in a {found[0][0]}): usually a "
            "NaN or inf learning rate or other hyperparameter. Every update would be non-finite; fix the "
            "optimizer's hyperparameters."
        )


def check_inner_state(inner_state: Any) -> None:
    """Raises when a fresh optimizer state holds inf/NaN (an injected NaN learning rate); host-side, at init."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(inner_state):
        if isinstance(leaf, jax.core.Tracer) or not hasattr(leaf, "dtype"):
            continue
        # Scalars only: hyperparameters are scalars, and reading moment buffers back would be costly.
        if jnp.issubdtype(leaf.dtype, jnp.inexact) and leaf.size == 1 and not bool(np.isfinite(np.asarray(leaf)).all()):
            raise ValueError(
                f"the optimizer's initial state holds inf/NaN at {jax.tree_util.keystr(path)}: usually a NaN or inf "
                "hyperparameter (learning rate, weight decay) given to optax.inject_hyperparams. Fix it before training."
            )
