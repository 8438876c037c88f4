"""The sharded-``jit`` path (JAX's recommended one): a mesh with a data axis, plain ``jax.jit``.

Why ``loss_scaling(..., axis_name=None)`` is right here and how the same code runs on several
hosts: docs/parallel.md#sharded-jit-recommended and docs/parallel.md#multi-host.
"""

from __future__ import annotations

import collections
import itertools
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp._scaling import _loss_view
from jaxmp._scaling._collectives import check_reduce_dtype
from jaxmp._typing import PyTree
from jaxmp.engine._seams import debugger_tracing_enabled
from jaxmp.parallel import _layouts as layouts, _per_layer as per_layer, _shard_step as shard_step, _wire as wire_mod
from jaxmp.parallel._checks import (
    abstract_leaf_error, step_form,
    check_divisible, check_not_donated, check_positive_int, leading_size, log_once, with_model_state,
)
from jaxmp.parallel._replication import is_pmap_replicated
from jaxmp._step import TrainStep, check_argument_order, make_loss_fn_step, step_record

if TYPE_CHECKING:
    from jaxmp.fp8 import CurrentScaling


@step_record
class ShardedTrainStep(TrainStep):
    """The sharded step's record: `jaxmp._step.TrainStep`'s fields and the state's layout.

    Attributes:
      layout: the state's `jaxmp.parallel._layouts.Layout` (mesh, data axis, layout name):
        ``shard_state(state, step.layout)``.
      reduce_dtype: the gradient reduction's dtype (None: XLA's, on the global batch).
      lower: ``lower(*step_args) -> jax.stages.Lowered`` (no run).
      shardings: ``shardings(params, opt_state) -> (param shardings, opt_state shardings)``.
    """

    builder_call: ClassVar[str] = "jaxmp.parallel.make_sharded_train_step(loss_fn, tx, step.layout)"
    call_form: ClassVar[str] = "params, opt_state, metrics = step(params, opt_state, batch)"

    layout: layouts.Layout
    reduce_dtype: Any
    lower: Callable[..., Any]
    shardings: Callable[..., Any]

    @property
    def mesh(self) -> Mesh:
        """The mesh (``step.layout.mesh``)."""
        return self.layout.mesh


def make_data_mesh(devices: Sequence[Any] | None = None, axis_name: str = "data") -> Mesh:
    """A one-dimensional ``jax.sharding.Mesh`` over all devices, with a data-parallel axis.

    Args:
      devices: default ``jax.devices()`` (all processes' devices, in process order).
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


def batch_sharding(mesh: Mesh, data_axis: str | None = None) -> NamedSharding:
    """Sharding of a batch: leading axis split over the data axis, the rest unsplit.

    Args:
      mesh: the mesh (e.g. from [`make_data_mesh`][jaxmp.parallel.make_data_mesh]).
      data_axis: the mesh axis to split over; default the mesh's only axis.

    Returns:
      ``NamedSharding(mesh, PartitionSpec(data_axis))``.

    Example:
      >>> import jaxmp
      >>> jaxmp.parallel._sharding.batch_sharding(jaxmp.parallel.make_data_mesh()).spec
      P('data',)
    """
    return NamedSharding(mesh, PartitionSpec(layouts.check_data_axis(mesh, data_axis)))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of the state: a full copy on every device of the mesh.

    Args:
      mesh: the mesh.

    Returns:
      ``NamedSharding(mesh, PartitionSpec())``.

    Example:
      >>> import jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> jaxmp.parallel.replicated_sharding(mesh).is_fully_replicated
      True
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    return NamedSharding(mesh, PartitionSpec())


def replicate_on_mesh(tree: PyTree, mesh: Mesh) -> PyTree:
    """Places a full copy of every leaf on every device of the mesh (the sharded-jit state layout).

    Args:
      tree: a pytree of arrays (params, optimizer state), the same on every process (each
        fills its own devices).
      mesh: the mesh.

    Returns:
      The pytree of fully replicated global ``jax.Array`` leaves.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> w = jaxmp.parallel.replicate_on_mesh({"w": jnp.ones(3)}, mesh)["w"]
      >>> w.sharding.is_fully_replicated
      True
    """
    sharding = replicated_sharding(mesh)

    def rep(x):
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map(rep, tree)


def make_global_batch(local_batch: PyTree, mesh: Mesh, data_axis: str | None = None) -> PyTree:
    """Assembles this process's batch into global arrays sharded over the data axis.

    Args:
      local_batch: a pytree of host arrays with a leading batch axis: the whole batch with one
        process, this process's rows with several (docs/parallel.md#multi-host).
      mesh: the mesh (e.g. [`make_data_mesh`][jaxmp.parallel.make_data_mesh]).
      data_axis: the mesh axis to split the batch over; default the mesh's only axis.

    Returns:
      The pytree of global ``jax.Array`` leaves sharded ``PartitionSpec(data_axis)``.

    Raises:
      ValueError: a global batch the data axis's devices do not divide, or leaves that
        disagree on the batch size.

    Example:
      >>> import numpy as np, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> b = jaxmp.parallel.make_global_batch({"x": np.zeros((16, 3))}, mesh)
      >>> b["x"].shape
      (16, 3)
    """
    axis = layouts.check_data_axis(mesh, data_axis)
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
      Global batches as from [`make_global_batch`][jaxmp.parallel.make_global_batch].

    Example:
      >>> import numpy as np, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> batches = iter([{"x": np.zeros((16, 3))}])
      >>> it = jaxmp.parallel._sharding.prefetch_to_mesh(batches, mesh)
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


def _describe(sharding: Any) -> str:
    if isinstance(sharding, NamedSharding):
        return f"{sharding.spec} on a mesh {dict(sharding.mesh.shape)}"
    return type(sharding).__name__


def enter_layout(tree: Any, shardings: Any, mesh: Mesh, layout: str, what: str) -> Any:
    """``tree`` with every ``jax.Array`` leaf resharded to ``shardings`` (logged once); host arrays pass.

    Raises:
      ValueError: a pmap-replicated leaf (a leading device axis: no resharding makes it the state).
    """
    def enter(path, x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct):
            raise abstract_leaf_error(what, jax.tree_util.keystr(path) or "<root>")
        current = getattr(x, "sharding", None)
        if not isinstance(x, jax.Array) or current is None:
            return x
        name = jax.tree_util.keystr(path) or "<root>"
        if is_pmap_replicated(x):
            raise layouts.pmap_state_error(what, name, x.shape, layout)
        if current.is_equivalent_to(sharding, x.ndim):
            return x
        log_once("jaxmp.parallel: %s laid out as %s (first at %s) resharded to the step's layout %r (%s)",
                 what, _describe(current), name, layout, _describe(sharding))
        return jax.device_put(x, sharding)

    return jax.tree_util.tree_map_with_path(enter, tree, shardings)


def _check_zero_gathers_a_copy(wire: Any, lay: layouts.Layout, opt_state: Any) -> None:
    """ZeRO's gathered params are the params the step returns: quantized, they must be a copy made
    from a master each step (``master_weights=True``), never the values the optimizer updates."""
    from jaxmp import _tree
    from jaxmp._scaling._transform import MasterWeightsState

    if wire is None or wire.gather_bits is None or lay.shards_params:
        return
    if not _tree.find_states(opt_state, MasterWeightsState):
        raise ValueError(
            "gather_bits under layout='zero' quantizes the params the step gathers and returns, so they must be a copy "
            "made from a float32 master each step: build the optimizer with jaxmp.loss_scaling(..., "
            "master_weights=True). Without a master (or with bf16 remainders) the params are the values the optimizer "
            "updates and the quantization would be written back; use layout='fsdp', whose gathered copy is "
            "transient, or gather_bits=None")


def _jitted_steps(loss_fn: Callable[..., Any], tx: Any, lay: layouts.Layout, state: tuple[Any, Any], *,
                  reduce_dtype: Any, remat: Any, has_aux: bool, model_state: bool, donate: bool,
                  wire: Any = None) -> tuple:
    """A sharded step's jitted steps for states of this structure and these shapes (shardings follow shapes).

    Returns:
      ``(jitted, jitted_with_rng, (param_shardings, opt_state_shardings))``.
    """
    params, opt_state = state
    mesh = lay.mesh
    if reduce_dtype is not None:
        _check_zero_gathers_a_copy(wire, lay, opt_state)
    p_specs, o_specs, g_specs = layouts.state_specs(params, opt_state, mesh, lay.name, data_axis=lay.data_axis,
                                                    param_specs=lay.param_specs, min_shard_size=lay.min_shard_size)
    p_sh, o_sh, g_sh = (layouts.named_shardings(mesh, specs) for specs in (p_specs, o_specs, g_specs))
    # Two strategies: each data shard differentiates its own loss and reduces in reduce_dtype, or
    # (None) the loss is the global view and XLA reduces.
    if reduce_dtype is None:
        strategy: shard_step.Sharded = shard_step.GlobalView(
            lay, g_sh, p_sh, base_specs=layouts.param_tree_specs(params, lay.param_specs), remat=remat)
    else:
        strategy = shard_step.PerShard(lay, g_sh, p_sh, reduce_dtype=reduce_dtype, grad_specs=g_specs, remat=remat,
                                       wire=wire)
    rep, data = replicated_sharding(mesh), NamedSharding(mesh, PartitionSpec(lay.data_axis))
    first = (p_sh, rep) if model_state else p_sh

    def jitted(with_rng: bool) -> Any:
        body = make_loss_fn_step(loss_fn, tx, strategy, has_aux=has_aux, with_rng=with_rng,
                                 with_model_state=model_state)
        return jax.jit(body, in_shardings=(first, o_sh, data) + ((rep,) if with_rng else ()),
                       out_shardings=(first, o_sh, rep), donate_argnums=(0, 1) if donate else ())

    return jitted(False), jitted(True), (p_sh, o_sh)


def make_sharded_train_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, mesh: Mesh | layouts.Layout, *,
                            data_axis: str | None = None, has_aux: bool = False, donate: bool = False,
                            model_state: bool = False, layout: str | None = None,
                            reduce_dtype: jax.typing.DTypeLike | None = "float32", param_specs: PyTree | None = None,
                            min_shard_size: int | None = None,
                            remat: str | Callable[..., bool] | None = None, gather_bits: int | str | CurrentScaling | None = None,
                            reduce_bits: int | None = None, wire_block: int = wire_mod.DEFAULT_BLOCK) -> ShardedTrainStep:
    """A ``jax.jit`` train step: the batch sharded over the mesh's data axis, the state in ``layout``.

    [`make_pmap_train_step`][jaxmp.parallel.make_pmap_train_step]'s semantics without ``pmap``.
    See docs/parallel.md#sharded-jit-recommended (``loss_scaling(..., axis_name=None)``, the
    step's form and attributes, ``shard_state(state, step.layout)``) and
    docs/parallel.md#gradient-reduce-dtype (the per-shard loss, ``aux``, BatchNorm statistics).

    Args:
      loss_fn: ``loss_fn(params, batch[, rng])`` returning a scalar float32 loss (the mean over
        the batch it is given), or ``(loss, aux)`` with ``has_aux``.
      tx: an optax transformation holding a [`jaxmp.loss_scaling`][jaxmp.loss_scaling] state.
      mesh: the mesh ([`make_data_mesh`][jaxmp.parallel.make_data_mesh], or one with a model
        axis too), or another step's ``step.layout`` (then no other layout option).
      data_axis: the mesh axis the batch and a sharded state are split over; default the only one.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` goes to ``metrics["aux"]``.
      donate: donate the params and optimizer state buffers.
      model_state: the model has state besides its params (BatchNorm ``batch_stats``): the
        step and ``loss_fn`` take it after the params, ``loss_fn`` returns ``(loss, new_state)``.
      layout: ``"replicated"`` (default), ``"zero"`` or ``"fsdp"``.
      reduce_dtype: the gradient reduction's dtype (``"float32"`` default, ``"bfloat16"``,
        ``"float16"``: the loss runs per data shard), or ``None`` (XLA's, on the global batch).
      param_specs: the params' ``PartitionSpec`` tree over the other (model) mesh axes.
      min_shard_size: leaves with fewer elements stay replicated (default 1024).
      remat: the per-layer policy of `jaxmp.parallel.scan_layers`: ``None`` (default),
        ``"nothing_saveable"``, ``"dots_saveable"`` or a ``jax.checkpoint`` policy. Under
        ``"fsdp"`` a layer's gathered params are never kept for the backward: they are gathered again.
      gather_bits: ``8`` gathers the params as blockwise 8-bit codes and float32 scales,
        dequantized to their dtype where they are used (``"zero"``: after the update, which needs
        ``master_weights=True``; ``"fsdp"``: in the loss and in `scan_layers`); ``None`` (default)
        gathers them in their dtype. Under ``"fsdp"`` it also takes the fp8 format of the loss's
        matmuls, ``"O2-fp8-current"`` (or a per-tensor ``jaxmp.fp8.CurrentScaling()``) or
        ``"O2-fp8-block128"``: each
        kernel (a leaf whose path ends in ``kernel``) is gathered as that format's codes with its
        matmul's own scale, so the matmul does not quantize it again (bitwise the run without
        wire options, 1 byte a parameter); other leaves in their dtype.
        docs/parallel.md#precision-on-the-wire.
      reduce_bits: ``8`` or ``4`` reduces the sharded gradients as blockwise codes exchanged by
        ``all_to_all`` and summed in float32 (a replicated leaf of at least N x ``wire_block``
        elements too, then all-gathered); ``None`` (default) reduces in ``reduce_dtype``.
      wire_block: elements a float32 scale of those codes (default 256), inside each device's piece.

    Returns:
      ``step(params, opt_state, batch[, rng]) -> (params, opt_state, metrics)`` (``metrics``:
      ``loss``, ``loss_scale``, ``last_step_finite``, ``consecutive_skips``, ``total_skips``,
      ``aux``), with ``step.layout``, ``step.lower(...)`` and ``step.shardings(params, opt_state)``.

    Raises:
      ValueError: unknown layout, a data axis the mesh lacks, an fp8 ``reduce_dtype``, ``gather_bits``
        or ``reduce_bits`` outside their values or on ``"replicated"`` or with ``reduce_dtype=None``, or (at
        the call) a batch that does not divide over the data axis, or ZeRO's ``gather_bits`` without masters;
        a ``gather_bits`` format other than those two, or not under ``"fsdp"``, or (at the call) with no
        kernel to gather or with weight blocks split between devices.
      TypeError: a ``reduce_dtype`` that is not a floating dtype.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> tx = jaxmp.loss_scaling(
      ...     optax.adam(0.1), jaxmp.DynamicLossScale(), master_weights=True)
      >>> params = {"w": jnp.zeros((3, 1024), jnp.bfloat16)}
      >>> loss = lambda p, b: jnp.mean((b["x"] @ p["w"].astype(jnp.float32) - b["y"]) ** 2)
      >>> step = jaxmp.parallel.make_sharded_train_step(loss, tx, mesh, layout="zero")
      >>> p, s = jaxmp.parallel.shard_state((params, tx.init(params)), step.layout)
      >>> batch = jaxmp.parallel.make_global_batch(
      ...     {"x": np.ones((16, 3), np.float32), "y": np.ones((16, 1024), np.float32)},
      ...     mesh)
      >>> p, s, metrics = step(p, s, batch)
      >>> jaxmp.master_params(s)["w"].sharding.spec, p["w"].sharding.is_fully_replicated
      (P(None, 'data'), True)
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
    state_layout = layouts.resolve_layout(mesh, layout, data_axis=data_axis, param_specs=param_specs,
                                          min_shard_size=min_shard_size)
    mesh, layout, axis = state_layout.mesh, state_layout.name, state_layout.data_axis
    layouts.check_auto_axes(mesh)
    reduce_dtype = check_reduce_dtype(reduce_dtype)
    wire = wire_mod.check_wire(gather_bits, reduce_bits, wire_block, state_layout, reduce_dtype)
    remat = per_layer.remat_policy(remat)
    rep = replicated_sharding(mesh)
    num_devices = mesh.shape[axis]
    cache: dict = {}

    def get(state, opt_state):
        params = state[0] if model_state else state
        # Traced by the precision debugger, the step differentiates its loss on the global batch
        # (reduce_dtype None): the debugger runs a shard_map as one op, so inside one its float32
        # shadow would be the policy run itself. The same loss, as the step's loss_view runs it.
        reduce = None if debugger_tracing_enabled() else reduce_dtype
        sig = jax.tree_util.tree_structure((params, opt_state)), tuple(
            (tuple(jnp.shape(x)), str(getattr(x, "dtype", type(x)))) for x in jax.tree_util.tree_leaves((params, opt_state)))
        if (sig, reduce) not in cache:
            # Once per state shape: a pmap-replicated state, or a swapped one, has its own, so it comes here.
            check_argument_order(state, step_form(model_state))
            layouts.check_not_pmap_state(params, opt_state, layout)
            cache[sig, reduce] = _jitted_steps(loss_fn, tx, state_layout, (params, opt_state), reduce_dtype=reduce,
                                               remat=remat, has_aux=has_aux, model_state=model_state, donate=donate,
                                               wire=wire)
        return cache[sig, reduce]

    def run(params, opt_state, batch, rng=None):
        # A donated state used again crashes the process (SIGSEGV) instead of raising; one donated
        # to another step is JAX's "Array has been deleted".
        check_not_donated(params, opt_state, by="this step" if donate else "a step built with donate=True")
        # Checked here, not left to jit: its error for an indivisible batch does not say why.
        global_batch = leading_size(batch)
        per_device = check_divisible(global_batch, num_devices)
        log_once("jaxmp.parallel: sharded step over %d devices (axis %r, layout %s), global batch %d -> "
                 "per-device batch %d", num_devices, axis, layout, global_batch, per_device)
        jitted, jitted_rng, (p_sh, o_sh) = get(params, opt_state)
        if model_state:
            params = (enter_layout(params[0], p_sh, mesh, layout, "params"),
                      enter_layout(params[1], jax.tree_util.tree_map(lambda _: rep, params[1]), mesh, layout,
                                   "model state"))
        else:
            params = enter_layout(params, p_sh, mesh, layout, "params")
        opt_state = enter_layout(opt_state, o_sh, mesh, layout, "opt_state")
        if rng is None:
            return jitted(params, opt_state, batch)
        return jitted_rng(params, opt_state, batch, rng)

    def lower(params, opt_state, batch, rng=None):
        jitted, jitted_rng, _ = get(params, opt_state)
        return jitted.lower(params, opt_state, batch) if rng is None else jitted_rng.lower(params, opt_state, batch, rng)

    if model_state:
        def lower_step(params, state, opt_state, batch, rng=None):
            return lower((params, state), opt_state, batch, rng)
    else:
        lower_step = lower
    # The debugger cannot see into the per-shard shard_map: it runs the loss this step wraps.
    view = _loss_view.generic_view(
        loss_fn, has_aux=has_aux, model_state=model_state,
        name=f"make_sharded_train_step(layout={layout!r}, reduce_dtype={getattr(reduce_dtype, 'name', None)!r})")
    return ShardedTrainStep(with_model_state(run, model_state), loss_fn, view, layout=state_layout,
                            reduce_dtype=reduce_dtype, lower=lower_step,
                            shardings=lambda params, opt_state: get(params, opt_state)[2])
