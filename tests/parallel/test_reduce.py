"""Unit tests of jaxmp.parallel._reduce: the per-leaf custom_vjp reductions inside a shard_map.

The end-to-end layout tests (tests/parallel/test_layouts.py) check whole steps; these call the
three identities directly on the 8 simulated devices and read what their backward does.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxmp import _jaxpr
from jaxmp.parallel import _reduce

N = 8
BF16 = jnp.bfloat16


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:N]), ("d",))


def _collectives(fn, *args):
    """(primitive, operand dtype) of every psum / reduce-scatter / all-gather in ``fn``'s program."""
    names = ("psum", "psum2", "psum_invariant", "reduce_scatter", "psum_scatter", "all_gather", "all_gather_invariant")
    return [(e.primitive, np.dtype(e.in_avals[0].dtype).name) for e in _jaxpr.walk(jax.make_jaxpr(fn)(*args))
            if e.primitive in names]


def _grad_of(mesh, wrap, in_spec, out_spec=P()):
    # loss per shard: sum(wrap(p) * x_shard); the gradient of p is the sum over shards of x.
    def per_shard(p, x):
        return jax.grad(lambda q: jnp.sum((wrap(q) * x).astype(jnp.float32)))(p)

    return jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(in_spec, P("d")), out_specs=out_spec))


def test_all_reduced_sums_the_gradient_over_devices_in_the_reduce_dtype(mesh):
    p = jnp.ones((4,), BF16)
    x = jnp.arange(N * 4, dtype=BF16).reshape(N, 4) / 8  # one row per device
    want = np.asarray(x, np.float32).sum(0)
    for reduce_dtype, sum_dtype in ((jnp.float32, "float32"), (None, "bfloat16")):
        fn = _grad_of(mesh, lambda q: _reduce.all_reduced(q, "d", reduce_dtype), P())
        g = fn(p, x)
        assert g.dtype == BF16 and g.shape == (4,)  # cast back to the param's dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want.astype(BF16), np.float32))
        kinds = _collectives(fn, p, x)
        assert [k for k in kinds if k[0].startswith("psum")] and all(d == sum_dtype for _, d in kinds), kinds


def test_the_forward_is_the_param_itself(mesh):
    p = jnp.arange(4.0, dtype=jnp.float32)
    f = jax.jit(jax.shard_map(lambda q: _reduce.all_reduced(q, "d", jnp.float32) * 1.0, mesh=mesh,
                              in_specs=P(), out_specs=P("d")))
    np.testing.assert_array_equal(f(p), np.tile(np.arange(4.0), N))


def test_scattered_gives_each_device_the_reduced_slice_and_full_no_gradient(mesh):
    full = jnp.ones((2, N * 2), BF16)
    x = jnp.arange(N * 2 * N * 2, dtype=jnp.float32).reshape(N * 2, N * 2).astype(BF16)  # two rows per device

    def per_shard(full, piece, x):
        def loss(full, piece):
            return jnp.sum((_reduce.scattered(jax.lax.stop_gradient(full), piece, "d", 1, jnp.float32)
                            * x).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1))(full, piece)

    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P(None, "d"), P("d")),
                               out_specs=(P(), P(None, "d"))))
    piece = full  # sharded on dim 1 by in_specs: (2, 2) per device
    g_full, g_piece = fn(full, piece, x)
    assert not np.any(np.asarray(g_full, np.float32))  # full is under stop_gradient: its gradient is zero
    # every device's gradient of full is its 2 rows of x; summed over devices, scattered along dim 1
    want = np.asarray(x, np.float32).reshape(N, 2, N * 2).sum(0)
    assert g_piece.dtype == BF16 and g_piece.shape == (2, N * 2)
    np.testing.assert_array_equal(np.asarray(g_piece, np.float32), want.astype(BF16).astype(np.float32))
    assert ("reduce_scatter", "float32") in _collectives(fn, full, piece, x)


def test_gathered_all_gathers_in_the_stored_dtype_and_reduce_scatters_in_the_reduce_dtype(mesh):
    w = jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3).astype(BF16)  # rows sharded: one per device

    def per_shard(piece):
        whole = _reduce.gathered(piece, "d", 0, jnp.float32)
        i = jax.lax.axis_index("d")
        loss = lambda q: jnp.sum(_reduce.gathered(q, "d", 0, jnp.float32).astype(jnp.float32)  # noqa: E731
                                 * (i + 1).astype(jnp.float32))
        return whole, jax.grad(loss)(piece)

    fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("d"), out_specs=(P("d"), P("d"))))
    whole, g = fn(w)
    # each device holds the whole (N, 3) param: out_specs P("d") stacks the N copies
    np.testing.assert_array_equal(np.asarray(whole, np.float32), np.tile(np.asarray(w, np.float32), (N, 1)))
    # device i's gradient of every element is i + 1; the sum over devices is N (N + 1) / 2 everywhere
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.full((N, 3), N * (N + 1) / 2))
    kinds = _collectives(fn, w)
    assert ("all_gather", "bfloat16") in kinds and ("reduce_scatter", "float32") in kinds, kinds


@pytest.mark.parametrize("shape, dtype, keep, bucket, want", [
    ((64, 64), np.float32, None, 16 * 2**20, (-1, [])),            # small: one piece
    ((64, 32), np.float32, None, 2048, (0, [(0, 16), (16, 32), (32, 48), (48, 64)])),  # 8 KiB in 2 KiB pieces
    ((64, 32), np.float32, 0, 2048, (1, [(0, 8), (8, 16), (16, 24), (24, 32)])),      # not along the kept dim
    ((4, 1), np.float32, 0, 4, (-1, [])),                          # only the kept dim has size > 1: uncut
    ((3, 5), np.float32, None, 4, (1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)])),      # at most one row per piece
])
def test_buckets_cut_the_largest_other_dimension(monkeypatch, shape, dtype, keep, bucket, want):
    monkeypatch.setattr(_reduce, "BUCKET_BYTES", bucket)
    assert _reduce._buckets(np.zeros(shape, dtype), None, keep) == want


def test_bucket_size_counts_bytes_of_the_reduce_dtype(monkeypatch):
    monkeypatch.setattr(_reduce, "BUCKET_BYTES", 1024)
    ct = np.zeros((16, 32), jnp.bfloat16)  # 1 KiB in bf16, 2 KiB once cast to float32
    assert _reduce._buckets(ct, None, None) == (-1, [])
    assert _reduce._buckets(ct, jnp.float32, None) == (1, [(0, 16), (16, 32)])


def test_bucketed_reduction_is_bitwise_the_whole_one(mesh, monkeypatch):
    p = jnp.ones((8, 16), BF16)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(N * 8, 16)), BF16)  # numpy: no eager draw compile
    whole = _grad_of(mesh, lambda q: _reduce.all_reduced(q, "d", jnp.float32), P())(p, x)
    monkeypatch.setattr(_reduce, "BUCKET_BYTES", 128)  # 512 float32 bytes: 4 pieces along dim 1
    fn = _grad_of(mesh, lambda q: _reduce.all_reduced(q, "d", jnp.float32), P())
    np.testing.assert_array_equal(np.asarray(fn(p, x)), np.asarray(whole))
    assert len([k for k in _collectives(fn, p, x) if k[0].startswith("psum")]) == 4


@pytest.mark.parametrize("x, want", [
    (jnp.ones(2), True), (jnp.ones(2, BF16), True), (np.float16(1), True),
    (jnp.ones(2, jnp.int32), False), (np.bool_(True), False), (1.0, False),  # a Python float has no dtype
    (jax.random.key(0), False), (jax.ShapeDtypeStruct((2,), jnp.float32), True),
])
def test_is_float(x, want):
    assert _reduce.is_float(x) is want
