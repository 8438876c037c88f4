"""Misuse that would train silently wrong: detected while tracing and reported once.

Each check runs in Python at trace time (or in ``init``), so it costs nothing per step. The
list of traps and why each matters: see docs/reliability.md#traps-misuse-that-would-train-silently-wrong.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import warnings
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _effects, _jaxpr, _ops


class MixedPrecisionWarning(UserWarning):
    """A mixed-precision set-up that runs but probably does not do what was meant."""


#: True while `jaxmp.value_and_grad` differentiates (its loss is multiplied by a loss
#: scale): float16 autocast regions differentiated then are not warned about (``unscaled_fp16_grad``).
_LOSS_SCALED_GRAD: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxmp_loss_scaled_grad", default=False)


#: How many times a loss-scale object multiplied something (``LossScale.scale``) in this context:
#: a float16 region whose backward pass sees the count grew since its forward pass was scaled.
_SCALES: contextvars.ContextVar[int] = contextvars.ContextVar("jaxmp_loss_scales_applied", default=0)


def scales_so_far() -> int:
    """How many times a loss scale's ``scale`` has run in this context (a thread or task).

    Returns:
      The count; only differences between two readings mean anything.
    """
    return _SCALES.get()


def in_loss_scaled_grad() -> bool:
    """Whether `jaxmp.value_and_grad` (a loss-scaled differentiation) is running in this context.

    Returns:
      True inside `loss_scaled_grad`.
    """
    return _LOSS_SCALED_GRAD.get()


@contextlib.contextmanager
def loss_scaled_grad() -> Iterator[None]:
    """While active, differentiation is of a loss-scaled loss (set by `jaxmp.value_and_grad`).

    Yields:
      Nothing.
    """
    token = _LOSS_SCALED_GRAD.set(True)
    try:
        yield
    finally:
        _LOSS_SCALED_GRAD.reset(token)


def unscaled_fp16_grad(where: str) -> bool:
    """Warns that a float16 region is differentiated with no loss scale, unless
    `loss_scaled_grad` is active (called by the engine's differentiation hook).

    Args:
      where: the region, for the message (e.g. ``"loss under 'O1-fp16'"``).

    Returns:
      Whether it warned.
    """
    if _LOSS_SCALED_GRAD.get():
        return False
    warnings.warn(
        f"{where} computes in float16 and is being differentiated with no loss scale: gradients below "
        "float16's smallest subnormal (6e-8) flush to zero, often all of them. Differentiate with "
        "jaxmp.value_and_grad(loss_fn, opt_state) and an optimizer from jaxmp.loss_scaling(tx, \"dynamic\") "
        "(or compute in bfloat16, which needs no loss scale).",
        MixedPrecisionWarning, stacklevel=2)
    return True


class ScaledMark:
    """Whether a loss-scale object has multiplied a loss: a static field of the loss scales.

    ``LossScale.scale`` sets it, ``update`` reads it, ``adjust`` returns the next scale unmarked.
    Every mark compares and hashes equal, so it never changes a tree structure or a ``jit`` cache
    key. See docs/reliability.md#gradients-that-were-never-scaled-how-they-are-detected.
    """

    __slots__ = ("scaled",)

    def __init__(self, scaled: bool):
        object.__setattr__(self, "scaled", bool(scaled))

    def __setattr__(self, name, value):
        raise AttributeError("ScaledMark is immutable")

    def __eq__(self, other):
        return isinstance(other, ScaledMark)

    def __hash__(self):
        return hash(ScaledMark)

    def __reduce__(self):
        return ScaledMark, (self.scaled,)

    def __repr__(self):
        return f"ScaledMark({self.scaled})"


UNSCALED, SCALED = ScaledMark(False), ScaledMark(True)


def note_scaled(loss_scale: Any) -> None:
    """Marks ``loss_scale`` (a loss-scale object) as having multiplied a loss (``LossScale.scale``)."""
    _SCALES.set(_SCALES.get() + 1)
    if hasattr(loss_scale, "scaled_mark"):
        _effects.set_mark(loss_scale, "scaled_mark", SCALED)
        # A pure copy of a state kept in mutable variables (jaxmp.flax.nnx.optimizer_state) links to
        # the stored loss scale, which the optimizer's own update rebuilds its state from.
        stored = getattr(loss_scale, "_jaxmp_stored", None)
        if stored is not None and hasattr(stored, "scaled_mark"):
            _effects.set_mark(stored, "scaled_mark", SCALED)


def was_scaled(loss_scale: Any) -> bool:
    """Whether ``loss_scale`` (this object, or the object it was rebuilt from) has multiplied a loss."""
    mark = getattr(loss_scale, "scaled_mark", None)
    return isinstance(mark, ScaledMark) and mark.scaled


def _warn(message: str) -> None:
    warnings.warn(message, MixedPrecisionWarning, stacklevel=4)


def check_gradients(grads: Any, loss_scale: Any, *, dynamic: bool) -> None:
    """Trace-time checks of the gradients given to ``unscale_and_skip.update``.

    ``dynamic``: ``loss_scale`` is a ``DynamicLossScale``, the one whose mark says whether it
    multiplied the loss these gradients came from (the caller knows its type; this floor of
    jaxmp imports no loss scale)."""
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        dtype = jnp.asarray(g).dtype if not isinstance(g, np.ndarray) else g.dtype
        if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
            raise TypeError(
                f"gradient leaf at {jax.tree_util.keystr(path)} has dtype {dtype}: integer and boolean leaves have no "
                "gradient. Differentiate with allow_int=True (their gradients are float0) or leave them out of the params."
            )
    if not dynamic or was_scaled(loss_scale):
        return
    _warn("loss_scaling got gradients, but the dynamic loss scale in this optimizer state never multiplied a "
          "loss: were they computed with jax.grad? Compute them with jaxmp.value_and_grad(loss_fn, opt_state) "
          "and pass the same opt_state to tx.update (or scale by hand with jaxmp.get_loss_scale(opt_state)"
          ".scale(loss)); otherwise they are divided by a scale they never carried. If value_and_grad and "
          "update run in separate jitted functions, scale the loss with the state you pass to the update. "
          "Use loss_scale='none' if you do not want loss scaling.")


def check_loss_dtype(loss: Any, *, scaled: bool) -> None:
    """Warns when a float16 loss is about to be scaled: its gradient overflows float16 at any scale >= 2**16.

    ``scaled``: the loss scale multiplies the loss (any but a ``NoOpLossScale``)."""
    if not scaled or getattr(loss, "dtype", None) != jnp.float16:
        return
    _warn("the loss is float16: the gradient flowing back from it is float16 too, so it overflows (inf) at any "
          "loss scale >= 2**16 and every step is skipped. Compute the loss in float32: cast the logits or the loss "
          "to float32 before the reduction (policy.cast_to_output(logits), or loss.astype(jnp.float32)), or use "
          "an O1/O2 preset, which keep the loss in float32.")


def check_outermost(scale_source: Any, scaling_state: type) -> None:
    """Warns when an optax chain runs transforms *before* ``loss_scaling`` (they see scaled gradients)."""
    if not isinstance(scale_source, tuple) or isinstance(scale_source, scaling_state):
        return
    for i, part in enumerate(scale_source):
        if isinstance(part, scaling_state):
            # optax.chain's state is the tuple of its transforms' states, in order.
            if i and all(type(p).__module__.split(".")[0] == "optax" for p in scale_source[:i]):
                _warn(f"the optimizer state is an optax chain with {i} transform(s) before jaxmp.loss_scaling: "
                      "they see the *scaled* gradients (clipping or weight decay on scaled values is wrong). Make "
                      "jaxmp.loss_scaling the outermost transform: loss_scaling(optax.chain(...)).")
            return


def check_init(params: Any, inner_state: Any, scaling_state: type, master_state: type, *, scaled: bool) -> None:
    """Checks at ``init``: nested loss scaling (raise), float16 params without a master copy (warn).

    ``scaled``: the loss scale multiplies the loss (any but a ``NoOpLossScale``; without one,
    float16 params are pure float16 on purpose)."""
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
    if fp16 and not has_master and scaled:
        _warn(_no_master_message(fp16, "float16"))


def _no_master_message(paths: list, dtype: str) -> str:
    return (f"{len(paths)} {dtype} param(s) (first: {paths[0]}) are updated without a float32 master copy: updates "
            f"smaller than {dtype}'s resolution round away and the params stop moving. Pass master_weights=True "
            "(the O2 recipe does) or keep the params in float32.")


class KeepsHalfParamsExact(abc.ABC):
    """The optimizer states whose half-precision params learn without a float32 master copy.

    `check_bf16_without_master` accepts a state of such a class as it accepts a master copy
    (jaxmp.lean's stochastic-rounding and remainder states). A state class declares it with
    ``@KeepsHalfParamsExact.register`` (a NamedTuple takes no other base class).
    """


def check_bf16_without_master(params: Any, inner_state: Any, master_state: type) -> None:
    """Warns at ``init`` when bfloat16 params get no master copy and no stochastic rounding (O2-bf16
    without master weights), as float16 params do; a bfloat16 recipe has no loss scale to tell O2
    from O3, so the caller runs this only when ``master_weights`` was not given."""
    keepers = (master_state, KeepsHalfParamsExact)
    kept = [x for x in jax.tree_util.tree_leaves(inner_state, is_leaf=lambda x: isinstance(x, keepers))
            if isinstance(x, keepers)]
    bf16 = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(params)
            if hasattr(x, "dtype") and x.dtype == jnp.bfloat16]
    if bf16 and not kept:
        _warn(_no_master_message(bf16, "bfloat16") + " For pure bfloat16 on purpose (O3), pass master_weights=False; "
              "for bfloat16 params without a master copy that still learn, see jaxmp.lean (stochastic rounding).")


#: Where a value stops flowing into the updates as a number: chosen between, compared, bounded.
_GUARDS = _ops.having("guard")  # selects and comparisons: the op catalogue's


def _reaches_output_unguarded(jaxpr: Any, var: Any, consumers: dict) -> bool:
    """Whether ``var`` flows into an output of ``jaxpr`` through arithmetic alone (no select/max/min).

    ``clip_by_global_norm(inf)`` multiplies by inf in the branch that ``select_n`` never takes,
    ``clip_by_block_rms(inf)`` divides by inf under a ``max``: those are legitimate. Through a
    call or a loop (sub-jaxprs) the flow is not followed: it counts as reaching the output.
    """
    outs = {id(v) for v in jaxpr.outvars if not hasattr(v, "val")}
    seen, stack = set(), [var]
    while stack:
        v = stack.pop()
        if id(v) in outs:
            return True
        for eqn in consumers.get(id(v), ()):
            if eqn.primitive.name in _GUARDS or _only_guards(eqn):
                continue
            if _jaxpr.sub_jaxprs(eqn):  # a call or loop: not followed
                return True
            for o in eqn.outvars:
                if id(o) not in seen:
                    seen.add(id(o))
                    stack.append(o)
    return False


def _only_guards(eqn: Any) -> bool:
    """A nested call made of guards alone: ``jnp.where`` is a ``jit`` of one ``select_n``."""
    subs = _jaxpr.sub_jaxprs(eqn, opened=True)
    return len(subs) == 1 and bool(_jaxpr.equations(subs[0])) and all(
        e.primitive.name in _GUARDS for e in _jaxpr.equations(subs[0]))


def _non_finite_literals(jaxpr: Any) -> list:
    """Harmful non-finite scalar constants in a jaxpr and its sub-jaxprs.

    NaN in a product or quotient always is; inf only where the product reaches the updates as a
    number (an inf learning rate, a hyperparameter cast to float16 past its range), not where a
    select, max or min takes it out (an infinite clipping threshold meaning "no clipping").
    """
    found = []
    consumers: dict = {}
    for eqn in _jaxpr.equations(jaxpr):
        for v in eqn.invars:
            if not hasattr(v, "val"):
                consumers.setdefault(id(v), []).append(eqn)
    for eqn in _jaxpr.equations(jaxpr):
        for v in (eqn.invars if eqn.primitive.name in ("mul", "div") else ()):
            val = getattr(v, "val", None)
            if val is not None and np.ndim(val) == 0 and np.issubdtype(np.asarray(val).dtype, np.inexact) \
                    and not np.isfinite(val):
                if np.isnan(val) or _reaches_output_unguarded(jaxpr, eqn.outvars[0], consumers):
                    found.append((eqn.primitive.name, float(np.real(val))))
        for sub in _jaxpr.sub_jaxprs(eqn, opened=True):
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
        if not (jnp.issubdtype(leaf.dtype, jnp.inexact) and leaf.size == 1):
            continue
        value = np.asarray(leaf)
        # inf is a legitimate initial value outside the hyperparameters (reduce_on_plateau's
        # best_value, the line searches' value); NaN never is.
        in_hyperparams = any(getattr(k, "key", getattr(k, "name", None)) == "hyperparams" for k in path)
        if np.isnan(value).any() or (in_hyperparams and not np.isfinite(value).all()):
            raise ValueError(
                f"the optimizer's initial state holds inf/NaN at {jax.tree_util.keystr(path)}: usually a NaN or inf "
                "hyperparameter (learning rate, weight decay) given to optax.inject_hyperparams. Fix it before training."
            )
