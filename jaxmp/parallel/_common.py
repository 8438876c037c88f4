"""Helpers shared by the pmap and sharded-jit paths: logging, validation, the step body."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp.fp8.state import FP8_COLLECTION
from jaxmp.opt_state import scaling_stats
from jaxmp.step import make_step

logger = logging.getLogger("jaxmp.parallel")

# Messages already logged, so that a per-step helper (shard_batch inside a training loop) logs
# the per-device batch once per distinct shape instead of once per step.
_LOGGED: set = set()


def log_once(message: str, *args: Any) -> None:
    """Logs ``message % args`` at INFO level the first time this exact text is seen."""
    text = message % args if args else message
    if text not in _LOGGED:
        _LOGGED.add(text)
        logger.info(text)


def check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def batch_leaves(batch: Any, what: str = "batch") -> list:
    leaves = jax.tree_util.tree_leaves(batch)
    if not leaves:
        raise ValueError(f"the {what} has no array leaves")
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if jnp.ndim(leaf) < 1:
            raise ValueError(f"{what} leaf at {jax.tree_util.keystr(path)} is a scalar: every leaf needs a leading batch axis")
    return leaves


def leading_size(batch: Any, what: str = "batch") -> int:
    """The common leading (batch) dimension of every leaf, with a clear error if they differ."""
    sizes = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if jnp.ndim(leaf) < 1:
            raise ValueError(f"{what} leaf at {jax.tree_util.keystr(path)} is a scalar: every leaf needs a leading batch axis")
        sizes.setdefault(int(jnp.shape(leaf)[0]), jax.tree_util.keystr(path))
    if not sizes:
        raise ValueError(f"the {what} has no array leaves")
    if len(sizes) > 1:
        listing = ", ".join(f"{p or '<root>'}: {n}" for n, p in sizes.items())
        raise ValueError(f"{what} leaves have different leading (batch) sizes: {listing}")
    return next(iter(sizes))


def check_divisible(global_batch: int, num_devices: int, what: str = "global batch") -> int:
    """Per-device batch size, or a ValueError naming both numbers."""
    if num_devices < 1:
        raise ValueError(f"need at least one device, got {num_devices}")
    if global_batch % num_devices:
        lo = global_batch // num_devices * num_devices
        options = f"{lo} or {lo + num_devices}" if lo else f"{num_devices} (or a multiple of it)"
        raise ValueError(
            f"{what} size {global_batch} is not divisible by the device count {num_devices}: "
            f"every device must get an equal shard (the mean of per-device means equals the global mean "
            f"only then); use {options} instead"
        )
    return global_batch // num_devices


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


def make_step_body(loss_fn: Callable, tx: Any, *, has_aux: bool, reduce_grads: Callable, reduce_loss: Callable,
                   with_rng: bool, rng_transform: Callable | None = None, with_model_state: bool = False,
                   reduce_model_state: Callable | None = None, per_replica_aux: bool = False,
                   wrap_loss: Callable | None = None) -> Callable:
    """The per-step computation shared by the pmap and sharded-jit paths.

    ``reduce_grads`` is the gradient all-reduce (pmean under pmap, identity under sharded jit,
    where the global-view mean already is the all-reduce). It runs *before* ``tx.update``, so the
    finite check inside ``jaxmp.loss_scaling`` sees the reduced gradient: a NaN on one replica,
    or an overflow of a half-precision sum, is seen by every replica.

    With ``with_model_state`` the first argument is ``(params, model_state)``; ``loss_fn`` gets the
    model state after the params and returns ``(loss, new_model_state)`` (or ``(loss,
    (new_model_state, aux))``). The new model state (BatchNorm statistics) is averaged over the
    replicas by ``reduce_model_state``, so every replica keeps the same statistics, and kept only
    if the step was applied. With ``per_replica_aux`` (pmap), an ``aux`` dict holding
    ``batch_stats`` is refused: it would be kept per replica and drift apart.

    ``wrap_loss`` (the sharded-jit layouts, `jaxmp.parallel.layouts`) maps the canonical loss
    ``(params, model_state, batch, rng) -> (loss, (model_state, aux))`` to another of the same
    signature before the step builder differentiates it.
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
                     reduce_model_state=reduce_model_state if with_model_state else None, pass_value=pass_value)

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
        metrics = {"loss": out.loss, **scaling_stats(out.opt_state)}
        if has_aux:
            metrics["aux"] = out.aux
        if with_model_state:
            return (out.params, out.model_state), out.opt_state, metrics
        return out.params, out.opt_state, metrics

    return body


def check_not_donated(params: Any, opt_state: Any) -> None:
    """Raises a ValueError naming a params / optimizer-state leaf whose buffer was donated already.

    With ``donate=True`` the step's inputs are deleted by the call; passing the same state again
    (instead of the state the step returned) makes XLA:CPU's runtime crash the process with a
    segmentation fault, not raise. Reading ``jax.Array.is_deleted`` is a host-side flag per
    leaf: no device work, no synchronisation.
    """
    for what, tree in (("params", params), ("opt_state", opt_state)):
        # Plain leaves first (the common case, every step); the paths only to name a deleted one.
        if not any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree_util.tree_leaves(tree)):
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise ValueError(
                    f"{what} leaf at {jax.tree_util.keystr(path)} was donated to an earlier call of this step "
                    "(donate=True deletes the step's inputs): pass the params and opt_state the last call returned, "
                    "e.g. params, opt_state, metrics = step(params, opt_state, batch), or build the step with "
                    "donate=False to keep the inputs")


def with_model_state(run: Callable, model_state: bool) -> Callable:
    """The public step signature: ``(params, state, opt_state, batch, rng)`` when the model has
    state (BatchNorm statistics), else ``run``'s own ``(params, opt_state, batch, rng)``."""
    if not model_state:
        return run

    def step(params, state, opt_state, batch, rng=None):
        (params, state), opt_state, metrics = run((params, state), opt_state, batch, rng)
        return params, state, opt_state, metrics

    return step
