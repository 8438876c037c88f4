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

from jaxmp.parallel import _wire, _wire_matmul


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


BUCKET_BYTES = 16 * 2**20
"""The largest piece of one gradient reduced at once, in bytes of the reduce dtype. A larger
gradient (a tied embedding's: 50257 x 768 is 147 MiB in float32) is cast and reduced in pieces
along a dimension it is not scattered over, each piece cast back to the gradient's dtype before
the next, so its float32 copy is never whole: the same sums, bit for bit (a reduction over
devices is elementwise), for a bucket's worth of float32 temporaries."""


def _buckets(ct: jax.Array, reduce_dtype: Any, keep: int | None) -> tuple[int, list[tuple[int, int]]]:
    # The dimension to cut (the largest besides ``keep``, the scattered one) and the pieces' bounds.
    itemsize = jnp.dtype(ct.dtype if reduce_dtype is None else reduce_dtype).itemsize
    dims = [d for d in range(ct.ndim) if d != keep and ct.shape[d] > 1]
    pieces = -(-ct.size * itemsize // BUCKET_BYTES)
    if pieces <= 1 or not dims:
        return -1, []
    along = max(dims, key=lambda d: ct.shape[d])
    pieces = min(pieces, ct.shape[along])
    bounds = [ct.shape[along] * i // pieces for i in range(pieces + 1)]
    return along, list(zip(bounds[:-1], bounds[1:]))


def _reduce(ct: jax.Array, reduce_dtype: Any, keep: int | None, collective: Any) -> jax.Array:
    """``collective`` of ``ct`` summed in ``reduce_dtype`` and cast back, a bucket at a time."""
    along, bounds = _buckets(ct, reduce_dtype, keep)
    if not bounds:
        return collective(_sum_in(ct, reduce_dtype)).astype(ct.dtype)
    return jnp.concatenate([collective(_sum_in(jax.lax.slice_in_dim(ct, a, b, axis=along), reduce_dtype))
                            .astype(ct.dtype) for a, b in bounds], axis=along)


def _quantizes(ct: jax.Array, wire: Any, n: int) -> bool:
    # A replicated leaf is sent quantized only when each device's piece holds a block: below that
    # the float32 scales of the padded pieces would outweigh the codes (biases, norms).
    return wire is not None and wire.reduce_bits is not None and ct.size >= n * wire.block


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def all_reduced(p: jax.Array, axis: str, reduce_dtype: Any, wire: Any = None) -> jax.Array:
    """``p`` (the same on every device); its gradient is summed over ``axis`` in ``reduce_dtype``
    (with ``wire.reduce_bits``: quantized, `jaxmp.parallel._wire.quantized_all_reduce`)."""
    return _varying(p, axis)


def _all_reduced_fwd(p, axis, reduce_dtype, wire):
    return _varying(p, axis), None


def _all_reduced_bwd(axis, reduce_dtype, wire, _, ct):
    n = jax.lax.axis_size(axis)
    if _quantizes(ct, wire, n):
        # Bucketed as the plain reduction; each bucket's sums all-gathered in the gradient's dtype.
        return (_reduce(ct, jnp.float32, None, lambda x: _wire.quantized_all_reduce(x, axis, n, wire, ct.dtype)),)
    return (_reduce(ct, reduce_dtype, None, lambda x: jax.lax.psum(x, axis)),)


all_reduced.defvjp(_all_reduced_fwd, _all_reduced_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def scattered(full: jax.Array, piece: jax.Array, axis: str, dim: int, reduce_dtype: Any, wire: Any = None) -> jax.Array:
    """``full`` (replicated: ZeRO's params); the gradient goes reduce-scattered onto ``piece``'s slice.

    ``piece`` is this device's slice of the same param along ``dim`` (its value is not read);
    the gradient with respect to ``full`` is zero, so ``full`` is passed under ``stop_gradient``.
    """
    return _varying(full, axis)


def _scattered_fwd(full, piece, axis, dim, reduce_dtype, wire):
    return _varying(full, axis), None


def _scatter(ct: jax.Array, axis: str, dim: int, reduce_dtype: Any, wire: Any) -> jax.Array:
    if wire is not None and wire.reduce_bits is not None:
        # Summed in float32 whatever reduce_dtype says; bucketed as the plain reduction is.
        n = jax.lax.axis_size(axis)
        return _reduce(ct, jnp.float32, dim, lambda x: _wire.quantized_reduce_scatter(x, axis, dim, n, wire))
    return _reduce(ct, reduce_dtype, dim,
                   lambda x: jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True))


def _scattered_bwd(axis, dim, reduce_dtype, wire, _, ct):
    return None, _scatter(ct, axis, dim, reduce_dtype, wire)


scattered.defvjp(_scattered_fwd, _scattered_bwd)


def gather(piece: jax.Array, axis: str, dim: int, wire: Any = None) -> jax.Array:
    """This device's slice all-gathered along ``dim``: in its own dtype, or with ``wire.gather_bits``
    as blockwise codes dequantized to that dtype (`jaxmp.parallel._wire.quantized_gather`), or with
    ``wire.gather_format`` as that fp8 format's codes (`jaxmp.parallel._wire_matmul.matmul_gather`)."""
    if getattr(wire, "gather_format", None) is not None and is_float(piece):
        return _wire_matmul.matmul_gather(piece, axis, dim, wire.gather_format)
    if wire is not None and wire.gather_bits is not None and is_float(piece):
        return _wire.quantized_gather(piece, axis, dim, wire)
    return jax.lax.all_gather(piece, axis, axis=dim, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gathered(piece: jax.Array, axis: str, dim: int, reduce_dtype: Any, wire: Any = None) -> jax.Array:
    return _varying(gather(piece, axis, dim, wire), axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gathered_codes(piece: jax.Array, axis: str, dim: int, reduce_dtype: Any, wire: Any = None) -> jax.Array:
    return _varying(gather(piece, axis, dim, wire), axis)


def gathered(piece: jax.Array, axis: str, dim: int, reduce_dtype: Any, wire: Any = None) -> jax.Array:
    """This device's slice of a param, all-gathered along ``dim`` (FSDP; `gather`); the
    gradient goes reduce-scattered back onto the slice in ``reduce_dtype`` (or quantized).

    With ``wire.gather_bits`` the gather is quantize, all-gather the codes, dequantize. Under
    differentiation that forward is one equation (``defvjp(..., optimize_remat=True)``:
    ``remat_opt``), so `jaxmp.parallel._per_layer.release_policy` can refuse it whole: a
    `scan_layers` body then keeps none of the dequantized values between the codes and the
    param (it kept each layer's whole weight, the release policy refusing only the all-gather
    and the named param) and its backward gathers the codes again. The same values, bit for bit.
    """
    if wire is not None and wire.gather_bits is not None and is_float(piece):
        return _gathered_codes(piece, axis, dim, reduce_dtype, wire)
    return _gathered(piece, axis, dim, reduce_dtype, wire)


def _gathered_fwd(piece, axis, dim, reduce_dtype, wire):
    return _varying(gather(piece, axis, dim, wire), axis), None


def _gathered_bwd(axis, dim, reduce_dtype, wire, _, ct):
    return (_scatter(ct, axis, dim, reduce_dtype, wire),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)
_gathered_codes.defvjp(_gathered_fwd, _gathered_bwd, optimize_remat=True)


def is_float(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and bool(
        jnp.issubdtype(dtype, jnp.floating))
