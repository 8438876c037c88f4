"""jaxmp/parallel/_replication.py: replicate, unreplicate and the bitwise replica check, unit by unit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.parallel._replication import check_replicated, is_replicated, replicate, unreplicate

N = jax.local_device_count()


def test_replicate_puts_one_whole_copy_on_each_device_for_every_kind_of_leaf():
    tree = {"a": jnp.arange(3.0), "n": np.ones((2,), np.int8), "s": 2.5, "b": True}
    rep = replicate(tree)
    assert rep["a"].shape == (N, 3) and rep["n"].dtype == np.int8 and rep["s"].shape == (N,)
    for leaf in jax.tree_util.tree_leaves(rep):
        shards = leaf.addressable_shards
        assert sorted(s.device.id for s in shards) == sorted(d.id for d in jax.local_devices())
        assert all(s.data.shape == (1, *leaf.shape[1:]) for s in shards)
    np.testing.assert_array_equal(np.asarray(rep["a"]), np.tile(np.arange(3.0), (N, 1)))


def test_replicate_to_chosen_devices_in_the_given_order_and_refuses_none():
    devs = jax.local_devices()[:3][::-1]
    rep = replicate({"w": jnp.ones(2)}, devices=devs)
    assert rep["w"].shape == (3, 2)
    assert [s.device for s in sorted(rep["w"].addressable_shards, key=lambda s: s.index[0].start)] == devs
    with pytest.raises(ValueError, match="devices is empty"):
        replicate({"w": jnp.ones(2)}, devices=[])


def test_unreplicate_takes_the_first_copy_of_device_arrays_and_host_arrays():
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "k": jnp.int32(4)}
    back = unreplicate(replicate(tree))
    assert back["w"].shape == (2, 3) and int(back["k"]) == 4
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(6.0).reshape(2, 3))
    host = unreplicate({"w": np.stack([np.full(2, i) for i in range(N)])})
    np.testing.assert_array_equal(host["w"], np.zeros(2))
    assert unreplicate({"w": jnp.stack([jnp.full(2, float(i)) for i in range(N)])})["w"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("leaf", [jnp.float32(1.0), np.float32(1.0), 3.0])
def test_unreplicate_refuses_a_scalar_leaf(leaf):
    with pytest.raises(ValueError, match="scalar leaf"):
        unreplicate({"x": leaf})


def test_bitwise_identity_means_equal_bits_not_equal_values():
    nan = np.full((N, 2), np.nan, np.float32)
    check_replicated({"w": nan})  # NaN == NaN when the bits agree
    zeros = np.zeros((N, 2), np.float32)
    zeros[3, 1] = -0.0
    with pytest.raises(ValueError, match=r"replica 3.*max \|difference\| 0\.0"):
        check_replicated({"w": zeros})  # -0.0 == 0.0 as values, not as bits


def test_the_error_names_the_leaf_replicas_difference_and_the_remedy():
    w = np.ones((N, 2), np.float32)
    w[N - 1, 0] = 1.5
    with pytest.raises(ValueError, match=rf"opt_state is not replicated: leaf \['m'\]\[0\] differs between replica 0 "
                                         rf".* replica {N - 1} .*max \|difference\| 0\.5.*make_pmap_train_step"):
        check_replicated({"m": [w]}, name="opt_state")


def test_num_replicas_sets_the_expected_leading_size_and_is_replicated_mirrors_the_check():
    tree = {"w": np.ones((2, 5), np.float32)}
    check_replicated(tree, num_replicas=2)
    assert is_replicated(tree, num_replicas=2) and not is_replicated(tree)
    with pytest.raises(ValueError, match=r"leaf \['w'\] has shape \(2, 5\), expected a leading replica axis of size 3"):
        check_replicated(tree, num_replicas=3)
    assert is_replicated({}) and is_replicated(replicate({"k": jax.random.key(1)}))
    keys = jnp.stack([jax.random.key_data(jax.random.key(i)) for i in range(N)])
    assert not is_replicated({"k": jax.random.wrap_key_data(keys)})
