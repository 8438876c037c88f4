"""Param remainders: a float32 master held as the bfloat16 param plus 16 bits (re-exported by ``jaxmp.lean``).

`param_remainders` keeps each bfloat16 param's float32 master exactly, as the param (its high
half, rounded) and an int16 remainder (its low half): 2 + 2 bytes instead of 2 + 4
(docs/lean-recipes.md#param-remainders-the-fp32-master-in-2-2-bytes).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmp import _tree
from jaxmp._dtypes import is_floating_array
from jaxmp._misuse import KeepsHalfParamsExact
from jaxmp._scaling._transform import check_inner
from jaxmp._typing import PyTree
from jaxmp.lean import _chunked
from jaxmp.lean._widening import Widening, check_param_dtypes, leaf_f32, need_params, to_f32, update_inner


@KeepsHalfParamsExact.register  # these params learn without a float32 master copy
class ParamRemaindersState(NamedTuple):
    """State of [`param_remainders`][jaxmp.lean.param_remainders].

    Attributes:
      inner_state: the wrapped transformation's state, built on the float32 masters.
      remainders: int16 per bfloat16 param leaf, the low 16 bits of its float32 master (see
        [`split_master`][jaxmp.lean.split_master]); an int16 scalar placeholder (0) for float32 and non-floating leaves (not an empty array:
        orbax cannot save one).
    """

    inner_state: optax.OptState
    remainders: PyTree


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
        check_param_dtypes(params, "param_remainders", (jnp.bfloat16, jnp.float32), fix)
        remainders = jax.tree_util.tree_map(
            lambda p: jnp.zeros(jnp.shape(p) if jnp.asarray(p).dtype == jnp.bfloat16 else _EMPTY, jnp.int16)
            if is_floating_array(p) else jnp.zeros(_EMPTY, jnp.int16), params)
        return ParamRemaindersState(inner.init(to_f32(params)), remainders)

    def update_fn(grads, state, params=None, **extra_args):
        if not isinstance(state, ParamRemaindersState):
            raise TypeError(f"state must be the ParamRemaindersState made by param_remainders' init, got "
                            f"{type(state).__name__}")
        need_params(params, "param_remainders")
        _tree.check_same_structure(grads, params, "gradients", "params")
        if jax.tree_util.tree_structure(state.remainders) != jax.tree_util.tree_structure(params):
            raise ValueError("params and the remainders in the state have different tree structures")
        check_param_dtypes(params, "param_remainders", (jnp.bfloat16, jnp.float32), fix)
        masters = _masters(params, state.remainders)
        # A float32 param's remainder is empty: it widens itself (its own leaf as the second part).
        parts = (params, jax.tree_util.tree_map(lambda p, r: r if _merges(p) else p, params, state.remainders))
        widening = Widening(_chunked.Inputs((grads,), leaf_f32),
                            _chunked.Inputs(parts, lambda p, r: merge_master(p, r) if _merges(p) else p))
        updates, inner_state = update_inner(inner, grads, state.inner_state, params, wide_params=masters,
                                            widening=widening, extra_args=extra_args)
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

