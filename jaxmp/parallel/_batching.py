"""Splitting batches: global batch -> per-device shards, global data -> this process's part.

The per-device batch is what a device actually trains on; it sets BatchNorm statistics and
the noise scale of each device's gradient, and it is what hyperparameters tuned on one device
correspond to (8 TPU cores each see ``batch / 8``). So it is computed explicitly, checked
(equal shards only: the mean of per-device means is the global mean only then) and logged.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Iterable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp.parallel._checks import check_divisible, check_positive_int, leading_size, log_once
from jaxmp._typing import PyTree

_PREFETCH_AXIS = "_jaxmp_prefetch"


def per_device_batch_size(global_batch_size: int, num_devices: int | None = None) -> int:
    """The batch each device trains on, checking that the global batch splits evenly.

    Args:
      global_batch_size: examples per step over all devices (of this process, for pmap).
      num_devices: devices sharing it; default ``jax.local_device_count()``.

    Returns:
      ``global_batch_size // num_devices``.

    Raises:
      ValueError: the global batch is not divisible by the device count (both are named).

    Example:
      >>> import jaxmp
      >>> jaxmp.parallel._batching.per_device_batch_size(256, 8)
      32
    """
    global_batch_size = check_positive_int(global_batch_size, "global_batch_size")
    n = jax.local_device_count() if num_devices is None else check_positive_int(num_devices, "num_devices")
    per_device = check_divisible(global_batch_size, n)
    log_once("jaxmp.parallel: global batch %d over %d devices -> per-device batch %d", global_batch_size, n, per_device)
    return per_device


def shard_batch(batch: PyTree, num_devices: int | None = None) -> PyTree:
    """Reshapes a batch ``[B, ...]`` into per-device batches ``[num_devices, B // num_devices, ...]``.

    Host (numpy) leaves stay on the host, so this is cheap inside an input pipeline; the pmapped
    step (or [`prefetch_to_device`][jaxmp.parallel.prefetch_to_device]) moves each slice to its device. Example ``i`` goes to
    device ``i // (B // num_devices)``: contiguous blocks, the same split as the sharded-jit path,
    so both paths see the same per-device batches.

    Args:
      batch: a pytree of arrays sharing a leading batch axis (this process's global batch).
      num_devices: number of shards; default ``jax.local_device_count()``.

    Returns:
      The pytree with every leaf reshaped to ``(num_devices, B // num_devices, *rest)``.

    Raises:
      ValueError: ``B`` is not divisible by ``num_devices`` (both numbers are named), or the
        leaves disagree on ``B``.

    Example:
      >>> import numpy as np, jaxmp
      >>> x = np.zeros((16, 3))
      >>> jaxmp.parallel.shard_batch({"x": x}, 8)["x"].shape
      (8, 2, 3)
    """
    global_batch = leading_size(batch)
    per_device = per_device_batch_size(global_batch, num_devices)
    n = global_batch // per_device
    return jax.tree_util.tree_map(lambda x: x.reshape((n, per_device) + tuple(x.shape[1:])), batch)


def unshard_batch(batch: PyTree) -> PyTree:
    """Inverse of [`shard_batch`][jaxmp.parallel.shard_batch]: ``[n, b, ...] -> [n * b, ...]``.

    Args:
      batch: a pytree of per-device batches.

    Returns:
      The pytree with the first two axes merged.

    Example:
      >>> import numpy as np, jaxmp
      >>> jaxmp.parallel._batching.unshard_batch({"x": np.zeros((8, 2, 3))})["x"].shape
      (16, 3)
    """
    return jax.tree_util.tree_map(lambda x: x.reshape((-1,) + tuple(x.shape[2:])), batch)


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    count = jax.process_count() if process_count is None else check_positive_int(process_count, "process_count")
    index = jax.process_index() if process_index is None else int(process_index)
    if not 0 <= index < count:
        raise ValueError(f"process_index {index} is outside [0, {count})")
    return index, count


def process_batch_slice(global_batch_size: int, process_index: int | None = None,
                        process_count: int | None = None) -> slice:
    """This process's rows of a global batch, so each host loads only its own part.

    Args:
      global_batch_size: examples per step over all processes.
      process_index: default ``jax.process_index()``.
      process_count: default ``jax.process_count()``.

    Returns:
      ``slice(start, stop)`` of length ``global_batch_size // process_count``; processes take
      contiguous blocks in process order, matching ``jax.make_array_from_process_local_data``
      on a mesh built from ``jax.devices()``.

    Raises:
      ValueError: the global batch is not divisible by the process count.

    Example:
      >>> import jaxmp
      >>> jaxmp.parallel.process_batch_slice(256, process_index=1, process_count=4)
      slice(64, 128, None)
    """
    global_batch_size = check_positive_int(global_batch_size, "global_batch_size")
    index, count = _process(process_index, process_count)
    local = check_divisible(global_batch_size, count, what="global batch (over processes)")
    return slice(index * local, (index + 1) * local)


def process_dataset_range(num_examples: int, process_index: int | None = None, process_count: int | None = None,
                          *, drop_remainder: bool = True) -> slice:
    """This process's index range of a dataset of ``num_examples`` examples.

    With ``drop_remainder=True`` every process gets exactly ``num_examples // process_count``
    examples (the last ``num_examples % process_count`` are dropped). That is the safe default:
    every process then runs the same number of steps, while a process that runs one step more
    than the others waits forever in the gradient all-reduce.

    Args:
      num_examples: size of the whole dataset.
      process_index: default ``jax.process_index()``.
      process_count: default ``jax.process_count()``.
      drop_remainder: drop the tail so shares are equal; with ``False`` the first
        ``num_examples % process_count`` processes get one example more.

    Returns:
      ``slice(start, stop)`` into the dataset.

    Example:
      >>> import jaxmp
      >>> jaxmp.parallel.process_dataset_range(10, process_index=1, process_count=3)
      slice(3, 6, None)
    """
    num_examples = check_positive_int(num_examples, "num_examples")
    index, count = _process(process_index, process_count)
    share, rest = divmod(num_examples, count)
    if share == 0:
        raise ValueError(f"{num_examples} examples cannot be split over {count} processes")
    if drop_remainder or rest == 0:
        return slice(index * share, (index + 1) * share)
    start = index * share + min(index, rest)
    return slice(start, start + share + (1 if index < rest else 0))


def prefetch_to_device(iterator: Iterable[Any], size: int = 2, devices: Sequence[Any] | None = None) -> Iterator[Any]:
    """Shards each batch of an iterator and keeps ``size`` of them in flight on the devices (pmap layout).

    Like ``flax.jax_utils.prefetch_to_device``, but it takes this process's *global* batch
    ``[B, ...]`` and does the [`shard_batch`][jaxmp.parallel.shard_batch] split itself (with its divisibility check and
    logging). Transfers are asynchronous, so with ``size=2`` the next batch is copied while the
    current step runs (mostly useful on GPUs).

    Args:
      iterator: yields pytrees of host arrays with a leading batch axis.
      size: number of batches kept on the devices ahead of use (>= 1).
      devices: default ``jax.local_devices()`` (pmap's order).

    Yields:
      Batches of shape ``[num_devices, B // num_devices, ...]``, one slice per device.

    Example:
      >>> import jax, numpy as np, jaxmp
      >>> it = jaxmp.parallel.prefetch_to_device(iter([{"x": np.zeros((16, 3))}]), 2)
      >>> next(it)["x"].shape == (jax.local_device_count(), 16 // jax.local_device_count(), 3)
      True
    """
    size = check_positive_int(size, "size")
    devices = list(jax.local_devices()) if devices is None else list(devices)
    sharding = NamedSharding(Mesh(np.asarray(devices), (_PREFETCH_AXIS,)), PartitionSpec(_PREFETCH_AXIS))
    queue: collections.deque = collections.deque()
    iterator = iter(iterator)

    def put(batch):
        sharded = shard_batch(batch, len(devices))
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, sharding), sharded)

    def enqueue(n):
        for batch in itertools.islice(iterator, n):
            queue.append(put(batch))

    enqueue(size)
    while queue:
        yield queue.popleft()
        enqueue(1)
