"""The stochastic-rounding keys of jaxmp.lean's recipes: an int seed or a threefry2x32 key stored as raw
uint32[2] data in the optimizer state, folded with the update count and the leaf's index; and their
random bits, those of ``jax.random.bits`` written as elementwise jnp so that XLA fuses them.

Private: jaxmp.lean, its quantized moments and jaxmp.fp8's stochastic rounding share it
(threefry2x32: its bits do not depend on sharding).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

IMPL = "threefry2x32"


def key_data(key: Any, what: str) -> jax.Array:
    """``key`` (an int seed, a threefry2x32 key, or its raw uint32[2] data) as raw uint32[2] data."""
    if key is None:
        raise TypeError(f"{what} rounds stochastically and needs key=: an int seed or a jax.random.key(...) "
                        "(threefry2x32); it is stored in the optimizer state and checkpointed with it")
    if isinstance(key, (bool, np.bool_)):
        raise TypeError(f"{what}: key must be an int seed or a threefry2x32 PRNG key, got the bool {key}")
    if isinstance(key, (int, np.integer)):
        # With x64 off jax.random.key keeps only the low 32 bits of a seed: 2**40 would draw the
        # same rounding stream as 0, silently, so a seed must fit in 32 bits.
        if not -2**31 <= int(key) < 2**32:
            raise ValueError(f"{what}: an int seed must fit in 32 bits (-2**31 <= key < 2**32), got {int(key)}; "
                             "jax.random.key keeps only the low 32 bits with x64 off, so it would repeat the stream "
                             f"of seed {int(key) % 2**32}: pass a smaller seed or a jax.random.key(...)")
        return jax.random.key_data(jax.random.key(int(key), impl=IMPL))
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(key))
        if impl != IMPL:
            raise ValueError(f"{what}: key must be a threefry2x32 key (its bits do not depend on sharding), got a "
                             f"{impl} key; make it with jax.random.key(seed, impl='threefry2x32')")
        if jnp.shape(key) != ():
            raise ValueError(f"{what}: key must be a single key, got a key array of shape {jnp.shape(key)}")
        return jax.random.key_data(key)
    if dtype is not None and np.dtype(dtype) == np.uint32 and jnp.shape(key) == (2,):
        return jnp.asarray(key)
    raise TypeError(f"{what}: key must be an int seed, a jax.random.key(...) or raw uint32[2] key data, got "
                    f"{type(key).__name__}{'' if dtype is None else f' of dtype {dtype} and shape {jnp.shape(key)}'}")


def as_key(key: Any) -> jax.Array:
    if getattr(key, "dtype", None) is not None and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key_data(key, "stochastic_round"), impl=IMPL)


def leaf_keys(key_data: jax.Array, count: jax.Array, n: int) -> list:
    step = jax.random.fold_in(jax.random.wrap_key_data(key_data, impl=IMPL), count)
    return [jax.random.fold_in(step, i) for i in range(n)]


# --------------------------------------------------------------------------- fused random bits

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x: jax.Array, d: int) -> jax.Array:
    return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def _threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 (20 rounds) unrolled in jnp: the hash of JAX's ``threefry2x32`` primitive, bit for bit."""
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ _rotl(x[1], r)
        x = [x[0] + ks[(i + 1) % 3], x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)]
    return x[0], x[1]


def random_bits(key: jax.Array, shape: tuple, offset: jax.Array | int | None = None) -> jax.Array:
    """``jax.random.bits(key, shape, jnp.uint32)`` for a threefry2x32 key, bit for bit, as elementwise jnp.

    Why not ``jax.random.bits`` itself: JAX lowers threefry on the CPU as a rolled loop and on the
    GPU as a kernel, and either way each call materializes its uint32 bits (and on the CPU two
    loop carries): 4 to 8 bytes an element for every stochastically rounded leaf, all live in an
    optimizer update at once. Written as jnp ops on the element's index, XLA fuses the hash into
    the op that consumes the bits, so stochastic rounding costs no memory. With
    ``jax_threefry_partitionable`` off (its counters differ) or 2**32 elements or more, this
    falls back to ``jax.random.bits``.

    ``offset`` (an int or a traced uint32/int32 scalar): the bits of elements ``offset ..`` of a
    larger C-order array drawn with the same key, for a caller that rounds it a slice at a time
    (jaxmp.lean's chunked update); the caller keeps ``offset + size`` below 2**32 and checks
    `fused_bits_available` first.
    """
    shape = tuple(int(d) for d in shape)
    size = int(np.prod(shape, dtype=np.int64))
    if offset is None and (not fused_bits_available() or size >= 2**32):
        return jax.random.bits(key, shape, jnp.uint32)
    data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    # The element's C-order index: the low word of jax.random's 64-bit counter (the high one is 0).
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * np.uint32(stride)
        stride *= shape[d]
    if offset is not None:
        index = index + jnp.asarray(offset).astype(jnp.uint32)
    hi, lo = _threefry2x32(data[0], data[1], jnp.zeros(shape, jnp.uint32), index)
    return hi ^ lo


def fused_bits_available() -> bool:
    """Whether `random_bits` computes JAX's bits itself (``jax_threefry_partitionable``, the
    default since JAX 0.5): only then can it draw a slice of a larger array's bits."""
    return bool(getattr(jax.config, "jax_threefry_partitionable"))


def uniform(key: jax.Array, shape: tuple, offset: jax.Array | int | None = None) -> jax.Array:
    """``jax.random.uniform(key, shape, jnp.float32)`` bit for bit, fused like `random_bits` (and
    with its ``offset``)."""
    bits = (random_bits(key, shape, offset) >> np.uint32(9)) | np.uint32(0x3F800000)
    return jnp.maximum(jnp.float32(0), jax.lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(1))
