"""Checks of an optimizer state against the transform it meets, before or around a step.

The state made by another transform, for other params, with a master copy the transform does
not keep (or the reverse), an optax chain with transforms after the master copy, an inner chain
that changes its state's types on update: each raised as a ValueError that names the leaf and the
fix. Used by `jaxmp._scaling._transform`; they read structure and shapes only (``jax.eval_shape``).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxmp import _tree


def check_nothing_after_master(state: Any, master_state: type) -> None:
    """Raises when an optax chain runs transforms after the one keeping the master copy (state structure only).

    ``master_state``: the master copy's state class (`jaxmp._scaling._transform.MasterWeightsState`).
    """
    if isinstance(state, dict):  # optax.named_chain: its parts in chain order
        parts = list(state.values())
    elif isinstance(state, tuple) and not hasattr(state, "_fields"):
        parts = list(state)
    else:
        return  # not a chain's state (NamedTuples are single transforms' states)
    for i, part in enumerate(parts):
        if _tree.find_states(part, master_state):
            if i + 1 < len(parts):
                raise ValueError(
                    f"the optimizer is an optax chain with {len(parts) - i - 1} transform(s) after the one keeping "
                    "float32 master weights: the params become the master's cast, so their effect on the updates "
                    "would be dropped. Put them inside: jaxmp.loss_scaling(optax.chain(..., transform), "
                    "master_weights=True).")
            check_nothing_after_master(part, master_state)
            return


def check_state_matches(inner, state_inner, ref) -> None:
    """Raises a ValueError naming the first leaf where the inner state differs from ``inner.init(ref)``.

    Structure and shapes only (``jax.eval_shape``); called only once the inner update has failed or
    changed its state's shapes, so that a traced update pays no extra ``init``.
    """
    try:
        expected = jax.eval_shape(inner.init, ref)
    except Exception:  # noqa: BLE001 - an init that cannot be traced abstractly: nothing to compare
        return
    te, ts = jax.tree_util.tree_structure(expected), jax.tree_util.tree_structure(state_inner)
    if te != ts:
        raise ValueError(
            "the optimizer state does not belong to this optimizer and these params (was it made by another "
            f"transform's init?):\n  state: {ts}\n  this optimizer's init gives: {te}")
    for (path, e), x in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree_util.tree_leaves(state_inner)):
        if tuple(e.shape) != tuple(jnp.shape(x)):
            raise ValueError(
                f"optimizer state leaf inner_state{jax.tree_util.keystr(path)} has shape {tuple(jnp.shape(x))}, but "
                f"this optimizer's init for these params gives {tuple(e.shape)}: the state was made for other params")


def check_master_matches(inner: Any, state_keeps_master: bool, ref: Any, built_with: bool, master_state: type) -> None:
    """Raises when a state with a master copy meets a transform without one (or the reverse), before the step.

    ``built_with``: the transform was built by `jaxmp._scaling._transform.master_weights`; ``master_state``:
    the master copy's state class (`jaxmp._scaling._transform.MasterWeightsState`).
    """
    if not built_with and state_keeps_master:
        try:
            built_with = bool(_tree.find_states(jax.eval_shape(inner.init, ref), master_state))
        except Exception:  # noqa: BLE001 - an init that cannot be traced abstractly: let the step say it
            return
    if built_with != state_keeps_master:
        has, lacks = ("has a", "keeps none") if state_keeps_master else ("has no", "keeps float32 master weights")
        raise ValueError(
            f"the optimizer state {has} float32 master copy (MasterWeightsState) but this optimizer {lacks}: the "
            "state was made by a jaxmp.loss_scaling built with master_weights="
            f"{state_keeps_master} and this one with master_weights={built_with}. Make the state with this "
            "optimizer's own tx.init(params), or build both with the same master_weights.")


def check_state_types(old: Any, new: Any, check_origin: Callable[[], None]) -> None:
    """A skipped step returns the old inner state: the inner chain must keep its state's types.

    ``check_origin`` runs first on a mismatch, so a state made for other params is named as such.
    """
    old_leaves = jax.tree_util.tree_leaves_with_path(old)
    new_leaves = jax.tree_util.tree_leaves(new)
    if len(old_leaves) != len(new_leaves):
        return  # a structure change: lax.cond / select_tree name it
    for (path, a), b in zip(old_leaves, new_leaves):
        a_dtype, b_dtype = getattr(a, "dtype", None), getattr(b, "dtype", None)
        if a_dtype is None or b_dtype is None:
            continue
        # Compared as JAX dtypes: a PRNG key's (optax.noisy_sgd) is no numpy dtype.
        if a_dtype != b_dtype or tuple(jnp.shape(a)) != tuple(b.shape):
            check_origin()
            raise ValueError(
                f"the inner optimizer changes its state on update: {jax.tree_util.keystr(path)} is "
                f"{a_dtype}{list(jnp.shape(a))} after init and {b_dtype}{list(b.shape)} "
                "after update. A skipped step keeps the old state, so the two must match. This happens with "
                "bfloat16/float16 params and float32 hyperparameters (optax.inject_hyperparams promotes the moments): "
                "use loss_scaling(..., master_weights=True), whose inner state is float32.")
