"""Precision on the wire: blockwise-quantized weight gathers and gradient reductions (issue 63).

The sharded layouts move two things over the data axis every step: the weights, all-gathered
from their slices (ZeRO after the update, FSDP where they are used), and the gradients,
reduced onto the slices. With `Wire` options the step sends blockwise codes instead (the
quantizer of `jaxmp._formats.Grid`: 8-bit or 4-bit codes of the dynamic map and one float32
absmax a block, the blocks inside each device's piece):

- a weight gather quantizes this device's slice, all-gathers codes and scales, and dequantizes
  every device's piece to the compute dtype (`quantized_gather`);
- a gradient reduction quantizes this device's gradient one destination slice at a time, sends
  each slice's codes to the device that owns it with ``all_to_all``, and sums the pieces it
  receives in float32 in device order (`quantized_reduce_scatter`; a replicated-at-rest leaf is
  then all-gathered, `quantized_all_reduce`). Deterministic: the same inputs give the same bits.

The finiteness contract: a blockwise quantizer can hide a NaN (a row max that drops it), so the
flag is taken on this device's raw gradient before quantizing, and a non-finite one makes every
scale it sends NaN: every device's reduced slice is then NaN and the loss-scaling skip (which
checks the reduced gradient) skips the step on every device, as it does without quantization.
See docs/parallel.md#precision-on-the-wire.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _formats
from jaxmp.parallel import _wire_matmul

GATHER_BITS = (8,)
REDUCE_BITS = (8, 4)
DEFAULT_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class Wire:
    """What crosses the data axis quantized (hashable: a ``custom_vjp``'s static argument).

    Attributes:
      gather_bits: bits of a gathered weight's codes (8), or None (gathered in its own dtype).
      reduce_bits: bits of a reduced gradient's codes (8 or 4), or None (reduced in ``reduce_dtype``).
      block: elements a float32 scale, inside one device's piece.
      gather_format: FSDP's kernels gathered as the fp8 codes of this per-tensor
        ``jaxmp.fp8.CurrentScaling`` (`jaxmp.parallel._wire_matmul`), or None.
    """

    gather_bits: int | None = None
    reduce_bits: int | None = None
    block: int = DEFAULT_BLOCK
    gather_format: Any = None

    def gather_grid(self) -> _formats.Grid | None:
        return None if self.gather_bits is None else _formats.Grid(self.gather_bits, self.block)

    def reduce_grid(self) -> _formats.Grid | None:
        return None if self.reduce_bits is None else _formats.Grid(self.reduce_bits, self.block)


def _check_bits(value: Any, name: str, allowed: tuple) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be None or an int in {allowed}, got {type(value).__name__} {value!r}")
    if int(value) not in allowed:
        raise ValueError(f"{name} must be None or one of {allowed} (bits of the blockwise codes), got {value!r}")
    return int(value)


def check_wire(gather_bits: Any, reduce_bits: Any, block: Any, layout: Any, reduce_dtype: Any) -> Wire | None:
    """The step's `Wire`, or None when both options are off (the step as before, bit for bit).

    Args:
      gather_bits: ``make_sharded_train_step``'s ``gather_bits``: None, bits, or a matmul format
        (`jaxmp.parallel._wire_matmul.check_format`).
      reduce_bits: its ``reduce_bits``.
      block: its ``wire_block`` (elements a scale).
      layout: the step's `jaxmp.parallel._layouts.Layout`.
      reduce_dtype: the step's checked ``reduce_dtype`` (None: XLA reduces on the global view).

    Returns:
      The `Wire`, or None.

    Raises:
      ValueError: bits not in the allowed set, a block that is not a positive even int, an option
        on the ``"replicated"`` layout (nothing is gathered or scattered there), or with
        ``reduce_dtype=None`` (XLA then places the collectives, out of the step's reach), or a
        matmul format that is not per-tensor current scaling or not under ``"fsdp"``.
      TypeError: bits or a block that are not ints.
    """
    # A matmul format (a preset name or an fp8 recipe) instead of bits: FSDP's kernels gathered in it.
    gather_format = _wire_matmul.check_format(gather_bits, layout) if _wire_matmul.is_format(gather_bits) else None
    gather_bits = None if gather_format is not None else _check_bits(gather_bits, "gather_bits", GATHER_BITS)
    reduce_bits = _check_bits(reduce_bits, "reduce_bits", REDUCE_BITS)
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"wire_block must be an int (elements a float32 scale), got {type(block).__name__} {block!r}")
    if block <= 0 or block % 2:
        raise ValueError(f"wire_block must be a positive even int (4-bit codes pack two a byte), got {block!r}")
    if gather_bits is None and reduce_bits is None and gather_format is None:
        return None
    names = " and ".join(n for n, v in (("gather_bits", gather_bits if gather_format is None else gather_format),
                                        ("reduce_bits", reduce_bits)) if v is not None)
    if not layout.shards_state:
        raise ValueError(f"{names} quantize what the sharded layouts move over the data axis (weight gathers, "
                         f"gradient reduce-scatters); layout={layout.name!r} has neither: use layout='zero' or 'fsdp', "
                         "or leave the option None")
    if reduce_dtype is None:
        raise ValueError(f"{names} need the per-shard step, where jaxmp places the collectives itself; with "
                         "reduce_dtype=None XLA places them: pass reduce_dtype='float32' (the default)")
    return Wire(gather_bits, reduce_bits, int(block), gather_format)


def quantized_gather(piece: jax.Array, axis: str, dim: int, wire: Wire) -> jax.Array:
    """This device's slice all-gathered along ``dim`` as blockwise codes, dequantized to ``piece.dtype``.

    Each device quantizes its own slice (blocks inside it), the codes (uint8) and the float32
    scales are all-gathered, and every device dequantizes every piece the same way: the whole
    param, the same bits on every device. Call inside a ``shard_map`` over ``axis``.
    """
    grid = wire.gather_grid()
    assert grid is not None
    shape = tuple(piece.shape)
    codes, scales = grid.quantize(piece, signed=True)
    codes = jax.lax.all_gather(codes, axis)
    scales = jax.lax.all_gather(scales, axis)
    pieces = jax.vmap(lambda c, s: grid.dequantize(c, s, signed=True, shape=shape))(codes, scales)
    # (n, *shape) -> shape with dim n times longer: the pieces in device order along dim.
    pieces = jnp.moveaxis(pieces.astype(piece.dtype), 0, dim)
    return pieces.reshape(shape[:dim] + (-1,) + shape[dim + 1:])


def _exchange(rows: jax.Array, axis: str, grid: _formats.Grid) -> jax.Array:
    """Row ``j`` of this device's ``(n, m)`` float32 ``rows`` goes to device ``j``; returns the sum,
    in float32 and in device order, of the rows this device receives (``(m,)``)."""
    n, m = rows.shape
    # Taken on the raw values: a NaN or inf anywhere in what this device sends poisons every
    # scale it sends, so every receiving device's sum is NaN (the skip sees it everywhere).
    finite = jnp.all(jnp.isfinite(rows))
    codes, scales = jax.vmap(lambda r: grid.quantize(r, signed=True))(rows)
    scales = jnp.where(finite, scales, jnp.float32(jnp.nan))
    codes = jax.lax.all_to_all(codes, axis, 0, 0, tiled=True)
    scales = jax.lax.all_to_all(scales, axis, 0, 0, tiled=True)
    values = jax.vmap(lambda c, s: grid.dequantize(c, s, signed=True, shape=(m,)))(codes, scales)
    total = values[0]
    for j in range(1, n):  # a fixed order: the same sum on every run and backend
        total = total + values[j]
    return total


def quantized_reduce_scatter(ct: jax.Array, axis: str, dim: int, n: int, wire: Wire) -> jax.Array:
    """``psum_scatter(ct, axis, scatter_dimension=dim, tiled=True)`` over quantized pieces, in float32.

    Args:
      ct: this device's (unreduced) gradient, whole.
      axis: the data axis (inside a ``shard_map`` over it).
      dim: the dimension scattered over (``ct.shape[dim]`` divisible by ``n``).
      n: the devices on ``axis``.
      wire: the options (``reduce_bits``, ``block``).

    Returns:
      This device's slice of the sum over devices, float32.
    """
    grid = wire.reduce_grid()
    assert grid is not None
    shape = tuple(ct.shape)
    sliced = shape[:dim] + (shape[dim] // n,) + shape[dim + 1:]
    # (n, slice...) with the destination device first; each row is one destination's slice.
    rows = jnp.moveaxis(ct.astype(jnp.float32).reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1:]), dim, 0)
    total = _exchange(rows.reshape(n, -1), axis, grid)
    return total.reshape(sliced)


def _gather_invariant(x: jax.Array, axis: str) -> jax.Array:
    """``all_gather(x, axis, tiled=True)`` typed as the same on every device (what a ``psum``
    returns), as a replicated leaf's reduced gradient must be. JAX 0.10 has that gather only
    privately; without it, each device's piece placed in zeros and summed (an all-reduce: the
    same values, twice an all-gather's bytes)."""
    from jaxmp.engine._seams import internals

    gathered = internals.all_gather_invariant(x, axis, tiled=True)
    if gathered is not None:
        return gathered
    n = jax.lax.axis_size(axis)
    placed = jnp.zeros((n,) + x.shape, x.dtype).at[jax.lax.axis_index(axis)].set(x)
    return jax.lax.psum(placed, axis).reshape((-1,) + x.shape[1:])


def quantized_all_reduce(ct: jax.Array, axis: str, n: int, wire: Wire, out_dtype: Any = None) -> jax.Array:
    """``psum(ct, axis)`` as a quantized reduce-scatter of the flattened leaf (zero-padded to ``n``
    pieces) and an all-gather of the float32 sums cast to ``out_dtype`` (default ``ct.dtype``; the
    gradient's own dtype when ``ct`` is its float32 bucket): the same result on every device."""
    grid = wire.reduce_grid()
    assert grid is not None
    flat = ct.astype(jnp.float32).reshape(-1)
    m = -(-flat.size // n)
    flat = jnp.pad(flat, (0, n * m - flat.size))
    mine = _exchange(flat.reshape(n, m), axis, grid).astype(ct.dtype if out_dtype is None else out_dtype)
    return _gather_invariant(mine, axis)[:ct.size].reshape(ct.shape)
