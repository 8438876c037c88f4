"""jaxmp._keys.random_bits / uniform: jax.random's threefry bits, bit for bit, fused into their consumer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmp import _keys
from jaxmp.lean import stochastic_round

SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (1000, 33), (5, 1, 257)]


def _key(seed, data=7):
    return jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), data)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2**31 + 5])
def test_random_bits_equal_jax_random_bits(shape, seed):
    key = _key(seed)
    want = np.asarray(jax.random.bits(key, shape, jnp.uint32))
    assert (np.asarray(jax.jit(_keys.random_bits, static_argnums=1)(key, shape)) == want).all()
    # Raw uint32[2] key data draws the same bits as the typed key.
    assert (np.asarray(_keys.random_bits(jax.random.key_data(key), shape)) == want).all()


@pytest.mark.parametrize("shape", SHAPES)
def test_uniform_equals_jax_random_uniform(shape):
    key = _key(3)
    want = np.asarray(jax.random.uniform(key, shape, jnp.float32))
    got = np.asarray(_keys.uniform(key, shape))
    assert got.dtype == np.float32 and (got == want).all()
    assert ((got >= 0) & (got < 1)).all()


def test_random_bits_under_a_sharded_jit_are_the_unsharded_bits():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    key, shape = _key(11), (64, 96)
    fn = jax.jit(lambda k: _keys.random_bits(k, shape), out_shardings=NamedSharding(mesh, P("a", "b")))
    assert (np.asarray(fn(key)) == np.asarray(jax.random.bits(key, shape, jnp.uint32))).all()


def test_random_bits_without_partitionable_threefry_falls_back_to_jax_random():
    key, shape = _key(5), (17, 9)
    with jax.threefry_partitionable(False):
        want = np.asarray(jax.random.bits(key, shape, jnp.uint32))
        assert (np.asarray(_keys.random_bits(key, shape)) == want).all()


def _temp_bytes(fn, *args) -> int:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def test_stochastic_rounding_writes_no_random_bits_out():
    # jax.random.bits on the CPU runs threefry as a rolled loop over two uint32 arrays of the
    # shape (8 bytes an element of temporaries); fused, the bits never leave the rounding's loop.
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    key = _key(0)
    fused = _temp_bytes(lambda v, k: stochastic_round(v, k), x, key)
    unfused = _temp_bytes(lambda v, k: (jax.lax.bitcast_convert_type(v, jnp.uint32)
                                        + (jax.random.bits(k, v.shape, jnp.uint32) >> 16)) >> 16, x, key)
    assert unfused >= 4 * x.size
    assert fused < x.size // 64
