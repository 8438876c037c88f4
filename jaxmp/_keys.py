"""The stochastic-rounding keys of jaxmp.lean's recipes: an int seed or a threefry2x32 key stored as raw
uint32[2] data in the optimizer state, folded with the update count and the leaf's index.

Private: jaxmp.lean and its quantized moments share it (threefry2x32: its bits do not depend on sharding).
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
