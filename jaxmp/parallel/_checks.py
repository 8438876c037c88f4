"""Helpers shared by the pmap and sharded-jit paths: logging and input validation.

The step body both paths run is `jaxmp._step.make_loss_fn_step`."""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

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


def leading_size(batch: Any, what: str = "batch") -> int:
    """The common leading (batch) dimension of every leaf, with a clear error if they differ."""
    sizes: dict[int, str] = {}  # leading size -> the first leaf's path with it
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


def _deleted(x: Any) -> bool:
    # A tracer (the step called inside the user's own jit) holds no buffer to delete.
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()


def check_not_donated(params: Any, opt_state: Any, by: str = "this step") -> None:
    """Raises a ValueError naming a params / optimizer-state leaf whose buffer was donated already.

    With ``donate=True`` the step's inputs are deleted by the call; passing the same state again
    (instead of the state the step returned) makes XLA:CPU's runtime crash the process with a
    segmentation fault, not raise; to another step or to ``shard_state`` it is JAX's "Array has
    been deleted". Reading ``jax.Array.is_deleted`` is a host-side flag per leaf: no device
    work, no synchronisation. ``by``: what deleted it, as the message says (``"this step"``
    for a donating step itself).
    """
    for what, tree in (("params", params), ("opt_state", opt_state)):
        # Plain leaves first (the common case, every step); the paths only to name a deleted one.
        if not any(_deleted(x) for x in jax.tree_util.tree_leaves(tree)):
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if _deleted(leaf):
                raise ValueError(
                    f"{what} leaf at {jax.tree_util.keystr(path)} was donated to an earlier call of {by} "
                    "(donate=True deletes the step's inputs): pass the params and opt_state the last call returned, "
                    "e.g. params, opt_state, metrics = step(params, opt_state, batch), or build the step with "
                    "donate=False to keep the inputs")


def abstract_leaf_error(what: str, where: str) -> TypeError:
    """What a step says when handed a ``jax.ShapeDtypeStruct`` (e.g. ``abstract_state``'s output) as state."""
    return TypeError(
        f"{what} leaf at {where} is a jax.ShapeDtypeStruct, a shape and dtype with no values: "
        "jaxmp.parallel.abstract_state(...) gives a checkpoint restore target (or what step.lower compiles), not a "
        "state to train. Restore into it first and pass what the restore returns, restored = ckptr.restore(path, "
        "{'params': target_p, 'opt_state': target_s}) (docs/guides/checkpointing.md), or lay out real arrays: "
        "params, opt_state = jaxmp.parallel.shard_state((params, tx.init(params)), step.layout)")


def check_concrete(tree: Any, what: str) -> None:
    """Raises `abstract_leaf_error` for the first ``jax.ShapeDtypeStruct`` leaf of ``tree``."""
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(tree)):
        return
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise abstract_leaf_error(what, jax.tree_util.keystr(path) or "<root>")


def _spec_text(spec: Any) -> str:
    return f"{spec['dtype']}{list(spec['shape'])}"


def _first(items: list, n: int = 3) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def target_mismatch_error(saved: Any, target: Any, where: str = "the checkpoint") -> ValueError | None:
    """What a restore says when its target is not the saved state's structure, or None when it is.

    Orbax's own message for this lists tree diffs; this one names the arrays that differ and the
    target to build. For a checkpoint restore helper to raise in place of orbax's.

    Args:
      saved: per saved array, a mapping with ``path`` (``keystr``), ``shape`` and ``dtype``, and
        optionally ``key`` (a spelling shared by a state and orbax's target-free dicts; matched
        on when present).
      target: the same for the restore target's leaves.
      where: the checkpoint, for the message (its path).

    Returns:
      A ValueError to raise, or None when every array matches by name, shape and dtype.
    """
    def by_name(specs):
        return {spec.get("key", spec["path"]): spec for spec in specs}

    s, t = by_name(saved), by_name(target)
    missing = [s[k]["path"] for k in s if k not in t]
    extra = [t[k]["path"] for k in t if k not in s]
    differ = [f"{s[k]['path']} saved {_spec_text(s[k])}, the target's {_spec_text(t[k])}" for k in s
              if k in t and (list(s[k]["shape"]), str(s[k]["dtype"])) != (list(t[k]["shape"]), str(t[k]["dtype"]))]
    if not (missing or extra or differ):
        return None
    parts = ([_first(differ)] if differ else []) + (
        [f"{len(missing)} saved arrays the target lacks ({_first(missing)})"] if missing else []) + (
        [f"{len(extra)} target arrays {where} lacks ({_first(extra)})"] if extra else [])
    return ValueError(
        f"the restore target does not match {where}: {'; '.join(parts)}. Build the target from the state that was "
        "saved, the same params, optimizer and options (master_weights, a lean recipe): target_p, target_s = "
        "jaxmp.parallel.abstract_state((params, tx.init(params)), mesh, layout), restored into "
        "{'params': target_p, 'opt_state': target_s}; or restore with no target to read the saved structure")


def step_form(model_state: bool) -> str:
    """How a parallel step is called, for messages."""
    return ("step(params, model_state, opt_state, batch[, rng])" if model_state
            else "step(params, opt_state, batch[, rng])")


def with_model_state(run: Callable, model_state: bool) -> Callable:
    """The public step signature: ``(params, state, opt_state, batch, rng)`` when the model has
    state (BatchNorm statistics), else ``run``'s own ``(params, opt_state, batch, rng)``."""
    if not model_state:
        return run

    def step(params, state, opt_state, batch, rng=None):
        (params, state), opt_state, metrics = run((params, state), opt_state, batch, rng)
        return params, state, opt_state, metrics

    return step
