"""Per-leaf gradient reductions in a chosen dtype, for the per-shard loss of the sharded layouts.

Inside a ``shard_map`` over the data axis each param enters the loss through one of these
``custom_vjp`` identities. The forward hands the loss the full param (as it is, or gathered
from its slice in its stored dtype); the backward receives this shard's (unreduced) gradient of
that one leaf and reduces it over the data axis in ``reduce_dtype``: an all-reduce
(``psum``) for a leaf every device updates whole, a reduce-scatter (``psum_scatter``) onto the
slice a device updates for a sharded one. Then the sum is cast back to the param's dtype.

Why per leaf and at the use: the cast to ``reduce_dtype`` happens in the backward, one gradient
at a time, where that leaf's gradient is complete. So a float32 reduce of bf16 gradients costs
one float32 gradient buffer, and no float32 copy of the params is ever made (the earlier
global-view formulation broadcast a float32 copy of every param at once).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def _varying(x: jax.Array, axis: str) -> jax.Array:
    # The loss runs per shard: a value it mixes with the shard's batch varies over the axis.
    # Marking it here (a no-op at run time) means the cotangent this rule receives is the
    # shard's own, unreduced one, and JAX inserts no psum of its own (in the param's dtype).
    aval = jax.typeof(x)
    # The set of axes a value varies over: ``aval.vma`` in older JAX, ``manual_axis_type.varying`` in 0.10.
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    if axis in vma:
        return x
    return jax.lax.pcast(x, axis, to="varying")


def _sum_in(ct: jax.Array, reduce_dtype: Any) -> jax.Array:
    return ct.astype(reduce_dtype) if reduce_dtype is not None else ct


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def all_reduced(p: jax.Array, axis: str, reduce_dtype: Any) -> jax.Array:
    """``p`` (the same on every device); its gradient is summed over ``axis`` in ``reduce_dtype``."""
    return _varying(p, axis)


def _all_reduced_fwd(p, axis, reduce_dtype):
    return _varying(p, axis), None


def _all_reduced_bwd(axis, reduce_dtype, _, ct):
    return (jax.lax.psum(_sum_in(ct, reduce_dtype), axis).astype(ct.dtype),)


all_reduced.defvjp(_all_reduced_fwd, _all_reduced_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def scattered(full: jax.Array, piece: jax.Array, axis: str, dim: int, reduce_dtype: Any) -> jax.Array:
    """``full`` (replicated: ZeRO's params); the gradient goes reduce-scattered onto ``piece``'s slice.

    ``piece`` is this device's slice of the same param along ``dim`` (its value is not read);
    the gradient with respect to ``full`` is zero, so ``full`` is passed under ``stop_gradient``.
    """
    return _varying(full, axis)


def _scattered_fwd(full, piece, axis, dim, reduce_dtype):
    return _varying(full, axis), None


def _scattered_bwd(axis, dim, reduce_dtype, _, ct):
    piece = jax.lax.psum_scatter(_sum_in(ct, reduce_dtype), axis, scatter_dimension=dim, tiled=True)
    return None, piece.astype(ct.dtype)


scattered.defvjp(_scattered_fwd, _scattered_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gathered(piece: jax.Array, axis: str, dim: int, reduce_dtype: Any) -> jax.Array:
    """This device's slice of a param, all-gathered along ``dim`` in its own dtype (FSDP); the
    gradient goes reduce-scattered back onto the slice in ``reduce_dtype``."""
    return _varying(jax.lax.all_gather(piece, axis, axis=dim, tiled=True), axis)


def _gathered_fwd(piece, axis, dim, reduce_dtype):
    return _varying(jax.lax.all_gather(piece, axis, axis=dim, tiled=True), axis), None


def _gathered_bwd(axis, dim, reduce_dtype, _, ct):
    piece = jax.lax.psum_scatter(_sum_in(ct, reduce_dtype), axis, scatter_dimension=dim, tiled=True)
    return (piece.astype(ct.dtype),)


gathered.defvjp(_gathered_fwd, _gathered_bwd)


def is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and bool(
        jnp.issubdtype(dtype, jnp.floating))
