"""The ``jax.pmap`` path: a data-parallel train step whose replicas agree on every skip.

JAX keeps ``pmap`` in maintenance and recommends sharded ``jit`` (see
`jaxmp.parallel._sharding`); this path remains for code bases built on ``pmap`` and
for explicit control of the gradient all-reduce dtype.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp._scaling import _loss_view
from jaxmp._scaling._collectives import check_axis_name, check_reduce_dtype
from jaxmp._typing import AxisName
from jaxmp.parallel._checks import check_concrete, check_not_donated, log_once, step_form, with_model_state
from jaxmp.parallel._replication import check_replicated
from jaxmp._step import Replicas, TrainStep, check_argument_order, make_loss_fn_step, step_record

_CHECK_MODES = ("first", "always", "never")


@step_record
class PmapTrainStep(TrainStep):
    """The pmap step's record: `jaxmp._step.TrainStep`'s fields and what the ``pmap`` is made of.

    Attributes:
      reduce_dtype: the gradient all-reduce's dtype (None: each gradient's own).
      pmapped: the ``jax.pmap``-ed body without an rng.
      pmapped_with_rng: the ``jax.pmap``-ed body with an rng.
      num_devices: the local device count it runs over.
    """

    builder_call: ClassVar[str] = "jaxmp.parallel.make_pmap_train_step(loss_fn, tx)"
    call_form: ClassVar[str] = "params, opt_state, metrics = step(params, opt_state, batch)"

    reduce_dtype: Any
    pmapped: Callable[..., Any]
    pmapped_with_rng: Callable[..., Any]
    num_devices: int


def _relabel(tree: Any, target: NamedSharding) -> Any:
    """Re-labels pmap-layout arrays laid out over another axis name onto ``target``, without a copy.

    ``jax.pmap`` compiles again for inputs whose mesh axis is named differently from its own
    (e.g. ``flax.jax_utils.replicate``'s, or a batch from a prefetcher), even when the devices and
    the layout are the same -- a second full compile on the second step. The shards are
    reused as they are; only the sharding label changes.
    """
    target_devices = list(target.mesh.devices.flat)

    def fix(x):
        if not isinstance(x, jax.Array) or x.ndim == 0:
            return x
        sh = x.sharding
        if sh == target or not isinstance(sh, NamedSharding) or len(sh.mesh.axis_names) != 1:
            return x
        if sh.spec != PartitionSpec(sh.mesh.axis_names[0]) or list(sh.mesh.devices.flat) != target_devices:
            return x
        return jax.make_array_from_single_device_arrays(x.shape, target, [s.data for s in x.addressable_shards])

    return jax.tree_util.tree_map(fix, tree)


def _leading_sizes(tree: Any) -> set:
    return {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree_util.tree_leaves(tree)}


def make_pmap_train_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                         axis_name: AxisName = "batch", *,
                         reduce_dtype: jax.typing.DTypeLike | None = jnp.float32, has_aux: bool = False,
                         devices: Sequence[Any] | None = None, donate: bool = False,
                         check_replicas: str = "first", model_state: bool = False) -> PmapTrainStep:
    """A ``jax.pmap``-ed data-parallel train step with loss scaling that every replica agrees on.

    Each step, on every device: the loss of the device's batch shard is scaled and
    differentiated ([`jaxmp.value_and_grad`][jaxmp.value_and_grad] reads the scale from ``opt_state``), the
    gradients are all-reduced ([`all_reduce_gradients`][jaxmp.parallel.all_reduce_gradients], a mean, in ``reduce_dtype``),
    then ``tx.update`` unscales them, checks them for inf/NaN, applies or skips the step and
    adjusts the scale. Because the check runs *after* the all-reduce, a NaN in one replica's
    shard, or an overflow of a half-precision sum, reaches every replica: all of them skip and
    back off identically. Build ``tx`` with ``jaxmp.loss_scaling(..., axis_name=axis_name)`` as
    well: the verdict is then also ``pmin``-reduced in float32 (belt and braces; a ``tx`` built
    for another axis name fails with a ValueError naming the unbound axis).

    The gradient is the mean of per-device mean gradients, which equals the global-batch mean
    because [`jaxmp.parallel.shard_batch`][jaxmp.parallel.shard_batch] only makes equal shards.

    Args:
      loss_fn: ``loss_fn(params, batch)`` or, when the step is called with an rng,
        ``loss_fn(params, batch, rng)``; returns a scalar float32 loss, or ``(loss, aux)`` with
        ``has_aux``. Cast to the compute dtype inside (``policy.cast_to_compute``) and return
        the loss in float32.
      tx: an optax transformation whose state holds a [`jaxmp.loss_scaling`][jaxmp.loss_scaling] state.
      axis_name: the pmap axis name.
      reduce_dtype: dtype of the gradient all-reduce: float32 (default, safe); float16 or
        bfloat16 to halve communication (float16's sum can overflow, which costs a skipped step,
        see [`all_reduce_gradients`][jaxmp.parallel.all_reduce_gradients]); ``None`` for each gradient's own dtype.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` is returned per replica in
        ``metrics["aux"]`` (not reduced). BatchNorm statistics go through ``model_state=True``,
        never through ``aux`` (an aux dict with ``batch_stats`` is a ValueError: it would drift).
      devices: the devices to run on; default ``jax.local_devices()``.
      donate: donate the params and optimizer state buffers (saves memory; the inputs must not
        be used after the call).
      check_replicas: ``"first"`` (default) checks on the first call that params and optimizer
        state are bitwise identical across replicas (a host sync, once); ``"always"`` on every
        call; ``"never"``. The leading-axis check runs on every call (it is cheap).
      model_state: the model has state besides its params: the step is then ``step(params,
        model_state, opt_state, batch[, rng])`` and ``loss_fn(params, model_state, batch[, rng])``
        returns ``(loss, new_model_state)``. Its floating leaves are averaged over the replicas in
        float32 (a leaf every replica holds bitwise the same is kept as it is, so a state the loss
        passes through never drifts by rounding), and it is kept only on applied steps.

    Returns:
      ``step(params, opt_state, batch[, rng]) -> (params, opt_state, metrics)`` where params and
      opt_state are replicated ([`jaxmp.parallel.replicate`][jaxmp.parallel.replicate]), batch is sharded
      ``[num_devices, per_device_batch, ...]`` ([`jaxmp.parallel.shard_batch`][jaxmp.parallel.shard_batch]), rng is one PRNG key
      (each device folds in its axis index, so dropout masks differ between devices), and
      metrics (a dict, the keys of every jaxmp step) holds, per replica,
      ``loss`` (the global mean loss), ``loss_scale``, ``last_step_finite``,
      ``consecutive_skips`` and ``total_skips`` (and ``aux`` with ``has_aux``). The step is a
      `PmapTrainStep` record (a `jaxmp._step.TrainStep`): the pmapped function is ``step.pmapped`` (and
      ``step.pmapped_with_rng``), with ``step.reduce_dtype``, ``step.num_devices``, ``step.loss_fn``.

    Raises:
      ValueError: (when called) params/opt_state/batch without a leading axis of the device
        count, replicas that differ, or an axis name ``tx`` does not know.
      TypeError: a ``reduce_dtype`` that is not a floating dtype.
      ValueError: an 8-bit ``reduce_dtype`` (fp8), which cannot hold gradients.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax, jaxmp
      >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(), axis_name="batch")
      >>> params = {"w": jnp.zeros(3)}
      >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
      >>> step = jaxmp.parallel.make_pmap_train_step(loss_fn, tx, "batch")
      >>> p, s = jaxmp.parallel.replicate(params), jaxmp.parallel.replicate(tx.init(params))
      >>> batch = jaxmp.parallel.shard_batch(
      ...     {"x": np.ones((16, 3), np.float32), "y": np.ones(16, np.float32)})
      >>> p, s, metrics = step(p, s, batch)
      >>> jaxmp.parallel.unreplicate(p)["w"], float(metrics["loss"][0])
      (Array([0.2, 0.2, 0.2], dtype=float32), 1.0)
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
    axis_name = check_axis_name(axis_name)
    reduce_dtype = check_reduce_dtype(reduce_dtype)
    if check_replicas not in _CHECK_MODES:
        raise ValueError(f"check_replicas must be one of {_CHECK_MODES}, got {check_replicas!r}")
    devices = None if devices is None else list(devices)
    n = jax.local_device_count() if devices is None else len(devices)

    donate_argnums = (0, 1) if donate else ()
    # The replicas' layout: gradients all-reduced in reduce_dtype, loss and model state pmean-ed,
    # and one key in, a different key per device (dropout masks must differ between shards, as
    # they would across the examples of one big batch).
    strategy = Replicas(axis_name, reduce_dtype)
    body = make_loss_fn_step(loss_fn, tx, strategy, has_aux=has_aux, with_rng=False, with_model_state=model_state)
    body_rng = make_loss_fn_step(loss_fn, tx, strategy, has_aux=has_aux, with_rng=True, with_model_state=model_state)
    pmapped = jax.pmap(body, axis_name=axis_name, devices=devices, donate_argnums=donate_argnums)
    pmapped_rng = jax.pmap(body_rng, axis_name=axis_name, in_axes=(0, 0, 0, None), devices=devices,
                           donate_argnums=donate_argnums)
    checked = [False]
    # pmap's own output layout; inputs laid out the same way under another axis name are
    # re-labelled to it (see _relabel).
    layout = NamedSharding(Mesh(np.asarray(devices or jax.local_devices()), (axis_name,)), PartitionSpec(axis_name))

    def check_leading(tree, what, hint):
        sizes = _leading_sizes(tree)
        if sizes != {n}:
            found = sorted(str(s) for s in sizes)
            raise ValueError(
                f"{what} must have a leading axis of size {n} (the local device count) on every leaf, "
                f"found leading sizes {', '.join(found)}: {hint}"
            )

    def run(params, opt_state, batch, rng=None):
        # A donated state used again would crash or fail deep inside pmap (this step's, or another's).
        check_not_donated(params, opt_state, by="this step" if donate else "a step built with donate=True")
        check_concrete(params, "params")
        check_concrete(opt_state, "opt_state")
        if not checked[0]:
            check_argument_order(params, step_form(model_state))
        check_leading(params, "params", "replicate them with jaxmp.parallel.replicate(params)")
        check_leading(opt_state, "opt_state", "replicate it with jaxmp.parallel.replicate(tx.init(params))")
        check_leading(batch, "batch", f"split the global batch with jaxmp.parallel.shard_batch(batch, {n})")
        if check_replicas == "always" or (check_replicas == "first" and not checked[0]):
            check_replicated(params, num_replicas=n, name="params (and model state)" if model_state else "params")
            check_replicated(opt_state, num_replicas=n, name="opt_state")
        if not checked[0]:
            first = jax.tree_util.tree_leaves(batch)[0]
            per_device = jnp.shape(first)[1] if jnp.ndim(first) > 1 else 1
            log_once("jaxmp.parallel: pmap step over %d local devices (axis %r), per-device batch %d, "
                     "gradient all-reduce in %s", n, axis_name, per_device,
                     "each gradient's dtype" if reduce_dtype is None else reduce_dtype.name)
            checked[0] = True
        params, opt_state, batch = _relabel((params, opt_state, batch), layout)
        if rng is None:
            return pmapped(params, opt_state, batch)
        return pmapped_rng(params, opt_state, batch, rng)

    # The debugger cannot see into the pmap: it runs the loss this step wraps.
    view = _loss_view.generic_view(loss_fn, has_aux=has_aux, model_state=model_state,
                                   name=f"make_pmap_train_step(axis_name={axis_name!r})", per_device=True)
    return PmapTrainStep(with_model_state(run, model_state), loss_fn, view, reduce_dtype=reduce_dtype,
                         pmapped=pmapped, pmapped_with_rng=pmapped_rng, num_devices=n)
