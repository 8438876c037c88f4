"""Lean's code-map quantizer of optimizer moments: the maps, and `Grid`, which quantizes, dequantizes and packs 4-bit codes.

The scheme of bitsandbytes' 8-bit optimizers (arXiv:2110.02861) and torchao's 4-bit ones: a leaf is
cut into blocks of ``block`` consecutive elements (C order over the flattened leaf; kept in the
leaf's leading axes when its trailing axes are a whole number of blocks: `Grid.axis`); each block keeps
one float32 ``absmax`` and each element the index of the map entry nearest ``x / absmax``. The maps
are sorted float32 tables in [-1, 1] (signed) or [0, 1] (non-negative), bit for bit bitsandbytes'
and torchao's: the dynamic map (a decimal exponent plus linear fractions: fine near 0, coarse near
1) for 8 bits and for a signed 4-bit leaf; torchao's zero-free linear map ``(i + 1) / 16`` for a
non-negative 4-bit leaf (a second moment rounded to 0 would make Adam divide by ``eps``). The format
is a value, `Grid` (bits, block), whose methods quantize, dequantize and shape a leaf. `CODE_MAPS`
is the one table of which map a (bits, sign) stores. Private: jaxmp.lean's quantized moments use it
(and the sharded layouts' quantized collectives may); docs/lean-recipes.md#8-bit-and-4-bit-moments
says why.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _keys


def _table(hex_bits: str) -> np.ndarray:
    """A sorted float32 table from its bit patterns (hex, space separated)."""
    table = np.array([int(h, 16) for h in hex_bits.split()], np.uint32).view(np.float32)
    table.setflags(write=False)
    return table


# bitsandbytes' ``create_dynamic_map`` as bitsandbytes 0.50 and torchao 0.18 compute it, bit for
# bit (the bit patterns of ``torch.tensor(create_dynamic_map(...), dtype=torch.float32)``; checked
# against both in tests/lean/test_lean_reference.py): a decimal exponent (decades 1e-6 .. 1 at 8
# bits, 1e-2 .. 1 at 4) and linear fractions, the midpoints of ``torch.linspace(0.1, 1, n)``; plus
# 0 and 1. Committed as literals because the points are those of torch.linspace's and torch's
# float32 arithmetic: NumPy's float32 linspace and midpoints put 22 signed and 26 unsigned 8-bit
# entries a float32 ulp away (jaxmp's maps of revision 1, `MAP_REVISION`). Unsigned: the sign
# bit is one more fraction bit.
_MAP_8_SIGNED = _table(
    "bf7e3333 bf7a999a bf770000 bf736666 bf6fcccd bf6c3333 bf68999a bf650000 bf616666 bf5dcccd bf5a3333 "
    "bf56999a bf530000 bf4f6666 bf4bcccd bf483333 bf44999a bf410000 bf3d6666 bf39cccd bf363334 bf32999a "
    "bf2f0000 bf2b6666 bf27cccd bf243334 bf20999a bf1d0000 bf196666 bf15cccd bf123334 bf0e999a bf0b0000 "
    "bf076666 bf03cccc bf003333 bef93332 bef20000 beeacccc bee3999a bedc6666 bed53333 bece0000 bec6cccc "
    "bebf999a beb86666 beb13333 beaa0000 bea2cccc be9b999a be946666 be8d3334 be860000 be7d9999 be6f3333 "
    "be60cccd be526666 be440000 be35999a be273333 be18cccd be0a6666 bdf80000 bddb3334 bdc9eb85 bdc428f7 "
    "bdbe6667 bdb8a3d7 bdb2e148 bdad1eb8 bda75c2a bda1999a bd9bd70a bd96147b bd9051eb bd8a8f5d bd84cccd "
    "bd7e147b bd728f5d bd670a3d bd5b851f bd500000 bd447ae1 bd38f5c3 bd2d70a3 bd21eb85 bd166667 bd0ae148 "
    "bcfeb852 bce7ae15 bcd0a3d7 bcb9999a bca28f5d bc8b851f bc68f5c3 bc3ae148 bc1f3b64 bc160418 bc0ccccd "
    "bc039581 bbf4bc6a bbe24dd3 bbcfdf3b bbbd70a4 bbab020d bb989374 bb8624dd bb676c8a bb428f5c bb1db22d "
    "baf1a9fc baa7ef9d ba7765ff ba59e83e ba3c6a80 ba1eecc1 ba016f01 b9c7e283 b98ce705 b923d70b b8ba1f4b "
    "b88aefb3 b8378034 b7b24206 b70205ff b65a1a94 b513a3b7 00000000 3513a3b7 365a1a94 370205ff 37b24206 "
    "38378034 388aefb3 38ba1f4b 3923d70b 398ce705 39c7e283 3a016f01 3a1eecc1 3a3c6a80 3a59e83e 3a7765ff "
    "3aa7ef9d 3af1a9fc 3b1db22d 3b428f5c 3b676c8a 3b8624dd 3b989374 3bab020d 3bbd70a4 3bcfdf3b 3be24dd3 "
    "3bf4bc6a 3c039581 3c0ccccd 3c160418 3c1f3b64 3c3ae148 3c68f5c3 3c8b851f 3ca28f5d 3cb9999a 3cd0a3d7 "
    "3ce7ae15 3cfeb852 3d0ae148 3d166667 3d21eb85 3d2d70a3 3d38f5c3 3d447ae1 3d500000 3d5b851f 3d670a3d "
    "3d728f5d 3d7e147b 3d84cccd 3d8a8f5d 3d9051eb 3d96147b 3d9bd70a 3da1999a 3da75c2a 3dad1eb8 3db2e148 "
    "3db8a3d7 3dbe6667 3dc428f7 3dc9eb85 3ddb3334 3df80000 3e0a6666 3e18cccd 3e273333 3e35999a 3e440000 "
    "3e526666 3e60cccd 3e6f3333 3e7d9999 3e860000 3e8d3334 3e946666 3e9b999a 3ea2cccc 3eaa0000 3eb13333 "
    "3eb86666 3ebf999a 3ec6cccc 3ece0000 3ed53333 3edc6666 3ee3999a 3eeacccc 3ef20000 3ef93332 3f003333 "
    "3f03cccc 3f076666 3f0b0000 3f0e999a 3f123334 3f15cccd 3f196666 3f1d0000 3f20999a 3f243334 3f27cccd "
    "3f2b6666 3f2f0000 3f32999a 3f363334 3f39cccd 3f3d6666 3f410000 3f44999a 3f483333 3f4bcccd 3f4f6666 "
    "3f530000 3f56999a 3f5a3333 3f5dcccd 3f616666 3f650000 3f68999a 3f6c3333 3f6fcccd 3f736666 3f770000 "
    "3f7a999a 3f7e3333 3f800000")
_MAP_8_UNSIGNED = _table(
    "00000000 34ae7baa 35500998 360e9b38 3692ccf6 36de4c51 3714e5d5 3783126e 37e171a0 381fe868 384f1800 "
    "387e479a 3896bb99 38ae5364 38c5eb31 3906594b 394154ca 397c5049 399ba5e4 39b923a2 39d6a163 39f41f22 "
    "3a08ce71 3a178d50 3a264c30 3a350b10 3a43c9ef 3a5288d0 3a6147af 3a70068e 3a7ec56e 3a958106 3aba5e35 "
    "3adf3b64 3b020c4a 3b147ae1 3b26e978 3b395810 3b4bc6a7 3b5e3540 3b70a3d7 3b818937 3b8ac082 3b93f7cf "
    "3b9d2f1a 3ba66666 3baf9db2 3bb8d4fd 3bc20c4a 3bcb4395 3bd47ae1 3bddb22e 3be6e978 3bf020c5 3bf9580f "
    "3c0147ae 3c05e354 3c0a7ef9 3c0f1aa0 3c13b645 3c1851eb 3c1ced92 3c218937 3c2f5c2a 3c466667 3c5d70a3 "
    "3c747ae2 3c85c28f 3c9147af 3c9ccccd 3ca851eb 3cb3d70b 3cbf5c29 3ccae147 3cd66667 3ce1eb87 3ced70a3 "
    "3cf8f5c3 3d023d70 3d080000 3d0dc28f 3d13851f 3d1947af 3d1f0a3d 3d24cccd 3d2a8f5c 3d3051eb 3d36147b "
    "3d3bd70a 3d41999a 3d475c28 3d4d1eb8 3d52e147 3d58a3d7 3d5e6667 3d6428f7 3d69eb87 3d6fae15 3d7570a3 "
    "3d7b3333 3d807ae2 3d835c2a 3d863d71 3d891eb8 3d8c0000 3d8ee148 3d91c290 3d94a3d7 3d97851f 3d9a6667 "
    "3d9d47af 3da028f6 3da30a3e 3da5eb85 3da8cccd 3dabae15 3dae8f5c 3db170a4 3db451eb 3db73333 3dba147b "
    "3dbcf5c3 3dbfd70b 3dc2b852 3dc5999a 3dc87ae2 3dcb5c29 3dd40000 3de26666 3df0cccd 3dff3333 3e06cccc "
    "3e0e0000 3e153334 3e1c6666 3e23999a 3e2acccc 3e320000 3e393334 3e406666 3e47999a 3e4ecccc 3e560000 "
    "3e5d3334 3e646666 3e6b999a 3e72cccc 3e7a0000 3e809999 3e843333 3e87cccd 3e8b6666 3e8f0000 3e92999a "
    "3e963333 3e99cccc 3e9d6666 3ea10000 3ea4999a 3ea83333 3eabcccc 3eaf6666 3eb30000 3eb6999a 3eba3333 "
    "3ebdcccc 3ec16666 3ec50000 3ec8999a 3ecc3333 3ecfcccc 3ed36666 3ed70000 3eda999a 3ede3333 3ee1cccc "
    "3ee56666 3ee90000 3eec999a 3ef03333 3ef3cccc 3ef76666 3efb0000 3efe9999 3f01199a 3f02e666 3f04b333 "
    "3f068000 3f084ccc 3f0a199a 3f0be666 3f0db334 3f0f8000 3f114ccd 3f13199a 3f14e666 3f16b334 3f188000 "
    "3f1a4ccd 3f1c199a 3f1de666 3f1fb334 3f218000 3f234ccd 3f25199a 3f26e666 3f28b334 3f2a8000 3f2c4ccd "
    "3f2e199a 3f2fe666 3f31b334 3f338000 3f354ccd 3f37199a 3f38e666 3f3ab334 3f3c8000 3f3e4ccd 3f40199a "
    "3f41e666 3f43b334 3f458000 3f474ccc 3f49199a 3f4ae666 3f4cb334 3f4e8000 3f504ccc 3f52199a 3f53e666 "
    "3f55b334 3f578000 3f594ccc 3f5b199a 3f5ce666 3f5eb334 3f608000 3f624ccc 3f64199a 3f65e666 3f67b334 "
    "3f698000 3f6b4ccc 3f6d199a 3f6ee666 3f70b334 3f728000 3f744ccc 3f76199a 3f77e666 3f79b334 3f7b8000 "
    "3f7d4ccc 3f7f199a 3f800000")
_MAP_4_SIGNED = _table(
    "bf633333 bf29999a bee00000 be599999 bd9eb852 bd051eb9 bbb43958 00000000 3bb43958 3d051eb9 3d9eb852 "
    "3e599999 3ee00000 3f29999a 3f633333 3f800000")

#: The revision of the maps above, recorded in every quantized state
#: (`jaxmp.lean.QuantizedMomentsState.map_revision`). 1: jaxmp's first maps, NumPy-derived (the
#: 8-bit ones a float32 ulp off the peers' at 22 signed and 26 unsigned entries); 2: the peers'.
MAP_REVISION = 2


def linear_map(bits: int = 4) -> np.ndarray:
    """torchao's zero-free non-negative map: ``(i + 1) / 2**bits`` for ``i < 2**bits``."""
    return (np.arange(1, 2 ** bits + 1, dtype=np.float32) / np.float32(2 ** bits)).astype(np.float32)


_LINEAR_4 = linear_map(4)
_LINEAR_4.setflags(write=False)

CODE_MAPS: dict[tuple[int, bool], np.ndarray] = {
    (8, True): _MAP_8_SIGNED,     # bitsandbytes' create_dynamic_map(signed=True)
    (8, False): _MAP_8_UNSIGNED,  # create_dynamic_map(signed=False): the sign bit one more fraction bit
    (4, True): _MAP_4_SIGNED,     # the dynamic map with 3 exponent bits: torchao's AdamW4bit first moment
    (4, False): _LINEAR_4,        # zero-free (i + 1) / 16: its second moment never rounds to 0
}
"""The map a leaf of ``(bits, signed)`` stores indices into: the one table of lean's formats."""
CODE_BITS = tuple(sorted({bits for bits, _ in CODE_MAPS}, reverse=True))
"""The code widths a quantized state may have: (8, 4)."""


def code_map(bits: int, signed: bool) -> np.ndarray:
    """The map of a leaf, bit for bit bitsandbytes' and torchao's (`CODE_MAPS`): the dynamic map
    at 8 bits (signed or unsigned: ``create_dynamic_map(signed)``); at 4 bits the dynamic map with 3
    exponent bits (signed: torchao's ``AdamW4bit`` first moment) or the zero-free linear map
    ``(i + 1) / 16`` (non-negative: its second moment)."""
    return CODE_MAPS[bits, bool(signed)]


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


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Grid:
    """How a quantized state cuts its leaves: ``bits`` a code, ``block`` elements an absmax.

    The format as a value that does its own work: the shapes of a leaf's codes and absmax, the
    axes a layout may split it on, quantizing and dequantizing. A static pytree node (no
    leaves; its values live in the tree's structure), so that a layout reading only an abstract
    state can keep each block on one device (`aligned_axes`).

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxmp
      >>> grid = jaxmp._formats.Grid(bits=8, block=256)
      >>> codes, absmax = grid.quantize(jnp.ones((4, 512)), signed=True)
      >>> codes.shape, absmax.shape == grid.absmax_shape((4, 512))
      ((4, 512), True)
    """

    bits: int
    block: int

    @property
    def codes_per_byte(self) -> int:
        """Codes a stored byte: 2 at 4 bits (packed), else 1."""
        return 2 if self.bits == 4 else 1

    def code_map(self, signed: bool) -> np.ndarray:
        """The map of a leaf of this grid's bits (`code_map`)."""
        return code_map(self.bits, signed)

    def n_blocks(self, size: int) -> int:
        """Blocks of a flattened leaf of ``size`` elements (a partial last one included)."""
        return -(-size // self.block)

    def axis(self, shape: tuple) -> int | None:
        """The first axis of the slabs a leaf's blocks tile: the largest ``k`` for which
        ``shape[k:]`` is a whole number of blocks (and, at 4 bits, the last axis even, so the
        codes pack within it); None when the leaf is no whole number of blocks (flattened, the
        last block zero-padded). The blocks are the C-order blocks of the flattened leaf either
        way, cut at the same places; kept in the leaf's leading axes, ``shape[:k]``, they stay
        whole when any of those axes is split over devices (`aligned_axes`). ``k = ndim - 1``:
        rows of the last axis (every GPT-2 matrix at block 256)."""
        shape = tuple(shape)
        if not shape or (self.bits == 4 and shape[-1] % 2):
            return None
        for k in range(len(shape) - 1, -1, -1):
            if int(np.prod(shape[k:], dtype=np.int64)) % self.block == 0:
                return k
        return None

    def absmax_shape(self, shape: tuple) -> tuple:
        """The absmax's shape: ``shape[:k] + (blocks a slab,)`` (``k``: `axis`), else
        ``(n_blocks(size),)``: one float32 a block, in C order either way."""
        shape = tuple(shape)
        k = self.axis(shape)
        if k is not None:
            return shape[:k] + (int(np.prod(shape[k:], dtype=np.int64)) // self.block,)
        return (self.n_blocks(int(np.prod(shape, dtype=np.int64))),)

    def codes_shape(self, shape: tuple) -> tuple:
        """The stored codes' shape: the leaf's for 8 bits; 4 bits: two a byte, the last axis
        halved when it is even (so a leaf split on another axis keeps its split), else flat."""
        if self.bits == 8:
            return tuple(shape)
        size = int(np.prod(shape, dtype=np.int64))
        if len(shape) >= 1 and shape[-1] % 2 == 0:
            return tuple(shape[:-1]) + (shape[-1] // 2,)
        return (-(-size // 2),)

    def aligned_axes(self, shape: tuple, n: int) -> tuple:
        """The axes of a ``shape`` leaf that can be split ``n`` ways with every block (and the
        4-bit byte holding two codes) on one device: those before `axis`'s ``k`` that ``n``
        divides, and ``k`` itself when each device's part of a slab is a whole number of blocks.
        A leaf with no ``k`` has none. ZeRO and FSDP split a quantized leaf on one of these
        (`jaxmp.parallel`'s layouts, through the state's ``split_axes``)."""
        shape = tuple(shape)
        if not shape or n <= 1:
            return tuple(range(len(shape)))
        k = self.axis(shape)
        if k is None:
            return ()
        part = int(np.prod(shape[k + 1:], dtype=np.int64))
        # At 4 bits the last axis is stored halved (two codes a byte, `codes_shape`): split there,
        # each device's part of it must hold whole bytes, else the codes' axis does not divide by n
        # (a block of 5 on a 40-wide row: 5 codes a device, 20 bytes a row over 8 devices).
        whole_bytes = self.bits != 4 or k != len(shape) - 1 or (shape[k] // n) % 2 == 0
        return tuple(d for d in range(k) if shape[d] % n == 0) + (
            (k,) if shape[k] % n == 0 and (shape[k] // n * part) % self.block == 0 and whole_bytes else ())

    def _blocks(self, x: jax.Array) -> jax.Array:
        """``x`` in float32 as blocks: ``shape[:k] + (n, block)`` (``k``: `axis`), else flattened
        and zero-padded to ``(n_blocks, block)``. A partial last block is padded with zeros,
        which change no absmax; the padding is never stored."""
        if self.axis(x.shape) is not None:
            return x.astype(jnp.float32).reshape(self.absmax_shape(x.shape) + (self.block,))
        flat = x.astype(jnp.float32).reshape(-1)
        pad = self.n_blocks(flat.size) * self.block - flat.size
        if pad:
            flat = jnp.pad(flat, (0, pad))
        return flat.reshape(-1, self.block)

    def quantize(self, x: jax.Array, signed: bool, key: jax.Array | None = None,
                 offset: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array]:
        """``(codes, absmax)``: uint8 codes (`codes_shape`) and float32 scales (`absmax_shape`) of ``x``.

        Args:
          x: the leaf (any floating dtype; quantized from its float32 values).
          signed: the map's sign (`code_map`).
          key: None rounds ``x / absmax`` to the nearest map entry; a PRNG key rounds
            stochastically between the two entries around it (up with probability equal to the
            distance: unbiased inside the map's range).
          offset: ``x`` is the slice of a larger leaf that starts at that C-order element (at a
            block boundary), and its stochastic rounding draws that leaf's bits
            (`jaxmp._keys.random_bits`).

        Returns:
          The codes and the absmax. An all-zero block stores absmax 0 (it dequantizes to exact
          zeros); a block with a NaN or an infinity stores absmax NaN (it dequantizes to NaN).

        Example:
          >>> import jax.numpy as jnp
          >>> import jaxmp
          >>> codes, absmax = jaxmp._formats.Grid(4, 128).quantize(jnp.ones(256), signed=False)
          >>> codes.shape, absmax.shape
          ((128,), (2,))
        """
        qmap = jnp.asarray(self.code_map(signed))
        blocks = self._blocks(x)
        # A block holding a NaN or an infinity stores a NaN absmax, so it decodes to NaN and a check of
        # the state sees it (as the block-scaled fp8 quantizer does). Explicitly: XLA:CPU's vectorized
        # row max can drop a NaN. Its codes are those of zeros.
        bad = jnp.any(~jnp.isfinite(blocks), axis=-1)
        absmax = jnp.where(bad, jnp.float32(jnp.nan), jnp.max(jnp.abs(blocks), axis=-1))
        blocks = jnp.where(bad[..., None], jnp.float32(0), blocks)
        normed = blocks / jnp.where(absmax > 0, absmax, jnp.float32(1))[..., None]
        # The block's largest element is +-1 exactly (the map's end): XLA may divide by multiplying
        # with the reciprocal once the search is fused in, which leaves 1 - 2**-24.
        normed = jnp.where(jnp.abs(blocks) == absmax[..., None], jnp.sign(blocks), normed)
        if key is None:
            # Nearest entry: the number of midpoints below the value (ties to the lower entry).
            mids = (self.code_map(signed)[:-1] + self.code_map(signed)[1:]) / np.float32(2)
            codes = _count(normed, mids, "left")
        else:
            lo = jnp.clip(_count(normed, self.code_map(signed), "right") - 1, 0, qmap.size - 2)
            below, above = qmap[lo], qmap[lo + 1]
            p = jnp.clip((normed - below) / (above - below), 0, 1)
            # The uniforms of the flattened leaf's C order, whatever the blocks' shape.
            codes = lo + (_keys.uniform(key, normed.shape, offset) < p)
        return self._store(codes.astype(jnp.uint8), tuple(x.shape)), absmax

    def _store(self, codes: jax.Array, shape: tuple) -> jax.Array:
        """The codes of a ``shape`` leaf's blocks (``_blocks``' shape) as stored (`codes_shape`)."""
        if self.axis(shape) is not None:
            # Reshapes within the slabs only, so a split of a leading axis stays where it is.
            if self.bits == 8:
                return codes.reshape(shape)
            pairs = codes.reshape(shape[:-1] + (shape[-1] // 2, 2))
            return pairs[..., 0] | (pairs[..., 1] << 4)
        codes = codes.reshape(-1)
        size = int(np.prod(shape, dtype=np.int64))
        if self.bits == 8:
            return codes[:size].reshape(shape)
        codes = codes[:2 * (-(-size // 2))]
        if codes.size % 2:  # block is odd and so is size: one more (ignored) code
            codes = jnp.pad(codes, (0, 1))
        packed = codes[0::2] | (codes[1::2] << 4)
        return packed.reshape(self.codes_shape(shape))

    def dequantize(self, codes: jax.Array, absmax: jax.Array, signed: bool, shape: tuple) -> jax.Array:
        """The float32 leaf of ``shape`` that ``(codes, absmax)`` hold: ``map[code] * absmax[block]``.

        Args:
          codes, absmax: what `quantize` returned for a ``shape`` leaf.
          signed: the map's sign the codes index.
          shape: the leaf's shape.

        Returns:
          The float32 leaf.

        Example:
          >>> import jax.numpy as jnp
          >>> import jaxmp
          >>> grid = jaxmp._formats.Grid(8, 256)
          >>> codes, absmax = grid.quantize(jnp.ones(300), signed=True)
          >>> grid.dequantize(codes, absmax, signed=True, shape=(300,)).sum()
          Array(300., dtype=float32)
        """
        qmap = jnp.asarray(self.code_map(signed))
        shape = tuple(shape)
        if self.axis(shape) is not None:
            if self.bits == 4:
                codes = jnp.stack([codes & 15, codes >> 4], axis=-1)
            index = codes.reshape(self.absmax_shape(shape) + (self.block,)).astype(jnp.int32)
            return (qmap[index] * absmax[..., None]).reshape(shape)
        size = int(np.prod(shape, dtype=np.int64))
        flat = codes.reshape(-1)
        if self.bits == 4:
            flat = jnp.stack([flat & 15, flat >> 4], axis=-1).reshape(-1)
        flat = flat[:size]
        pad = absmax.shape[0] * self.block - size
        if pad:
            flat = jnp.pad(flat, (0, pad))
        values = qmap[flat.astype(jnp.int32)].reshape(-1, self.block) * absmax[:, None]
        return values.reshape(-1)[:size].reshape(shape)
