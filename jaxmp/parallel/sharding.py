"""The sharded-``jit`` path (JAX's recommended one): a mesh with a data axis, plain ``jax.jit``.

The batch is sharded over the mesh's data axis and the state is replicated. The step is
written as if for one device on the *global* batch; XLA's partitioner inserts the gradient
all-reduce. So ``jaxmp.loss_scaling(..., axis_name=None)`` is right here: its finite check
already runs on the global (reduced) gradient and every device computes the same verdict.
The same code runs unchanged on several hosts (see :mod:`jaxmp.parallel.distributed`).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Callable, Iterable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp.parallel._common import (
    check_divisible, check_positive_int, leading_size, log_once, make_step_body, with_model_state,
)


def make_data_mesh(devices: Sequence[Any] | None = None, axis_name: str = "data") -> Mesh:
    """A one-dimensional ``jax.sharding.Mesh`` over all devices, with a data-parallel axis.

    Args:
      devices: default ``jax.devices()`` (all processes' devices, in process order, which is
        what :func:`make_global_batch` and :func:`jaxmp.parallel.process_batch_slice` assume).
      axis_name: name of the data axis.

    Returns:
      ``Mesh(devices, (axis_name,))``.

    Example:
      >>> import jax, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> mesh.shape["data"] == jax.device_count()
      True
    """
    devices = list(jax.devices()) if devices is None else list(devices)
    if not devices:
        raise ValueError("devices is empty")
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be a str, got {type(axis_name).__name__}")
    return Mesh(np.asarray(devices), (axis_name,))


def _data_axis(mesh: Mesh, data_axis: str | None) -> str:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if data_axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"mesh has axes {mesh.axis_names}: name the data axis with data_axis=...")
        return mesh.axis_names[0]
    if data_axis not in mesh.axis_names:
        raise ValueError(f"data_axis {data_axis!r} is not an axis of the mesh (axes: {mesh.axis_names})")
    return data_axis


def batch_sharding(mesh: Mesh, data_axis: str | None = None) -> NamedSharding:
    """Sharding of a batch: leading axis split over the data axis, the rest unsplit.

    Args:
      mesh: the mesh (e.g. from :func:`make_data_mesh`).
      data_axis: the mesh axis to split over; default the mesh's only axis.

    Returns:
      ``NamedSharding(mesh, PartitionSpec(data_axis))``.

    Example:
      >>> import jaxmp
      >>> jaxmp.parallel.batch_sharding(jaxmp.parallel.make_data_mesh()).spec
      P('data',)
    """
    return NamedSharding(mesh, PartitionSpec(_data_axis(mesh, data_axis)))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of the state: a full copy on every device of the mesh.

    Args:
      mesh: the mesh.

    Returns:
      ``NamedSharding(mesh, PartitionSpec())``.

    Example:
      >>> import jaxmp
      >>> jaxmp.parallel.replicated_sharding(jaxmp.parallel.make_data_mesh()).is_fully_replicated
      True
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    return NamedSharding(mesh, PartitionSpec())


def replicate_on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Places a full copy of every leaf on every device of the mesh (the sharded-jit state layout).

    Works with several processes too: each process passes the same host value and fills its
    own devices (``jax.make_array_from_callback``), with no cross-host transfer.

    Args:
      tree: a pytree of arrays (params, optimizer state), the same on every process.
      mesh: the mesh.

    Returns:
      The pytree of fully replicated global ``jax.Array`` leaves.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> w = jaxmp.parallel.replicate_on_mesh({"w": jnp.ones(3)}, jaxmp.parallel.make_data_mesh())["w"]
      >>> w.sharding.is_fully_replicated
      True
    """
    sharding = replicated_sharding(mesh)

    def rep(x):
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map(rep, tree)


def make_global_batch(local_batch: Any, mesh: Mesh, data_axis: str | None = None) -> Any:
    """Assembles this process's batch into global arrays sharded over the data axis.

    With one process this is a sharded ``device_put`` of the global batch. With several, each
    process passes only its own rows (:func:`jaxmp.parallel.process_batch_slice`) and
    ``jax.make_array_from_process_local_data`` stitches them into one global array of
    ``process_count`` times the rows; no process ever holds the whole batch.

    Args:
      local_batch: a pytree of host arrays with a leading batch axis (this process's part).
      mesh: the mesh (e.g. :func:`make_data_mesh`).
      data_axis: the mesh axis to split the batch over; default the mesh's only axis.

    Returns:
      The pytree of global ``jax.Array`` leaves sharded ``PartitionSpec(data_axis)``.

    Raises:
      ValueError: the global batch is not divisible by the number of devices on the data axis
        (both numbers named), or leaves disagree on the batch size.

    Example:
      >>> import numpy as np, jaxmp
      >>> b = jaxmp.parallel.make_global_batch({"x": np.zeros((16, 3))}, jaxmp.parallel.make_data_mesh())
      >>> b["x"].shape
      (16, 3)
    """
    axis = _data_axis(mesh, data_axis)
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    local = leading_size(local_batch)
    num_devices = mesh.shape[axis]
    # Devices of this process on the data axis: its rows are split over exactly these.
    local_devices = len({d for d in mesh.devices.flat if d.process_index == jax.process_index()})
    global_batch = local * jax.process_count()
    per_device = check_divisible(global_batch, num_devices)
    if local_devices and local % local_devices:
        check_divisible(local, local_devices, what="process-local batch")
    log_once("jaxmp.parallel: global batch %d over %d devices (%d processes) -> per-device batch %d",
             global_batch, num_devices, jax.process_count(), per_device)
    return jax.tree_util.tree_map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), local_batch)


def prefetch_to_mesh(iterator: Iterable[Any], mesh: Mesh, size: int = 2, data_axis: str | None = None) -> Iterator[Any]:
    """Keeps ``size`` batches in flight on the mesh, sharded over the data axis.

    Args:
      iterator: yields this process's batches (pytrees of host arrays).
      mesh: the mesh.
      size: batches kept ahead (>= 1).
      data_axis: default the mesh's only axis.

    Yields:
      Global batches as from :func:`make_global_batch`.

    Example:
      >>> import numpy as np, jaxmp
      >>> it = jaxmp.parallel.prefetch_to_mesh(iter([{"x": np.zeros((16, 3))}]), jaxmp.parallel.make_data_mesh())
      >>> next(it)["x"].shape
      (16, 3)
    """
    size = check_positive_int(size, "size")
    queue: collections.deque = collections.deque()
    iterator = iter(iterator)

    def enqueue(n):
        for batch in itertools.islice(iterator, n):
            queue.append(make_global_batch(batch, mesh, data_axis))

    enqueue(size)
    while queue:
        yield queue.popleft()
        enqueue(1)


def make_sharded_train_step(loss_fn: Callable[..., Any], tx: Any, mesh: Mesh, *, data_axis: str | None = None,
                            has_aux: bool = False, donate: bool = False,
                            model_state: bool = False) -> Callable[..., Any]:
    """A ``jax.jit`` train step with the batch sharded over the mesh's data axis and the state replicated.

    Same semantics and results as :func:`jaxmp.parallel.make_pmap_train_step`, without ``pmap``: the step
    sees the global batch, ``loss_fn``'s mean is the global mean and its gradient is the global
    gradient (XLA inserts the all-reduce). Build ``tx`` with ``jaxmp.loss_scaling(...,
    axis_name=None)``: there is no named axis under plain ``jit``, and none is needed because
    the finite check runs on the global gradient (a ``tx`` built with an axis name fails with
    a ValueError saying the axis is not bound).

    The all-reduce dtype is XLA's choice here: it reduces where the batch contraction happens,
    usually in the dtype of the weight-gradient matmul (the compute dtype). A float16 sum that
    overflows is still caught, because the verdict is on the reduced gradient. For an explicit
    reduce dtype use the pmap path (or ``shard_map`` with :func:`jaxmp.parallel.all_reduce_gradients`).

    Args:
      loss_fn: ``loss_fn(params, batch)`` or ``loss_fn(params, batch, rng)``, returning a scalar
        float32 loss (the mean over the *global* batch), or ``(loss, aux)`` with ``has_aux``.
      tx: an optax transformation holding a :func:`jaxmp.loss_scaling` state (``axis_name=None``).
      mesh: the mesh (:func:`make_data_mesh`).
      data_axis: the mesh axis the batch is split over; default the mesh's only axis.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` goes to ``metrics["aux"]``.
      donate: donate the params and optimizer state buffers.
      model_state: the model has state besides its params (BatchNorm ``batch_stats``): the step
        is then ``step(params, model_state, opt_state, batch[, rng]) -> (params, model_state,
        opt_state, metrics)`` and ``loss_fn(params, model_state, batch[, rng])`` returns ``(loss,
        new_model_state)``. The global view computes statistics over the global batch, so the
        replicated model state is one value; it is kept only on applied steps.

    Returns:
      ``step(params, opt_state, batch[, rng]) -> (params, opt_state, metrics)`` with params,
      opt_state and metrics replicated over the mesh and batch sharded over the data axis (pass
      the output of :func:`make_global_batch`; host arrays are sharded on the way in within one
      process). ``metrics``: ``loss``, ``loss_scale``, ``last_step_finite``, ``consecutive_skips``,
      ``total_skips``. The jitted functions are ``step.jitted`` and ``step.jitted_with_rng``.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
      >>> params = {"w": jnp.zeros(3)}
      >>> step = jaxmp.parallel.make_sharded_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), tx, mesh)
      >>> p, s = jaxmp.parallel.replicate_on_mesh((params, tx.init(params)), mesh)
      >>> batch = jaxmp.parallel.make_global_batch({"x": np.ones((16, 3), np.float32), "y": np.ones(16, np.float32)}, mesh)
      >>> p, s, metrics = step(p, s, batch)
      >>> float(metrics["loss"]), p["w"]
      (1.0, Array([0.2, 0.2, 0.2], dtype=float32))
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
    axis = _data_axis(mesh, data_axis)
    rep = replicated_sharding(mesh)
    data = NamedSharding(mesh, PartitionSpec(axis))
    identity = lambda x: x  # noqa: E731 - the global view needs no explicit reduction
    common = dict(has_aux=has_aux, reduce_grads=identity, reduce_loss=identity, with_model_state=model_state,
                  reduce_model_state=identity)
    body = make_step_body(loss_fn, tx, with_rng=False, **common)
    body_rng = make_step_body(loss_fn, tx, **common,
                              with_rng=True)
    donate_argnums = (0, 1) if donate else ()
    jitted = jax.jit(body, in_shardings=(rep, rep, data), out_shardings=(rep, rep, rep),
                     donate_argnums=donate_argnums)
    jitted_rng = jax.jit(body_rng, in_shardings=(rep, rep, data, rep), out_shardings=(rep, rep, rep),
                         donate_argnums=donate_argnums)
    num_devices = mesh.shape[axis]

    def run(params, opt_state, batch, rng=None):
        # Checked here, not left to jit: its error for an indivisible batch does not say why.
        global_batch = leading_size(batch)
        per_device = check_divisible(global_batch, num_devices)
        log_once("jaxmp.parallel: sharded step over %d devices (axis %r), global batch %d -> per-device batch %d",
                 num_devices, axis, global_batch, per_device)
        if rng is None:
            return jitted(params, opt_state, batch)
        return jitted_rng(params, opt_state, batch, rng)

    step = with_model_state(run, model_state)

    step.jitted = jitted
    step.jitted_with_rng = jitted_rng
    step.mesh = mesh
    return step
