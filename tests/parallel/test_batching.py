"""jaxmp/parallel/_batching.py: per-device splits, process slices of a batch or dataset, and prefetching."""

import jax
import numpy as np
import pytest

from jaxmp.parallel._batching import (per_device_batch_size, prefetch_to_device, process_batch_slice,
                                     process_dataset_range, shard_batch, unshard_batch)

N = jax.local_device_count()


def test_per_device_batch_size_divides_or_names_both_numbers():
    assert per_device_batch_size(8 * N) == 8 and per_device_batch_size(12, 3) == 4
    with pytest.raises(ValueError, match="10.*4|4.*10"):
        per_device_batch_size(10, 4)
    with pytest.raises((ValueError, TypeError), match="global_batch_size"):
        per_device_batch_size(0)
    with pytest.raises((ValueError, TypeError), match="num_devices"):
        per_device_batch_size(8, -2)


def test_shard_batch_splits_into_contiguous_blocks_and_unshard_undoes_it():
    batch = {"x": np.arange(2 * N * 3).reshape(2 * N, 3), "y": np.arange(2 * N)}
    sharded = shard_batch(batch)
    assert sharded["x"].shape == (N, 2, 3) and sharded["y"].shape == (N, 2)
    assert isinstance(sharded["x"], np.ndarray)  # host leaves stay on the host
    assert sharded["y"][1].tolist() == [2, 3]  # device 1 gets examples 2 and 3
    back = unshard_batch(sharded)
    assert np.array_equal(back["x"], batch["x"]) and np.array_equal(back["y"], batch["y"])
    assert shard_batch(np.arange(6), 3).tolist() == [[0, 1], [2, 3], [4, 5]]


def test_shard_batch_refuses_leaves_that_disagree_or_do_not_divide():
    with pytest.raises(ValueError):
        shard_batch({"x": np.zeros((4, 2)), "y": np.zeros(6)}, 2)
    with pytest.raises(ValueError, match="5"):
        shard_batch(np.zeros((5, 2)), 2)


def test_process_batch_slice_gives_each_process_its_contiguous_block():
    slices = [process_batch_slice(12, i, 3) for i in range(3)]
    assert slices == [slice(0, 4), slice(4, 8), slice(8, 12)]
    assert process_batch_slice(8) == slice(0, 8)  # one process here
    with pytest.raises(ValueError, match="process_index 3 is outside \\[0, 3\\)"):
        process_batch_slice(12, 3, 3)
    with pytest.raises(ValueError, match="over processes"):
        process_batch_slice(10, 0, 3)


def test_process_dataset_range_drops_or_spreads_the_remainder():
    assert [process_dataset_range(10, i, 3) for i in range(3)] == [slice(0, 3), slice(3, 6), slice(6, 9)]
    spread = [process_dataset_range(10, i, 3, drop_remainder=False) for i in range(3)]
    assert spread == [slice(0, 4), slice(4, 7), slice(7, 10)]  # covers every example exactly once
    assert process_dataset_range(9, 2, 3, drop_remainder=False) == slice(6, 9)
    with pytest.raises(ValueError, match="2 examples cannot be split over 3 processes"):
        process_dataset_range(2, 0, 3)
    with pytest.raises(ValueError, match="process_index -1"):
        process_dataset_range(9, -1, 3)


def test_prefetch_to_device_yields_every_batch_sharded_in_order():
    batches = [np.full((2 * N, 3), i, np.float32) for i in range(3)]
    out = list(prefetch_to_device(iter(batches), size=2))
    assert len(out) == 3
    for i, b in enumerate(out):
        assert isinstance(b, jax.Array) and b.shape == (N, 2, 3) and float(b[N - 1, 1, 2]) == i
        assert len(b.sharding.device_set) == N  # one slice per device
    assert list(prefetch_to_device([], size=1)) == []
    with pytest.raises((ValueError, TypeError), match="size"):
        next(prefetch_to_device(iter(batches), size=0))
