"""Replicated state for ``pmap``: put one copy per device, take one back, check the copies agree.

``flax.jax_utils`` has ``replicate``/``unreplicate`` too; these keep the parallel layer on
JAX alone and add the check that pmap training silently relies on: every
replica holds bit-identical params and optimizer state (loss scale and skip counters included).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp._scaling._transform import LossScalingState
from jaxmp._typing import PyTree

REPLICA_AXIS = "_jaxmp_replicas"

# Mesh axis names of the pmap layout's makers: jaxmp's replicate, and jax.device_put_sharded
# (behind flax.jax_utils.replicate in flax 0.12 / JAX 0.10). A pmap step's own outputs are laid
# out over its axis_name, the user's: `replica_axis_size` finds those by the loss-scaling state.
_PMAP_AXES = (REPLICA_AXIS, "_device_put_sharded")

PMAP_LAYOUT_HINT = ("a leading axis of one copy per device, from jaxmp.parallel.replicate, flax.jax_utils.replicate "
                    "or a pmap step, maybe fetched to the host")


def is_pmap_replicated(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array`` laid out by a pmap replicator (one copy per device, stacked).

    Read from the sharding alone (no host transfer): ``PmapSharding``, or a one-axis
    ``NamedSharding`` over one of the replicators' own axis names.
    """
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
    if sharding is None:
        return False
    if type(sharding).__name__ == "PmapSharding":  # no public class in JAX 0.10
        return True
    return isinstance(sharding, NamedSharding) and len(sharding.mesh.axis_names) == 1 and (
        sharding.mesh.axis_names[0] in _PMAP_AXES)


def replica_axis_size(opt_state: Any) -> tuple[str, int] | None:
    """``(path, size)`` when ``opt_state``'s loss-scaling counters carry a leading replica axis, else None.

    ``jaxmp.loss_scaling`` keeps its step counters as scalars; a leading axis on them is the pmap
    layout whatever the leaves' sharding (a pmap step's output, a state fetched to the host). Only
    shapes are read (arrays, host arrays or ``jax.ShapeDtypeStruct``; deleted arrays too).
    """
    is_state = lambda x: isinstance(x, LossScalingState)  # noqa: E731
    for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_state)[0]:
        if is_state(node):
            counter = node.total_skips
            shape = tuple(counter.shape if hasattr(counter, "shape") else np.shape(counter))
            if shape:
                return f"{jax.tree_util.keystr(path)}.total_skips", shape[0]
    return None


def _local_devices(devices: Sequence[Any] | None) -> list:
    if devices is None:
        return list(jax.local_devices())
    devices = list(devices)
    if not devices:
        raise ValueError("devices is empty")
    return devices


def replicate(tree: PyTree, devices: Sequence[jax.Device] | None = None) -> PyTree:
    """Puts one copy of every leaf on each device, stacked on a new leading axis (pmap layout).

    Each device receives its own copy directly (no ``n``-times stacked array is built on one
    device first, which ``flax.jax_utils.replicate`` does).

    Args:
      tree: a pytree of arrays (params, optimizer state); numpy, Python scalars and
        ``jax.Array`` leaves are accepted.
      devices: the devices to replicate to; default ``jax.local_devices()`` (pmap's order).

    Returns:
      The same pytree whose leaves have shape ``(len(devices), *leaf.shape)``, laid out one
      slice per device, ready to pass to a ``jax.pmap``-ed function.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> state = jaxmp.parallel.replicate({"w": jnp.ones(3)})
      >>> state["w"].shape == (jax.local_device_count(), 3)
      True
    """
    devices = _local_devices(devices)
    sharding = NamedSharding(Mesh(np.asarray(devices), (REPLICA_AXIS,)), PartitionSpec(REPLICA_AXIS))

    def rep(x):
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        pieces = [jax.device_put(x[None], d) for d in devices]
        return jax.make_array_from_single_device_arrays((len(devices),) + x.shape, sharding, pieces)

    return jax.tree_util.tree_map(rep, tree)


def unreplicate(tree: PyTree) -> PyTree:
    """Takes the first replica of a replicated (pmap-layout) pytree.

    Reads the first addressable shard instead of indexing ``x[0]``: indexing would launch a
    computation over the whole replicated array, and in a multi-process run the array is not
    fully addressable from one process at all.

    Args:
      tree: a pytree whose leaves carry a leading replica axis (e.g. the output of a pmapped
        train step, or of [`replicate`][jaxmp.parallel.replicate]).

    Returns:
      The pytree with the leading axis removed, taken from this process's first device.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> jaxmp.parallel.unreplicate(jaxmp.parallel.replicate({"w": jnp.ones(3)}))["w"].shape
      (3,)
    """

    def one(x):
        if isinstance(x, jax.Array):
            if x.ndim == 0:
                raise ValueError("unreplicate got a scalar leaf: replicated leaves carry a leading replica axis")
            shard = x.addressable_shards[0].data
            if shard.shape == x.shape[1:]:  # fully replicated layout (each device holds the whole value)
                return shard
            return shard.reshape(x.shape[1:]) if shard.shape[0] == 1 else shard[0]
        x = np.asarray(x)
        if x.ndim == 0:
            raise ValueError("unreplicate got a scalar leaf: replicated leaves carry a leading replica axis")
        return x[0]

    return jax.tree_util.tree_map(one, tree)


def _bits(a: np.ndarray) -> np.ndarray:
    # Compare bit patterns, not values: NaN == NaN when the bits are equal, and +0 != -0, so
    # "identical" means what it says.
    a = np.ascontiguousarray(a)
    if a.dtype == object or a.dtype.itemsize == 0:
        return a
    return a.reshape(-1).view(np.uint8)


def _replica_slices(x: Any) -> list[tuple[Any, np.ndarray]]:
    """(device, host value) of each replica slice of a pmap-layout leaf held by this process."""
    if isinstance(x, jax.Array):
        out = []
        for shard in x.addressable_shards:
            data = shard.data
            if jax.dtypes.issubdtype(data.dtype, jax.dtypes.prng_key):
                data = jax.random.key_data(data)  # compare the key bits; key arrays have no numpy form
            data = np.asarray(data)
            if data.shape == x.shape:  # a fully replicated jax.Array: every shard is a whole copy
                out.append((shard.device, data))
            else:
                out.extend((shard.device, d) for d in data)
        return out
    x = np.asarray(x)
    return [(i, x[i]) for i in range(x.shape[0])]


def check_replicated(tree: PyTree, *, num_replicas: int | None = None, name: str = "state") -> None:
    """Raises a ValueError unless every leaf is replicated: right leading size, identical copies.

    A pmap state is replicated when each leaf's leading axis equals the local device count and
    every device's slice is bitwise identical (checked on the host, so call it at start-up or
    every few hundred steps, not every step). A ``jax.Array`` that is fully replicated over a
    mesh (the sharded-jit layout) is accepted too: then all its shards must agree.

    Args:
      tree: a pytree (params, optimizer state, train state).
      num_replicas: the expected leading size; default ``jax.local_device_count()``. Ignored
        for fully replicated ``jax.Array`` leaves, which have no replica axis.
      name: what to call ``tree`` in the error message.

    Raises:
      ValueError: a leaf has the wrong leading size (e.g. it was never passed through
        [`replicate`][jaxmp.parallel.replicate]), or two replicas differ (the leaf path, replica indices and the
        largest difference are named).

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> replicated = jaxmp.parallel.replicate({"w": jnp.ones(3)})
      >>> jaxmp.parallel.check_replicated(replicated) is None
      True
      >>> # no replica axis:
      >>> jaxmp.parallel.check_replicated({"w": jnp.ones((3, 2))}, num_replicas=2)
      Traceback (most recent call last):
      ...
      ValueError: state is not replicated: leaf ['w'] has shape (3, 2),
      expected a leading replica axis ...
    """
    n = jax.local_device_count() if num_replicas is None else int(num_replicas)
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        where = jax.tree_util.keystr(path) or "<root>"
        fully_replicated = isinstance(x, jax.Array) and x.sharding.is_fully_replicated and len(x.sharding.device_set) > 1
        if not fully_replicated:
            shape = jnp.shape(x)
            if not shape or shape[0] != n:
                raise ValueError(
                    f"{name} is not replicated: leaf {where} has shape {tuple(shape)}, expected a leading replica axis "
                    f"of size {n} (the local device count); pass it through jaxmp.parallel.replicate(...) first"
                )
        slices = _replica_slices(x)
        ref_dev, ref = slices[0]
        ref_bits = _bits(ref)
        for i, (dev, val) in enumerate(slices[1:], start=1):
            if val.shape != ref.shape or val.dtype != ref.dtype or not np.array_equal(_bits(val), ref_bits):
                diff = ""
                if val.shape == ref.shape and np.issubdtype(val.dtype, np.number):
                    with np.errstate(invalid="ignore", over="ignore"):
                        d = np.abs(val.astype(np.float64) - ref.astype(np.float64))
                    diff = f" (max |difference| {np.nanmax(d) if d.size and not np.all(np.isnan(d)) else 'nan'})"
                raise ValueError(
                    f"{name} is not replicated: leaf {where} differs between replica 0 ({ref_dev}) and replica {i} "
                    f"({dev}){diff}; replicas must be bitwise identical -- reduce gradients and the finite verdict "
                    "over the pmap axis (jaxmp.parallel.make_pmap_train_step does both)"
                )


def is_replicated(tree: Any, *, num_replicas: int | None = None) -> bool:
    """Whether [`check_replicated`][jaxmp.parallel.check_replicated] passes.

    Args:
      tree: a pytree.
      num_replicas: as in [`check_replicated`][jaxmp.parallel.check_replicated].

    Returns:
      ``True`` if every leaf has the replica axis and identical copies.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> replicated = jaxmp.parallel.replicate({"w": jnp.ones(3)})
      >>> jaxmp.parallel._replication.is_replicated(replicated)
      True
    """
    try:
        check_replicated(tree, num_replicas=num_replicas)
    except ValueError:
        return False
    return True
