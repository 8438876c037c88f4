"""Memory-lean optimizer recipes: bfloat16 moments and params with stochastic rounding, param remainders, 8-bit and 4-bit moments.

Each is an optax transformation to wrap in [`jaxmp.loss_scaling`][jaxmp.loss_scaling]:
[`bf16_moments`][jaxmp.lean.bf16_moments] (bfloat16 moments), [`quantized_moments`][jaxmp.lean.quantized_moments]
(8-bit or 4-bit blockwise moments), [`bf16_params`][jaxmp.lean.bf16_params]
(bfloat16 params, no master), [`param_remainders`][jaxmp.lean.param_remainders] (a float32 master
as a bfloat16 param plus 16 bits) and [`preset`][jaxmp.lean.preset] (the combinations by name).
Why round stochastically, where the random bits come from and what a skipped step draws:
see docs/lean-recipes.md.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from jaxmp import _tree
from jaxmp._typing import PyTree
from jaxmp._dtypes import is_floating_array
from jaxmp._keys import IMPL as _IMPL, as_key as _as_key, key_data as _key_data, leaf_keys as _leaf_keys, \
    random_bits as _random_bits
from jaxmp._precision._presets import did_you_mean
from jaxmp.lean import _chunked
from jaxmp.lean._quantized import WIDEN as _WIDEN, QuantizedMoments as _QuantizedMoments, QuantizedMomentsState, \
    quantized_moments, unused_key_warning as _unused_key_warning
from jaxmp._misuse import MixedPrecisionWarning
from jaxmp._scaling._transform import check_inner
from jaxmp._scaling._transform import master_weights as _master_weights

__all__ = [
    "Bf16MomentsState",
    "Bf16ParamsState",
    "ParamRemaindersState",
    "PRESETS",
    "QuantizedMomentsState",
    "bf16_moments",
    "bf16_params",
    "merge_master",
    "param_remainders",
    "preset",
    "quantized_moments",
    "remainder_master",
    "split_master",
    "stochastic_round",
]

_ROUNDINGS = ("stochastic", "nearest")


class Bf16MomentsState(NamedTuple):
    """State of [`bf16_moments`][jaxmp.lean.bf16_moments].

    Attributes:
      inner_state: the wrapped transformation's state, its moment leaves (floating, ``ndim >= 1``)
        stored in bfloat16.
      key: uint32[2], the raw threefry2x32 key data (constant).
      count: int32 [], updates applied so far (folded into ``key`` for each update's bits).
    """

    inner_state: optax.OptState
    key: jax.Array
    count: jax.Array


class Bf16ParamsState(NamedTuple):
    """State of [`bf16_params`][jaxmp.lean.bf16_params].

    Attributes:
      inner_state: the wrapped transformation's state, built on a float32 view of the params.
      key: uint32[2], the raw threefry2x32 key data (constant).
      count: int32 [], updates applied so far (folded into ``key`` for each update's bits).
    """

    #: Read by jaxmp's init check: these params learn without a float32 master copy.
    keeps_half_params_exact = True

    inner_state: optax.OptState
    key: jax.Array
    count: jax.Array


class ParamRemaindersState(NamedTuple):
    """State of [`param_remainders`][jaxmp.lean.param_remainders].

    Attributes:
      inner_state: the wrapped transformation's state, built on the float32 masters.
      remainders: int16 per bfloat16 param leaf, the low 16 bits of its float32 master (see
        [`split_master`][jaxmp.lean.split_master]); an int16 scalar placeholder (0) for float32 and non-floating leaves (not an empty array:
        orbax cannot save one).
    """

    #: Read by jaxmp's init check: these params learn without a float32 master copy.
    keeps_half_params_exact = True

    inner_state: optax.OptState
    remainders: PyTree


# --------------------------------------------------------------------------- keys and rounding


def _check_rounding(rounding: Any) -> str:
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    return rounding


def stochastic_round(x: jax.Array, key: jax.Array | int, dtype: DTypeLike = jnp.bfloat16) -> jax.Array:
    """Rounds float32 ``x`` to bfloat16 stochastically: up with probability equal to the distance.

    ``E[stochastic_round(x)] == x``; values bfloat16 represents, infinities and NaN are unchanged.

    Args:
      x: a float32 array.
      key: a threefry2x32 PRNG key (or an int seed).
      dtype: the target dtype; only bfloat16 is supported.

    Returns:
      A bfloat16 array of ``x``'s shape.

    Raises:
      TypeError: ``x`` is not float32.
      ValueError: ``dtype`` is not bfloat16.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmp.lean import stochastic_round
      >>> # a quarter of the way to the next bf16:
      >>> x = jnp.full(10_000, 1.0 + 2.0**-9, jnp.float32)
      >>> r = stochastic_round(x, jax.random.key(0)).astype(jnp.float32)
      >>> sorted(set(r.tolist())), round(float(r.mean()), 4)
      ([1.0, 1.0078125], 1.002)
    """
    if np.dtype(dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(f"stochastic_round rounds float32 to bfloat16 only (the high half of the float32 bit "
                         f"pattern), got dtype {np.dtype(dtype)}")
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(f"stochastic_round rounds float32 values, got {x.dtype}")
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    noise = _random_bits(_as_key(key), x.shape) >> 16
    high = ((bits + noise) >> 16).astype(jnp.uint16)
    rounded = jax.lax.bitcast_convert_type(high, jnp.bfloat16)
    # A NaN whose payload sits in the low half only would otherwise truncate to inf.
    return jnp.where(jnp.isnan(x), x.astype(jnp.bfloat16), rounded)


def _no_key(what: str, key: Any) -> jax.Array:
    """The key data of a transformation that rounds to nearest: zeros, ``key`` unused (said)."""
    _unused_key_warning(what, key, "rounding='nearest' rounds to the nearest bfloat16", stacklevel=4)
    return jnp.zeros(2, jnp.uint32)


def _round(x: jax.Array, key, rounding: str) -> jax.Array:
    x = x.astype(jnp.float32)
    return stochastic_round(x, key) if rounding == "stochastic" else x.astype(jnp.bfloat16)


# --------------------------------------------------------------------------- bf16 moments


def _is_moment(x: Any) -> bool:
    return is_floating_array(x) and jnp.ndim(x) >= 1 and jnp.asarray(x).dtype in (jnp.float32, jnp.bfloat16)


def bf16_moments(inner: optax.GradientTransformation, key: jax.Array | int | None = None, *,
                 rounding: str = "stochastic") -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s moments in bfloat16, computes in float32, rounds stochastically on store.

    Floating state leaves with ``ndim >= 1`` are stored in bfloat16; scalars keep their dtype.
    ``rounding="nearest"`` is the stalling failure mode, kept for comparison.
    See docs/lean-recipes.md#bf16-moments-need-stochastic-rounding.

    Args:
      inner: the optax transformation whose state is stored in bfloat16 (e.g. ``optax.adamw``).
      key: an int seed or a threefry2x32 ``jax.random.key``; required for stochastic rounding,
        unused with ``rounding="nearest"`` (a ``MixedPrecisionWarning`` says so).
      rounding: ``"stochastic"`` (default) or ``"nearest"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is [`Bf16MomentsState`][jaxmp.lean.Bf16MomentsState].

    Raises:
      TypeError: no ``key`` for stochastic rounding.
      ValueError: an unknown ``rounding``.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxmp.lean import bf16_moments
      >>> tx = bf16_moments(optax.adam(1e-3), key=0)
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> updates, state = tx.update({"w": jnp.ones(3)}, state)
      >>> state.inner_state[0].nu["w"].dtype, updates["w"].dtype
      (dtype(bfloat16), dtype('float32'))
    """
    inner = check_inner(inner)
    rounding = _check_rounding(rounding)
    key_data = _key_data(key, "bf16_moments") if rounding == "stochastic" else _no_key("bf16_moments", key)

    def init_fn(params):
        state = inner.init(params)
        stored = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if _is_moment(x) else x, state)
        return Bf16MomentsState(stored, jnp.array(key_data), jnp.zeros([], jnp.int32))

    def update_fn(grads, state, params=None, **extra_args):
        if not isinstance(state, Bf16MomentsState):
            raise TypeError(f"state must be the Bf16MomentsState made by bf16_moments' init, got "
                            f"{type(state).__name__}")
        wide = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) if _is_moment(x) else x, state.inner_state)
        updates, new_inner = inner.update(grads, wide, params, **extra_args)
        old_leaves = jax.tree_util.tree_leaves(state.inner_state)
        new_leaves, treedef = jax.tree_util.tree_flatten(new_inner)
        if len(new_leaves) != len(old_leaves):
            raise ValueError("the inner optimizer's update changed the structure of its state")
        keys = _leaf_keys(state.key, state.count, len(new_leaves)) if rounding == "stochastic" else [None] * len(
            new_leaves)
        stored = [_round(new, k, rounding) if _is_moment(old) else new
                  for old, new, k in zip(old_leaves, new_leaves, keys)]
        return updates, Bf16MomentsState(jax.tree_util.tree_unflatten(treedef, stored), state.key,
                                         (state.count + 1).astype(jnp.int32))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------- bf16 params


def _check_param_dtypes(params: Any, what: str, allowed: tuple, fix: str) -> None:
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        if is_floating_array(p) and jnp.asarray(p).dtype not in allowed:
            raise TypeError(f"{what}: param leaf at {jax.tree_util.keystr(path)} is {jnp.asarray(p).dtype}; {fix}")


def _need_params(params: Any, what: str) -> None:
    if params is None:
        raise ValueError(f"{what} updates the params themselves and needs them: call tx.update(grads, state, params)")


def _leaf_f32(x: Any) -> Any:
    return jnp.asarray(x).astype(jnp.float32) if is_floating_array(x) else x


def _to_f32(tree: Any) -> Any:
    return jax.tree_util.tree_map(_leaf_f32, tree)


def _inner_update(inner, grads, state, params, wide_params, extra_args, param_parts=None, param_fn=None):
    """``inner.update`` on the float32 widening of ``grads`` and ``params`` (``wide_params``). Quantized
    moments get them unwidened, with how to widen a leaf (`jaxmp.lean._chunked.Inputs`): they
    update large leaves a slice at a time and widen each slice, never a whole leaf."""
    if isinstance(inner, _QuantizedMoments):
        lazy = (_chunked.Inputs((grads,), _leaf_f32),
                _chunked.Inputs(param_parts or (params,), param_fn or _leaf_f32))
        return inner.update(grads, state, params, **extra_args, **{_WIDEN: lazy})
    return inner.update(_to_f32(grads), state, wide_params, **extra_args)


def bf16_params(inner: optax.GradientTransformation, key: jax.Array | int | None = None, *,
                rounding: str = "stochastic") -> optax.GradientTransformationExtraArgs:
    """Updates bfloat16 params with no master copy, rounding each new param stochastically.

    ``inner`` runs in float32; each bfloat16 param becomes ``stochastic_round(float32(param) + update)``
    (arXiv:2010.06192); the returned updates are the float32 differences. float32 params are updated
    in float32. See docs/lean-recipes.md#bf16-params-with-stochastic-rounding-no-master.

    Args:
      inner: the optax transformation run in float32 (e.g. ``optax.adamw``).
      key: an int seed or a threefry2x32 ``jax.random.key``; required for stochastic rounding,
        unused with ``rounding="nearest"`` (a ``MixedPrecisionWarning`` says so).
      rounding: ``"stochastic"`` (default) or ``"nearest"`` (updates below half an ulp are lost).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is [`Bf16ParamsState`][jaxmp.lean.Bf16ParamsState];
      ``update`` requires ``params``.

    Raises:
      TypeError: float16 params, or no ``key`` for stochastic rounding.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> from jaxmp.lean import bf16_params
      >>> tx = jaxmp.loss_scaling(bf16_params(optax.sgd(1e-4), key=0), "none")
      >>> # the bf16 below 1.0 is 2**-8 away: 39x the step
      >>> params = {"w": jnp.ones(4096, jnp.bfloat16)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones(4096, jnp.bfloat16)}, state, params)
      >>> new_params = jaxmp.apply_updates(params, updates, state)
      >>> moved = float((new_params["w"] != 1).mean())  # ~1/39
      >>> 0.015 < moved < 0.035
      True
    """
    inner = check_inner(inner)
    rounding = _check_rounding(rounding)
    key_data = _key_data(key, "bf16_params") if rounding == "stochastic" else _no_key("bf16_params", key)
    fix = "bf16_params keeps bfloat16 params (float32 ones are updated in float32); use master weights for float16"

    def init_fn(params):
        _check_param_dtypes(params, "bf16_params", (jnp.bfloat16, jnp.float32), fix)
        return Bf16ParamsState(inner.init(_to_f32(params)), jnp.array(key_data), jnp.zeros([], jnp.int32))

    def update_fn(grads, state, params=None, **extra_args):
        if not isinstance(state, Bf16ParamsState):
            raise TypeError(f"state must be the Bf16ParamsState made by bf16_params' init, got {type(state).__name__}")
        _need_params(params, "bf16_params")
        _tree.check_same_structure(grads, params, "gradients", "params")
        _check_param_dtypes(params, "bf16_params", (jnp.bfloat16, jnp.float32), fix)
        wide = _to_f32(params)
        updates, inner_state = _inner_update(inner, grads, state.inner_state, params, wide, extra_args)
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        keys = _leaf_keys(state.key, state.count, len(p_leaves)) if rounding == "stochastic" else [None] * len(
            p_leaves)

        def delta(p, w, u, k):
            if not is_floating_array(p):
                return jnp.zeros_like(p)
            if jnp.asarray(p).dtype == jnp.float32:
                return u.astype(jnp.float32)
            new = _round(w + u.astype(jnp.float32), k, rounding)
            return new.astype(jnp.float32) - w

        deltas = [delta(p, w, u, k) for p, w, u, k in
                  zip(p_leaves, jax.tree_util.tree_leaves(wide), treedef.flatten_up_to(updates), keys)]
        return (jax.tree_util.tree_unflatten(treedef, deltas),
                Bf16ParamsState(inner_state, state.key, (state.count + 1).astype(jnp.int32)))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------- param remainders


def split_master(master: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splits a float32 master into a bfloat16 param and an int16 remainder, losslessly.

    The param is the master rounded to nearest bfloat16 with ties away from zero (ties to even
    could not be undone from 16 bits); the remainder is the low 16 bits.
    See docs/lean-recipes.md#param-remainders-the-fp32-master-in-2-2-bytes.

    Args:
      master: a float32 array.

    Returns:
      ``(param, remainder)``: bfloat16 and int16 arrays of ``master``'s shape, with
      ``merge_master(param, remainder)`` bitwise equal to ``master``.

    Raises:
      TypeError: ``master`` is not float32.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp.lean import merge_master, split_master
      >>> master = jnp.array([1.0 + 2.0**-20, -3.14159, 1e-30], jnp.float32)
      >>> param, rem = split_master(master)
      >>> param.dtype, rem.dtype, bool((merge_master(param, rem) == master).all())
      (dtype(bfloat16), dtype('int16'), True)
    """
    master = jnp.asarray(master)
    if master.dtype != jnp.float32:
        raise TypeError(f"split_master splits float32 masters, got {master.dtype}")
    bits = jax.lax.bitcast_convert_type(master, jnp.uint32)
    low = bits & 0xFFFF
    high = (bits >> 16) + (low >= 0x8000).astype(jnp.uint32)
    param = jax.lax.bitcast_convert_type(high.astype(jnp.uint16), jnp.bfloat16)
    return param, jax.lax.bitcast_convert_type(low.astype(jnp.uint16), jnp.int16)


def merge_master(param: jax.Array, remainder: jax.Array) -> jax.Array:
    """The float32 master held as a bfloat16 param and an int16 remainder (inverse of [`split_master`][jaxmp.lean.split_master]).

    Args:
      param: a bfloat16 array.
      remainder: an int16 array of the same shape.

    Returns:
      The float32 array whose bit pattern is ``(param_bits << 16) + remainder`` (mod 2**32).

    Raises:
      TypeError: ``param`` is not bfloat16 (float16 is no half of a float32) or ``remainder`` not int16.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp.lean import merge_master
      >>> param, remainder = jnp.array([1.0], jnp.bfloat16), jnp.array([1], jnp.int16)
      >>> merge_master(param, remainder).tolist() == [1.0 + 2.0**-23]
      True
    """
    param, remainder = jnp.asarray(param), jnp.asarray(remainder)
    if param.dtype != jnp.bfloat16:
        raise TypeError(f"param remainders reconstruct a float32 from a bfloat16 param (its high half); got "
                        f"{param.dtype}")
    if remainder.dtype != jnp.int16:
        raise TypeError(f"remainder must be int16, got {remainder.dtype}")
    high = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(jnp.uint32) << 16
    low = jax.lax.bitcast_convert_type(remainder.astype(jnp.int32), jnp.uint32)
    return jax.lax.bitcast_convert_type(high + low, jnp.float32)


# A float32 or non-floating leaf's remainder: an int16 scalar (2 bytes), not an empty array, which
# checkpointers refuse (orbax: "Cannot save arrays with zero size").
_EMPTY = ()


def _merges(p: Any) -> bool:
    return is_floating_array(p) and jnp.asarray(p).dtype == jnp.bfloat16


def _masters(params: Any, remainders: Any) -> Any:
    return jax.tree_util.tree_map(lambda p, r: merge_master(p, r) if _merges(p) else p, params, remainders)


def param_remainders(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Keeps float32 masters as bfloat16 params plus 16-bit remainders, exactly (Apex ``store_param_remainders``).

    ``update`` rebuilds the masters ([`merge_master`][jaxmp.lean.merge_master]), runs ``inner`` on them
    in float32 and returns the float32 differences that move each param onto the new master's high
    half: bitwise the training of ``loss_scaling(..., master_weights=True)``, but for ties and
    cancellation (docs/lean-recipes.md#param-remainders-the-fp32-master-in-2-2-bytes).

    Args:
      inner: the optax transformation run on the float32 masters (e.g. ``optax.adamw``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is [`ParamRemaindersState`][jaxmp.lean.ParamRemaindersState];
      ``update`` requires ``params``.

    Raises:
      TypeError: float16 params (a float16 value is not the high half of a float32).

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> from jaxmp.lean import param_remainders, remainder_master
      >>> tx = jaxmp.loss_scaling(param_remainders(optax.sgd(1e-4)), "none")
      >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
      >>> params = jaxmp.apply_updates(params, updates, state)
      >>> expected = [jnp.float32(1) - jnp.float32(1e-4)] * 2
      >>> params["w"].tolist(), remainder_master(params, state)["w"].tolist() == expected
      ([1.0, 1.0], True)
    """
    inner = check_inner(inner)
    fix = ("param remainders keep bfloat16 params: a float16 value is not the high half of a float32. Use "
           "jaxmp.loss_scaling(..., master_weights=True) for float16 params")

    def init_fn(params):
        _check_param_dtypes(params, "param_remainders", (jnp.bfloat16, jnp.float32), fix)
        remainders = jax.tree_util.tree_map(
            lambda p: jnp.zeros(jnp.shape(p) if jnp.asarray(p).dtype == jnp.bfloat16 else _EMPTY, jnp.int16)
            if is_floating_array(p) else jnp.zeros(_EMPTY, jnp.int16), params)
        return ParamRemaindersState(inner.init(_to_f32(params)), remainders)

    def update_fn(grads, state, params=None, **extra_args):
        if not isinstance(state, ParamRemaindersState):
            raise TypeError(f"state must be the ParamRemaindersState made by param_remainders' init, got "
                            f"{type(state).__name__}")
        _need_params(params, "param_remainders")
        _tree.check_same_structure(grads, params, "gradients", "params")
        if jax.tree_util.tree_structure(state.remainders) != jax.tree_util.tree_structure(params):
            raise ValueError("params and the remainders in the state have different tree structures")
        _check_param_dtypes(params, "param_remainders", (jnp.bfloat16, jnp.float32), fix)
        masters = _masters(params, state.remainders)
        # A float32 param's remainder is empty: it widens itself (its own leaf as the second part).
        parts = (params, jax.tree_util.tree_map(lambda p, r: r if _merges(p) else p, params, state.remainders))
        updates, inner_state = _inner_update(inner, grads, state.inner_state, params, masters, extra_args, parts,
                                             lambda p, r: merge_master(p, r) if _merges(p) else p)
        p_leaves, treedef = jax.tree_util.tree_flatten(params)
        m_leaves = treedef.flatten_up_to(masters)
        u_leaves = treedef.flatten_up_to(updates)
        r_leaves = treedef.flatten_up_to(state.remainders)
        deltas, rems = [], []
        for p, m, u, r in zip(p_leaves, m_leaves, u_leaves, r_leaves):
            if not is_floating_array(p):
                deltas.append(jnp.zeros_like(p))
                rems.append(r)
                continue
            if jnp.asarray(p).dtype == jnp.float32:
                deltas.append(u.astype(jnp.float32))
                rems.append(r)
                continue
            new_param, new_rem = split_master(m + u.astype(jnp.float32))
            old = p.astype(jnp.float32)
            d = new_param.astype(jnp.float32) - old
            applied = (old + d).astype(jnp.bfloat16)    # what jaxmp.apply_updates and optax.apply_updates compute
            exact = jax.lax.bitcast_convert_type(applied, jnp.uint16) == jax.lax.bitcast_convert_type(
                new_param, jnp.uint16)
            deltas.append(d)
            rems.append(jnp.where(exact, new_rem, jnp.zeros_like(new_rem)))
        return (jax.tree_util.tree_unflatten(treedef, deltas),
                ParamRemaindersState(inner_state, jax.tree_util.tree_unflatten(treedef, rems)))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def remainder_master(params: optax.Params, opt_state: optax.OptState) -> optax.Params:
    """The float32 masters held by [`param_remainders`][jaxmp.lean.param_remainders]: the params merged with their remainders.

    Args:
      params: the current (bfloat16) params.
      opt_state: an optimizer state holding a [`ParamRemaindersState`][jaxmp.lean.ParamRemaindersState] (e.g. the
        ``loss_scaling`` state around it).

    Returns:
      The float32 masters, one per param leaf (float32 and non-floating params as they are).

    Raises:
      ValueError: the state holds no (or several) [`ParamRemaindersState`][jaxmp.lean.ParamRemaindersState].

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxmp.lean import param_remainders, remainder_master
      >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
      >>> remainder_master(params, param_remainders(optax.sgd(0.1)).init(params))["w"].dtype
      dtype('float32')
    """
    found = _tree.find_states(opt_state, ParamRemaindersState)
    if len(found) != 1:
        raise ValueError(f"expected one param_remainders state in opt_state, found {len(found)}: build the "
                         "optimizer with jaxmp.lean.param_remainders(...) or jaxmp.lean.preset('remainders', ...)")
    remainders = found[0].remainders
    if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(remainders):
        _tree.check_same_structure(params, remainders, "params", "remainders")  # raises, naming both trees
    # Only bfloat16 params have a remainder of their shape; the others hold an empty placeholder.
    _tree.check_same_structure(params, jax.tree_util.tree_map(
        lambda p, r: r if is_floating_array(p) and jnp.asarray(p).dtype == jnp.bfloat16 else p, params, remainders),
        "params", "remainders")
    return _masters(params, remainders)


# --------------------------------------------------------------------------- presets

PRESETS: dict[str, tuple[float, str]] = {
    "fp32-masters": (14, "O2-bf16 with float32 masters and float32 moments: the reference"),
    "remainders": (12, "bf16 params + int16 remainders: bitwise the float32-master run, 2 bytes less"),
    "masters-bf16-moments": (10, "float32 masters, SR bf16 moments (DeepSeek-V3's recipe)"),
    "sr-params": (10, "SR bf16 params, no master, float32 moments"),
    "remainders-bf16-moments": (8, "exact masters via remainders, SR bf16 moments"),
    "bf16-sr": (6, "SR bf16 params and SR bf16 moments: unbiased but noisier"),
    "remainders-8bit": (6.03125, "exact masters via remainders, 8-bit blockwise moments (block 256)"),
    "remainders-4bit": (5.0625, "exact masters via remainders, 4-bit blockwise moments (block 128)"),
    "bf16-sr-8bit": (4.03125, "SR bf16 params, 8-bit blockwise moments: a third of float32 AdamW"),
    "bf16-sr-4bit": (3.0625, "SR bf16 params, 4-bit blockwise moments: the leanest"),
}
"""The names [`preset`][jaxmp.lean.preset] takes: name -> (bytes per parameter with AdamW, params plus optimizer
state, O(1) scalars aside, the 8-bit and 4-bit moments' float32 block scales included; what the
recipe trades). The quantized presets keep moment leaves under 4096 elements in float32 (a model's
biases and norms: a fraction of a percent of its parameters)."""

#: Bytes per parameter with AdamW when the params are float32, not bfloat16 (plain float32 AdamW:
#: 12): the params cost 4, a float32 master duplicates them, and a remainder is empty. What the
#: presets save comes from bfloat16 params; tests/lean/test_lean.py measures these figures.
_FLOAT32_PARAM_BYTES = {"fp32-masters": 16, "remainders": 12, "masters-bf16-moments": 12, "sr-params": 12,
                        "remainders-bf16-moments": 8, "bf16-sr": 8, "remainders-8bit": 6, "remainders-4bit": 5,
                        "bf16-sr-8bit": 6, "bf16-sr-4bit": 5}
_PLAIN_FLOAT32_BYTES = 12


def _warn_on_float32_params(name: str, tx: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``init`` warns when no floating param is bfloat16 (the preset then saves little or nothing)."""

    def init_fn(params):
        dtypes = {jnp.asarray(p).dtype for p in jax.tree_util.tree_leaves(params) if is_floating_array(p)}
        if dtypes and jnp.dtype(jnp.bfloat16) not in dtypes:
            spent = _FLOAT32_PARAM_BYTES[name]
            saved = "saves nothing" if spent >= _PLAIN_FLOAT32_BYTES else "saves only what its narrow moments save"
            warnings.warn(
                f"jaxmp.lean.preset({name!r}) got no bfloat16 params ({', '.join(sorted(map(str, dtypes)))} only): "
                f"its {PRESETS[name][0]} bytes per parameter assume bfloat16 params; on these it spends {spent} "
                f"(plain float32 AdamW: {_PLAIN_FLOAT32_BYTES}), so it {saved}. Store the params in bfloat16 first: "
                "jaxmp.cast_floating(params, jnp.bfloat16), or a Flax model under an O2-bf16 policy.",
                MixedPrecisionWarning, stacklevel=_user_stacklevel())
        return tx.init(params)

    return optax.GradientTransformationExtraArgs(init_fn, tx.update)


def preset(name: str, inner: optax.GradientTransformation, *, key: jax.Array | int | None = None,
           accumulate_steps: int = 1) -> optax.GradientTransformationExtraArgs:
    """A memory-lean recipe by name, to wrap in [`jaxmp.loss_scaling`][jaxmp.loss_scaling] (with bfloat16 params).

    | name | bytes/param with AdamW | composition |
    |---|---|---|
    | ``"fp32-masters"`` | 14 | ``master_weights(inner)`` |
    | ``"remainders"`` | 12 | ``param_remainders(inner)`` |
    | ``"masters-bf16-moments"`` | 10 | ``master_weights(bf16_moments(inner))`` |
    | ``"sr-params"`` | 10 | ``bf16_params(inner)`` |
    | ``"remainders-bf16-moments"`` | 8 | ``param_remainders(bf16_moments(inner))`` |
    | ``"bf16-sr"`` | 6 | ``bf16_params(bf16_moments(inner))`` |
    | ``"remainders-8bit"`` | 6.03 | ``param_remainders(quantized_moments(inner, bits=8))`` |
    | ``"remainders-4bit"`` | 5.06 | ``param_remainders(quantized_moments(inner, bits=4))`` |
    | ``"bf16-sr-8bit"`` | 4.03 | ``bf16_params(quantized_moments(inner, bits=8))`` |
    | ``"bf16-sr-4bit"`` | 3.06 | ``bf16_params(quantized_moments(inner, bits=4))`` |

    The quantized moments round to nearest (see docs/lean-recipes.md#8-bit-and-4-bit-moments).

    Args:
      name: a key of `PRESETS`.
      inner: the optax optimizer (e.g. ``optax.adamw(1e-3)``).
      key: an int seed or threefry2x32 key; required by the presets that round stochastically
        (``"masters-bf16-moments"``, ``"sr-params"``, ``"remainders-bf16-moments"`` and the
        ``"bf16-sr"`` ones), unused by the others (a ``MixedPrecisionWarning`` says so).
      accumulate_steps: gradient accumulation over this many steps (``optax.MultiSteps``, placed
        as docs/lean-recipes.md#gradient-accumulation says).

    Returns:
      An optax transformation; wrap it: ``jaxmp.loss_scaling(preset(...), "none")``.

    Raises:
      ValueError: unknown name (with the closest names), or ``accumulate_steps`` < 1.
      TypeError: a stochastic preset without a key.

    Warns:
      MixedPrecisionWarning: at ``init``, when no floating param is bfloat16 (the presets then save little);
        at the call, a ``key`` for a preset that rounds to nearest (unused).

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> from jaxmp.lean import preset
      >>> tx = jaxmp.loss_scaling(preset("bf16-sr", optax.adamw(1e-3), key=0), "none")
      >>> type(tx.init({"w": jnp.ones((4, 4), jnp.bfloat16)})).__name__
      'LossScalingState'
    """
    if name not in PRESETS:
        raise ValueError(f"Unknown lean preset {name!r}{did_you_mean(name, PRESETS)}; the presets are "
                         f"{', '.join(PRESETS)}")
    if isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, (int, np.integer)) \
            or accumulate_steps < 1:
        raise ValueError(f"accumulate_steps must be an int >= 1, got {accumulate_steps!r}")
    stochastic = name in _STOCHASTIC or name.startswith("bf16-sr")
    if not stochastic:
        _unused_key_warning(f"jaxmp.lean.preset({name!r})", key, "it rounds every value to nearest (its moments "
                            "too)", f"Drop key=; the presets that round stochastically: {', '.join(_stochastic())}")
    base = jax.random.wrap_key_data(_key_data(key, f"preset {name!r}"), impl=_IMPL) if stochastic else None
    inner = check_inner(inner)
    if name.endswith("bf16-moments") or name == "bf16-sr":
        inner = bf16_moments(inner, jax.random.fold_in(base, 2))
    elif name.endswith("bit"):
        inner = quantized_moments(inner, bits=int(name[-4]))
    if accumulate_steps > 1:
        inner = optax.MultiSteps(inner, accumulate_steps).gradient_transformation()
    if name.startswith("remainders"):
        tx = param_remainders(inner)
    elif name == "sr-params" or name.startswith("bf16-sr"):
        tx = bf16_params(inner, jax.random.fold_in(base, 1))
    else:
        tx = _master_weights(inner)
    return _warn_on_float32_params(name, tx)


_STOCHASTIC = ("masters-bf16-moments", "sr-params", "remainders-bf16-moments")


def _stochastic() -> list[str]:
    return [n for n in PRESETS if n in _STOCHASTIC or n.startswith("bf16-sr")]


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside jaxmp and optax (the user's ``init`` call):
    wrappers (``loss_scaling``, ``optax.masked``) add frames between it and the warning.

    Frames are compared with the installed packages' own directories, never with a path
    fragment: a user's code under a folder named ``jaxmp`` (the README's clone) is the user's.
    """
    import sys

    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


# The directories of jaxmp's and optax's own source files (``os.sep``-terminated so that a
# sibling such as ``jaxmp_examples/`` is not mistaken for the package).
# This file is jaxmp/lean/__init__.py: jaxmp's directory is two levels up.
_LIBRARY_DIRS = tuple(os.path.join(os.path.dirname(os.path.abspath(path)), "")
                      for path in (os.path.dirname(os.path.abspath(__file__)), optax.__file__))

