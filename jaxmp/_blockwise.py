"""Blockwise quantization of optimizer moments: code maps, quantize, dequantize, 4-bit packing (pure jnp).

The scheme of bitsandbytes' 8-bit optimizers (arXiv:2110.02861) and torchao's 4-bit ones: a leaf is
cut into blocks of ``block`` consecutive elements (C order over the flattened leaf; kept in the
leaf's leading axes when its trailing axes are a whole number of blocks: `grid_axis`); each block keeps
one float32 ``absmax`` and each element the index of the map entry nearest ``x / absmax``. The maps
are sorted float32 tables in [-1, 1] (signed) or [0, 1] (non-negative): bitsandbytes' dynamic map
(a decimal exponent plus linear fractions: fine near 0, coarse near 1) for 8 bits and for a signed
4-bit leaf; torchao's zero-free linear map ``(i + 1) / 16`` for a non-negative 4-bit leaf (a second
moment rounded to 0 would make Adam divide by ``eps``). Private: jaxmp.lean's quantized moments
use it; docs/lean-recipes.md#8-bit-and-4-bit-moments says why.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _keys


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Grid:
    """How a quantized state cuts its leaves: ``bits`` a code, ``block`` elements an absmax.

    A static pytree node (no leaves; its values live in the tree's structure), so that a layout
    reading only an abstract state can keep each block on one device (`shard_aligned_axes`).
    """

    bits: int
    block: int


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' ``create_dynamic_map``: ``2**total_bits`` sorted float32 values.

    Exponent ``e`` (decades ``10**-(max_exponent_bits - 1)`` .. ``10**0``) holds ``2**e`` linear
    fractions (``2**(e + 1)`` unsigned: the sign bit becomes a fraction bit), the midpoints of
    ``linspace(0.1, 1)``; plus 0 and 1.
    """
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        bounds = np.linspace(0.1, 1, items, dtype=np.float32)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        scale = np.float32(10.0 ** (-(max_exponent_bits - 1) + i))
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    if additional > 0:
        bounds = np.linspace(0.1, 1, additional + 1, dtype=np.float32)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        scale = np.float32(10.0 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1))
        data += (scale * means).tolist()
        if signed:
            data += (-scale * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2 ** total_bits - len(data))
    return np.sort(np.asarray(data, np.float32))


def linear_map(bits: int = 4) -> np.ndarray:
    """torchao's zero-free non-negative map: ``(i + 1) / 2**bits`` for ``i < 2**bits``."""
    return (np.arange(1, 2 ** bits + 1, dtype=np.float32) / np.float32(2 ** bits)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def code_map(bits: int, signed: bool) -> np.ndarray:
    """The map of a leaf: dynamic for 8 bits; 4 bits: dynamic (3 exponent bits) signed, linear non-negative."""
    if bits == 8:
        return dynamic_map(signed, 7, 8)
    return dynamic_map(True, 3, 4) if signed else linear_map(4)


def _ordered(bits: np.ndarray) -> np.ndarray:
    """float32 bit patterns (int32) to integers in the floats' order (-0.0 just below +0.0)."""
    return bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))


@functools.lru_cache(maxsize=None)
def _search_table(table: tuple, side: str) -> tuple[int, int, int, np.ndarray]:
    """``(shift, first_bucket, steps, start)`` for `_count` over the sorted float32 ``table``.

    Floats in [-1, 1] are bucketed by the top bits of their ordered bit pattern (``>> shift``);
    ``start[b]`` counts the entries certainly counted for every value of bucket ``b`` and ``steps``
    bounds how many more a bucket holds. The coarsest bucketing with at most two entries per
    bucket keeps the table small (a few thousand int32) and the search to two compares.
    """
    values = np.asarray(table, np.float32)
    keys = _ordered(values.view(np.int32).astype(np.int64))
    lo_key, hi_key = (int(_ordered(np.asarray(v, np.float32).view(np.int32).astype(np.int64))) for v in (-1.0, 1.0))
    for shift in range(23, 9, -1):  # down to 2**14 buckets per sign
        buckets = np.arange(lo_key >> shift, (hi_key >> shift) + 1, dtype=np.int64)
        # Entries whose key is below the bucket's first key are below (side="right": at most)
        # every value of the bucket. The compares then walk the bucket's own entries; one more
        # compare reaches a +0.0 entry from -0.0 (the next key, yet equal).
        start = np.searchsorted(keys, buckets << shift, side="left")
        stop = np.searchsorted(keys, (buckets + 1) << shift, side="left")
        steps = max(int((stop - start).max()), int((values == 0).any()))
        if steps <= 2:
            return shift, int(buckets[0]), steps, start.astype(np.int32)
    raise ValueError("a code map with more than two entries within 2**-13 of each other")


def _count(x: jax.Array, table: np.ndarray, side: str) -> jax.Array:
    """``jnp.searchsorted(table, x, side)`` for ``x`` in [-1, 1], as one elementwise pass.

    XLA runs ``searchsorted``'s binary search as eight passes over ``x`` (and ``method=
    "compare_all"`` as a 255-wide temporary per element); this is a bucket lookup on ``x``'s
    bits plus at most two exact compares against ``table``, which XLA fuses into one loop: the
    quantized update reads and writes each element once. Bitwise the same counts.
    """
    shift, first, steps, start = _search_table(tuple(float(v) for v in table), side)
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    bucket = (_ordered_jnp(bits) >> shift) - first
    count = jnp.asarray(start)[jnp.clip(bucket, 0, start.size - 1)]
    padded = jnp.asarray(np.append(np.asarray(table, np.float32), np.float32(np.inf)))
    for _ in range(steps):
        entry = padded[count]
        count = count + ((x > entry) if side == "left" else (x >= entry)).astype(count.dtype)
    return count


def _ordered_jnp(bits: jax.Array) -> jax.Array:
    return bits ^ ((bits >> 31) & jnp.int32(0x7FFFFFFF))


def n_blocks(size: int, block: int) -> int:
    return -(-size // block)


def grid_axis(shape: tuple, bits: int, block: int) -> int | None:
    """The first axis of the slabs a leaf's blocks tile: the largest ``k`` for which
    ``shape[k:]`` is a whole number of blocks (and, at 4 bits, the last axis even, so the codes
    pack within it); None when the leaf is no whole number of blocks (flattened, the last block
    zero-padded). The blocks are the C-order blocks of the flattened leaf either way, cut at the
    same places; kept in the leaf's leading axes, ``shape[:k]``, they stay whole when any of
    those axes is split over devices (`shard_aligned_axes`). ``k = ndim - 1``: rows of the last
    axis (every GPT-2 matrix at block 256)."""
    shape = tuple(shape)
    if not shape or (bits == 4 and shape[-1] % 2):
        return None
    for k in range(len(shape) - 1, -1, -1):
        if int(np.prod(shape[k:], dtype=np.int64)) % block == 0:
            return k
    return None


def scales_shape(shape: tuple, bits: int, block: int) -> tuple:
    """The absmax's shape: ``shape[:k] + (blocks a slab,)`` (``k``: `grid_axis`), else
    ``(n_blocks(size, block),)``: one float32 a block, in C order either way."""
    shape = tuple(shape)
    k = grid_axis(shape, bits, block)
    if k is not None:
        return shape[:k] + (int(np.prod(shape[k:], dtype=np.int64)) // block,)
    return (n_blocks(int(np.prod(shape, dtype=np.int64)), block),)


def shard_aligned_axes(shape: tuple, bits: int, block: int, n: int) -> tuple:
    """The axes of a ``shape`` leaf that can be split ``n`` ways with every block (and the 4-bit
    byte holding two codes) on one device: those before `grid_axis`'s ``k`` that ``n`` divides,
    and ``k`` itself when each device's part of a slab is a whole number of blocks. A leaf with
    no ``k`` has none. ZeRO and FSDP split a quantized leaf on one of these (`jaxmp.parallel`'s
    layouts)."""
    shape = tuple(shape)
    if not shape or n <= 1:
        return tuple(range(len(shape)))
    k = grid_axis(shape, bits, block)
    if k is None:
        return ()
    part = int(np.prod(shape[k + 1:], dtype=np.int64))
    return tuple(d for d in range(k) if shape[d] % n == 0) + (
        (k,) if shape[k] % n == 0 and (shape[k] // n * part) % block == 0 else ())


def codes_shape(shape: tuple, bits: int) -> tuple:
    """The stored codes' shape: the leaf's for 8 bits; 4 bits: two a byte, the last axis halved when
    it is even (so a leaf split on another axis keeps its split), else flat."""
    if bits == 8:
        return tuple(shape)
    size = int(np.prod(shape, dtype=np.int64))
    if len(shape) >= 1 and shape[-1] % 2 == 0:
        return tuple(shape[:-1]) + (shape[-1] // 2,)
    return (-(-size // 2),)


def _blocks(x: jax.Array, bits: int, block: int) -> jax.Array:
    """``x`` in float32 as blocks: ``shape[:k] + (n, block)`` (``k``: `grid_axis`), else flattened
    and zero-padded to ``(n_blocks, block)``. A partial last block is padded with zeros, which
    change no absmax; the padding is never stored."""
    k = grid_axis(x.shape, bits, block)
    if k is not None:
        return x.astype(jnp.float32).reshape(scales_shape(x.shape, bits, block) + (block,))
    flat = x.astype(jnp.float32).reshape(-1)
    pad = n_blocks(flat.size, block) * block - flat.size
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(-1, block)


def quantize(x: jax.Array, bits: int, signed: bool, block: int, key: jax.Array | None = None,
             offset: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array]:
    """``(codes, absmax)``: uint8 codes (``codes_shape``) and float32 scales (``scales_shape``) of ``x``.

    ``key`` None rounds ``x / absmax`` to the nearest map entry; a PRNG key rounds stochastically
    between the two entries around it (up with probability equal to the distance: unbiased
    inside the map's range). An all-zero block stores absmax 0 (it dequantizes to exact zeros).
    ``offset``: ``x`` is the slice of a larger leaf that starts at that C-order element (at a block
    boundary), and its stochastic rounding draws that leaf's bits (`jaxmp._keys.random_bits`).
    """
    qmap = jnp.asarray(code_map(bits, signed))
    rows = grid_axis(x.shape, bits, block) is not None
    blocks = _blocks(x, bits, block)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    normed = blocks / jnp.where(absmax > 0, absmax, jnp.float32(1))[..., None]
    # The block's largest element is +-1 exactly (the map's end): XLA may divide by multiplying
    # with the reciprocal once the search is fused in, which leaves 1 - 2**-24.
    normed = jnp.where(jnp.abs(blocks) == absmax[..., None], jnp.sign(blocks), normed)
    if key is None:
        # Nearest entry: the number of midpoints below the value (ties to the lower entry).
        mids = (code_map(bits, signed)[:-1] + code_map(bits, signed)[1:]) / np.float32(2)
        codes = _count(normed, mids, "left")
    else:
        lo = jnp.clip(_count(normed, code_map(bits, signed), "right") - 1, 0, qmap.size - 2)
        below, above = qmap[lo], qmap[lo + 1]
        p = jnp.clip((normed - below) / (above - below), 0, 1)
        # The uniforms of the flattened leaf's C order, whatever the blocks' shape.
        codes = lo + (_keys.uniform(key, normed.shape, offset) < p)
    codes = codes.astype(jnp.uint8)
    if rows:
        # Reshapes within the slabs only, so a split of a leading axis stays where it is.
        if bits == 8:
            return codes.reshape(x.shape), absmax
        pairs = codes.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
        return pairs[..., 0] | (pairs[..., 1] << 4), absmax
    codes = codes.reshape(-1)
    size = int(np.prod(x.shape, dtype=np.int64))
    if bits == 8:
        return codes[:size].reshape(x.shape), absmax
    codes = codes[:2 * (-(-size // 2))]
    if codes.size % 2:  # block is odd and so is size: one more (ignored) code
        codes = jnp.pad(codes, (0, 1))
    packed = codes[0::2] | (codes[1::2] << 4)
    return packed.reshape(codes_shape(x.shape, bits)), absmax


def dequantize(codes: jax.Array, absmax: jax.Array, bits: int, signed: bool, block: int, shape: tuple
               ) -> jax.Array:
    """The float32 leaf of ``shape`` that ``(codes, absmax)`` hold: ``map[code] * absmax[block]``."""
    qmap = jnp.asarray(code_map(bits, signed))
    shape = tuple(shape)
    if grid_axis(shape, bits, block) is not None:
        if bits == 4:
            codes = jnp.stack([codes & 15, codes >> 4], axis=-1)
        index = codes.reshape(scales_shape(shape, bits, block) + (block,)).astype(jnp.int32)
        return (qmap[index] * absmax[..., None]).reshape(shape)
    size = int(np.prod(shape, dtype=np.int64))
    flat = codes.reshape(-1)
    if bits == 4:
        flat = jnp.stack([flat & 15, flat >> 4], axis=-1).reshape(-1)
    flat = flat[:size]
    pad = absmax.shape[0] * block - size
    if pad:
        flat = jnp.pad(flat, (0, pad))
    values = qmap[flat.astype(jnp.int32)].reshape(-1, block) * absmax[:, None]
    return values.reshape(-1)[:size].reshape(shape)
