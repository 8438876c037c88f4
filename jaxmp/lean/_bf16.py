"""bfloat16 moments and bfloat16 params with stochastic rounding (re-exported by ``jaxmp.lean``).

`bf16_moments` stores an inner optimizer's moments in bfloat16; `bf16_params` updates bfloat16
params with no float32 master. Both compute in float32 and round each stored value stochastically
(`stochastic_round`) with bits drawn from a key kept in their state. Why, where the bits come from
and what a skipped step draws: docs/lean-recipes.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import DTypeLike

from jaxmp import _tree
from jaxmp._dtypes import is_floating_array
from jaxmp._keys import as_key as _as_key, key_data as _key_data, leaf_keys as _leaf_keys, \
    random_bits as _random_bits
from jaxmp._misuse import KeepsHalfParamsExact
from jaxmp._scaling._transform import check_inner
from jaxmp.lean import _chunked
from jaxmp.lean._quantized import unused_key_warning as _unused_key_warning
from jaxmp.lean._widening import Widening, check_param_dtypes, leaf_f32, need_params, to_f32, update_inner

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


@KeepsHalfParamsExact.register  # these params learn without a float32 master copy
class Bf16ParamsState(NamedTuple):
    """State of [`bf16_params`][jaxmp.lean.bf16_params].

    Attributes:
      inner_state: the wrapped transformation's state, built on a float32 view of the params.
      key: uint32[2], the raw threefry2x32 key data (constant).
      count: int32 [], updates applied so far (folded into ``key`` for each update's bits).
    """

    inner_state: optax.OptState
    key: jax.Array
    count: jax.Array


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
        check_param_dtypes(params, "bf16_params", (jnp.bfloat16, jnp.float32), fix)
        return Bf16ParamsState(inner.init(to_f32(params)), jnp.array(key_data), jnp.zeros([], jnp.int32))

    def update_fn(grads, state, params=None, **extra_args):
        if not isinstance(state, Bf16ParamsState):
            raise TypeError(f"state must be the Bf16ParamsState made by bf16_params' init, got {type(state).__name__}")
        need_params(params, "bf16_params")
        _tree.check_same_structure(grads, params, "gradients", "params")
        check_param_dtypes(params, "bf16_params", (jnp.bfloat16, jnp.float32), fix)
        wide = to_f32(params)
        widening = Widening(_chunked.Inputs((grads,), leaf_f32), _chunked.Inputs((params,), leaf_f32))
        updates, inner_state = update_inner(inner, grads, state.inner_state, params, wide_params=wide,
                                            widening=widening, extra_args=extra_args)
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

