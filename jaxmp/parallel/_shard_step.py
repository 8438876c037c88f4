"""The sharded step's strategies (`Sharded`: `PerShard`, `GlobalView`) and differentiation: the
per-shard loss and gradient of a reduce dtype.

The step of `jaxmp.parallel.make_sharded_train_step` differentiates through here when the
gradient is reduced over the data axis in a dtype of its own (one ``shard_map`` over the data
shards, each param's gradient reduced by a ``custom_vjp`` identity), or with a global-view loss
under ``jax.remat``/``scan_layers``. The layouts themselves are in `jaxmp.parallel._layouts`.
See docs/parallel.md#gradient-reduce-dtype.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxmp._dtypes import accumulation_dtype
from jaxmp._step import Strategy
from jaxmp.lean._seams import whole_leaves
from jaxmp.parallel._layouts import Layout, axes_of, is_float_leaf, make_spec


def _mean_over_shards(x: jax.Array) -> jax.Array:
    # The model state's rule. Floating leaves (BatchNorm statistics) are averaged over the shards
    # in at least float32; others (int counters, keys) advance alike on every shard: shard 0's.
    # A leaf equal on every shard (a model state the loss passes through unchanged) is returned as
    # is: a mean of n equal values need not be that value in floating point.
    if is_float_leaf(x):
        acc = accumulation_dtype(x.dtype)
        mean = jnp.mean(x.astype(acc), axis=0).astype(x.dtype)
        return jnp.where(jnp.all(x == x[0]), x[0], mean)
    return x[0]


def _reduce_aux_leaf(x: jax.Array) -> jax.Array:
    # aux leaves that are not per-example: a floating one is a mean (a metric), an integer one a
    # count (correct predictions, valid tokens), which only a sum over the shards keeps global,
    # even when every shard counts the same; a bool is a flag raised on any shard.
    if is_float_leaf(x):
        return _mean_over_shards(x)
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.bool_):
        return jnp.any(x, axis=0)
    if dtype is not None and jnp.issubdtype(dtype, jnp.integer):
        return jnp.sum(x, axis=0, dtype=dtype)
    return x[0]


def _reassemble_aux(aux: Any, global_aux: Any, n: int) -> Any:
    """The per-shard ``aux`` (leaves stacked ``[n, ...]``) in the layout of ``global_aux``'s shapes.

    Per-example leaves concatenated, others reduced (`_reduce_aux_leaf`), any other pair refused:
    docs/parallel.md#gradient-reduce-dtype.
    """
    def leaf(path, x, g):
        shard, whole = tuple(x.shape[1:]), tuple(g.shape)
        if shard == whole:
            return _reduce_aux_leaf(x)
        if len(shard) >= 1 and len(shard) == len(whole) and shard[1:] == whole[1:] and whole[0] == n * shard[0]:
            return jnp.reshape(x, whole)
        raise ValueError(
            f"aux leaf at {jax.tree_util.keystr(path) or '<root>'} has shape {shard} per data shard but {whole} on the "
            f"global batch: it is neither per-example (leading axis {n} times the shard's) nor batch-independent, so "
            "it cannot be rebuilt from the shards; use make_sharded_train_step(..., reduce_dtype=None) to evaluate the "
            "loss on the global batch")

    return jax.tree_util.tree_map_with_path(leaf, aux, global_aux)


def _manual_spec(spec: PartitionSpec, axis: str) -> PartitionSpec:
    # shard_map is manual over the data axis only; a model axis stays XLA's (auto).
    return make_spec([axis if axis in axes_of(e) else None for e in spec])


def recorded_leaves(canonical: Any, params: Any, model_state: Any, batch: Any, rng: Any) -> set:
    """Indices (in ``tree_leaves(params)`` order) of the params leaves the loss gathers itself.

    Those `jaxmp.parallel.gather_params` / `jaxmp.parallel.scan_layers` see, in one abstract trace.
    """
    from jaxmp.parallel import _per_layer as per_layer

    ctx = per_layer.LayerContext("record")
    found: set = set()

    def trace(p):
        ids = [id(x) for x in jax.tree_util.tree_leaves(p)]
        with per_layer.context(ctx):
            out = canonical(p, model_state, batch, rng)
        found.update(i for i, x in enumerate(ids) if x in ctx.recorded)
        return out[0]

    jax.eval_shape(trace, params)
    return found


def global_view_loss(layout: Layout, base_specs: Any, remat: Any) -> Any:
    """The loss wrapper of ``reduce_dtype=None``: what the per-layer helpers do in it (gather, remat).

    Where the layout shards the params (``"fsdp"``) `jaxmp.parallel.gather_params` and
    `jaxmp.parallel.scan_layers` constrain a param to its spec without the data axis where it is used.
    """
    from jaxmp.parallel import _per_layer as per_layer

    mesh = layout.mesh

    def wrap(canonical):
        def loss(params, model_state, batch, rng):
            leaves = {}
            if layout.shards_params:
                p_leaves, treedef = jax.tree_util.tree_flatten(params)
                leaves = {id(p): NamedSharding(mesh, b) for p, b in zip(p_leaves, treedef.flatten_up_to(base_specs))}
            with per_layer.context(per_layer.LayerContext("global", leaves=leaves, remat=remat, mesh=mesh)):
                return canonical(params, model_state, batch, rng)

        return loss

    return wrap


def _leaf_plan(layout: Layout, leaves: list, g_leaves: list, deferred: set) -> tuple:
    """How each param leaf enters the per-shard loss, by the layout's facts.

    Returns ``(fixed, fixed_specs, diff, diff_specs, kinds)``: ``fixed`` the inputs not
    differentiated (ZeRO's whole params: their gradient goes to the slice); ``diff`` one per
    param leaf, the input its reduced gradient belongs to; ``kinds`` one ``(kind, dim)`` per leaf:
    ``"all"`` (all-reduced, a replicated gradient), ``"scatter"`` (reduce-scattered onto the
    slice of a whole param), ``"gather"`` (a sharded param gathered, its gradient
    reduce-scattered) or ``"defer"`` (a sharded param the loss gathers itself where it is used).
    """
    axis = layout.data_axis
    fixed, fixed_specs, diff, diff_specs = [], [], [], []
    kinds: list[tuple[str, int | None]] = []
    for i, (p, g) in enumerate(zip(leaves, g_leaves)):
        dims = [d for d, e in enumerate(g) if axis in axes_of(e)]
        if not layout.shards_state or not dims:
            kinds.append(("all", None))
            diff.append(p)
            diff_specs.append(PartitionSpec())
            continue
        if not layout.shards_params:
            kinds.append(("scatter", dims[0]))
            fixed.append(jax.lax.stop_gradient(p))
            fixed_specs.append(PartitionSpec())
        else:
            kinds.append(("defer" if i in deferred else "gather", dims[0]))
        diff.append(p)
        diff_specs.append(_manual_spec(g, axis))
    return fixed, fixed_specs, diff, diff_specs, kinds


def _whole_aux(aux: Any, canonical: Any, params: Any, model_state: Any, batch: Any, rng: Any, n: int) -> Any:
    """The per-shard ``aux`` (stacked) as the step returns it: per-example leaves concatenated."""
    if any(jnp.ndim(x) > 1 for x in jax.tree_util.tree_leaves(aux)):
        # An array in aux may be per-example: the shapes of one abstract evaluation on
        # the global batch (a trace, no compute) tell which leaves to concatenate.
        global_aux = jax.eval_shape(lambda p, b, k: canonical(p, model_state, b, k)[1][1], params, batch, rng)
        return _reassemble_aux(aux, global_aux, n)
    return jax.tree_util.tree_map(_reduce_aux_leaf, aux)


def per_shard_value_and_grad(layout: Layout, reduce_dtype: Any, grad_specs: Any, remat: Any = None,
                             wire: Any = None) -> Any:
    """The step's differentiation (`Sharded`'s ``differentiate``, `jaxmp._step.Strategy`) when the gradient
    is reduced over the data axis in ``reduce_dtype``.

    Each data shard differentiates its own loss inside one ``shard_map`` (``jaxmp.value_and_grad``
    with the loss scale known before the forward, the loss taken as its share ``loss / N`` of
    the mean): differentiating through the ``shard_map`` instead would make every residual of
    the backward a stored output of a forward map. Each param enters through a ``custom_vjp``
    identity that reduces its gradient in ``reduce_dtype`` (all-reduce, or reduce-scatter onto
    ``grad_specs`` under ``"zero"`` / ``"fsdp"``). The loss, model state, rng and ``aux`` per
    shard, and where the gradient is taken: docs/parallel.md#gradient-reduce-dtype.

    Args:
      layout: the state's `Layout` (its mesh, data axis and facts: ``"replicated"``, ``"zero"``, ``"fsdp"``).
      reduce_dtype: the dtype of the gradient reduction.
      grad_specs: where the reduced gradients go (`state_specs`).
      remat: the per-layer remat policy (`jaxmp.parallel.scan_layers`).
      wire: the quantized collectives (`jaxmp.parallel._wire.Wire`), or None.

    Returns:
      ``differentiate(canonical, opt_state, params, model_state, batch, rng) -> ((loss,
      (model_state, aux)), grads)``: ``grads`` are the loss-scaled gradients, already reduced
      (each in its ``grad_specs`` layout, in the param's dtype).

    Raises:
      ValueError: (in the step) an ``aux`` leaf neither per-example nor batch-independent.
    """
    from jaxmp._scaling._grad import value_and_grad
    from jaxmp.parallel import _reduce, _per_layer as per_layer, _wire_matmul

    mesh, axis = layout.mesh, layout.data_axis
    n = mesh.shape[axis]

    def differentiate(canonical, opt_state, params, model_state, batch, rng):
        leaves, treedef = jax.tree_util.tree_flatten(params)
        keys = [_wire_matmul.leaf_key(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
        deferred = recorded_leaves(canonical, params, model_state, batch, rng) if layout.shards_params else set()
        fixed, fixed_specs, diff, diff_specs, kinds = _leaf_plan(layout, leaves, treedef.flatten_up_to(grad_specs),
                                                                 deferred)
        _wire_matmul.check_leaves(wire, keys, leaves, kinds)

        def body(fixed, diff, model_state, batch, rng):
            key = None if rng is None else jax.random.fold_in(rng, jax.lax.axis_index(axis))

            def shard_loss(diff):
                full, used, sliced = iter(fixed), [], {}
                for (kind, dim), x, name in zip(kinds, diff, keys):
                    if kind == "defer":  # the loss gathers it where it is used
                        used.append(x)
                        sliced[id(x)] = dim
                    elif kind == "all":
                        used.append(_reduce.all_reduced(x, axis, reduce_dtype, wire))
                    elif kind == "scatter":
                        used.append(_reduce.scattered(next(full), x, axis, dim, reduce_dtype, wire))
                    else:
                        used.append(_reduce.gathered(x, axis, dim, reduce_dtype, _wire_matmul.leaf_wire(wire, name, x)))
                ctx = per_layer.LayerContext("manual", axis=axis, reduce_dtype=reduce_dtype, leaves=sliced,
                                             remat=remat, wire=wire)
                with per_layer.context(ctx):
                    value, (state, aux) = canonical(jax.tree_util.tree_unflatten(treedef, used), model_state,
                                                    batch, key)
                # This shard's share of the mean of the shard losses.
                return jnp.asarray(value, jnp.float32) / n, (value, state, aux)

            # The loss scale lives in opt_state (closed over: only its scalars enter the map).
            (_, (value, state, aux)), grads = value_and_grad(shard_loss, opt_state, has_aux=True)(diff)
            stack = lambda x: jnp.asarray(x)[None]  # noqa: E731 - one row per shard
            return (stack(value), jax.tree_util.tree_map(stack, state), jax.tree_util.tree_map(stack, aux),
                    grads)

        mapped = jax.shard_map(body, mesh=mesh,
                               in_specs=(fixed_specs, diff_specs, PartitionSpec(), PartitionSpec(axis),
                                         PartitionSpec()),
                               out_specs=(PartitionSpec(axis), PartitionSpec(axis), PartitionSpec(axis), diff_specs),
                               axis_names=frozenset({axis}))
        losses, states, aux, grads = mapped(fixed, diff, model_state, batch, rng)
        loss = jnp.mean(jnp.asarray(losses, jnp.float32))
        aux = _whole_aux(aux, canonical, params, model_state, batch, rng, n)
        return ((loss, (jax.tree_util.tree_map(_mean_over_shards, states), aux)),
                jax.tree_util.tree_unflatten(treedef, grads))

    return differentiate


def _quantized_gather_leaf(x: Any, whole_sharding: Any, *, layout: Layout, slice_sharding: Any, wire: Any) -> Any:
    """ZeRO's new param ``x`` (on its slices) gathered as blockwise codes (`wire.gather_bits`),
    or plainly (a sharding constraint) where it is not split over the data axis."""
    from jaxmp.parallel import _reduce

    axis = layout.data_axis
    dims = [d for d, e in enumerate(slice_sharding.spec) if axis in axes_of(e)]
    if not dims or not is_float_leaf(x):
        return jax.lax.with_sharding_constraint(x, whole_sharding)
    in_spec, out_spec = _manual_spec(slice_sharding.spec, axis), _manual_spec(whole_sharding.spec, axis)
    # Every device dequantizes the same gathered codes: the whole param, the same on every device.
    fn = jax.shard_map(lambda piece: _reduce.gather(piece, axis, dims[0], wire), mesh=layout.mesh,
                       in_specs=(in_spec,), out_specs=out_spec, axis_names=frozenset({axis}), check_vma=False)
    return jax.lax.with_sharding_constraint(fn(x), whole_sharding)


def gather_in_turn(placed: Any, shardings: Any, gathers: list | None = None) -> Any:
    """ZeRO's new params gathered from their slices one leaf after another (XLA:CPU only).

    XLA:CPU widens a bfloat16 all-gather to float32 and issues every gather of the step before
    the first convert back, so each param's float32 copy is live at once: 1.167x the
    hand-written step's peak at the float32 reduce on JAX 0.12 (benchmarks/memory.py --gpt2).
    Chained through ``optimization_barrier`` (an identity), a leaf's slice is released to its
    gather only once the previous leaf is gathered and converted, so one float32 copy is live at
    a time. Other backends keep XLA's schedule: a GPU's scheduler is memory-aware and combines
    the gathers. ``gathers``: one ``gather(x, sharding)`` a leaf (default a sharding constraint;
    with ``gather_bits``, `_quantized_gather_leaf`).
    """
    if gathers is None and jax.default_backend() != "cpu":
        return jax.lax.with_sharding_constraint(placed, shardings)
    leaves, treedef = jax.tree_util.tree_flatten(placed)
    whole = jax.tree_util.tree_leaves(shardings)
    if gathers is None:
        gathers = [jax.lax.with_sharding_constraint] * len(leaves)
    if jax.default_backend() != "cpu":
        return jax.tree_util.tree_unflatten(treedef, [g(x, w) for g, x, w in zip(gathers, leaves, whole, strict=True)])
    out: list = []
    for gather, x, sharding in zip(gathers, leaves, whole, strict=True):
        if out:
            out[-1], x = jax.lax.optimization_barrier((out[-1], x))
        out.append(gather(x, sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


class Sharded(Strategy):
    """The sharded-``jit`` layouts' strategies (`jaxmp._step.Strategy`): what both share.

    The loss runs on the global batch, so the loss and model state need no explicit reduction.
    Two strategies, chosen by the step's ``reduce_dtype``: `PerShard` (a dtype: each data shard
    differentiates its own loss and reduces its gradients in one ``shard_map``) and `GlobalView`
    (``None``: the loss is the global view and XLA reduces). What a layout does (``"replicated"``,
    ``"zero"``, ``"fsdp"``) is read from its facts (`jaxmp.parallel._layouts.LayoutKind`).

    Args:
      layout: the state's `Layout` (mesh, data axis, facts).
      grad_shardings: where the reduced gradients go, ``NamedSharding`` leaves
        (`jaxmp.parallel._layouts.state_specs`).
      param_shardings: the params' ``NamedSharding`` leaves; where the layout gathers the new
        params in turn (``"zero"``) they are gathered onto them leaf by leaf (`gather_in_turn`).
    """

    def __init__(self, layout: Layout, grad_shardings: Any, param_shardings: Any = None, wire: Any = None):
        self.layout = layout
        self.grad_shardings = grad_shardings
        # ZeRO's params are gathered from their slices leaf by leaf on XLA:CPU (`gather_in_turn`).
        self._gather_shardings = param_shardings if layout.gathers_in_turn else None
        self.wire = wire

    def reduce_grads(self, grads: Any) -> Any:
        # Where the reduced gradients go: onto the slices each device updates (zero, fsdp), so XLA
        # reduce-scatters instead of all-reducing; the finite check then reduces the per-slice
        # verdicts, identical on every device.
        return jax.lax.with_sharding_constraint(grads, self.grad_shardings)

    def update_context(self) -> Any:
        # A split leaf is updated whole: a loop over slices of its split axis would gather them.
        return whole_leaves() if self.layout.shards_state else contextlib.nullcontext()

    def place_params(self, params: Any) -> Any:
        # Made on the slices the master lives on (the gradients' layout): each device casts its
        # float32 slice and the params are gathered in their own dtype, half the wire bytes of
        # gathering the float32 master and converting after (XLA's choice otherwise).
        placed = jax.lax.with_sharding_constraint(params, self.grad_shardings)
        if self._gather_shardings is None:
            return placed
        gathers = None
        if self.wire is not None and self.wire.gather_bits is not None:
            gathers = [functools.partial(_quantized_gather_leaf, layout=self.layout, slice_sharding=piece, wire=self.wire)
                       for piece in jax.tree_util.tree_leaves(self.grad_shardings)]
        return gather_in_turn(placed, self._gather_shardings, gathers)


class PerShard(Sharded):
    """A ``reduce_dtype``: each data shard differentiates its own loss, the gradients reduced in
    that dtype (`per_shard_value_and_grad`, the step's ``differentiate``).

    Args:
      layout: as `Sharded`.
      grad_shardings: as `Sharded`.
      param_shardings: as `Sharded`.
      reduce_dtype: the gradient reduction's dtype.
      grad_specs: ``grad_shardings`` as ``PartitionSpec`` leaves.
      remat: the per-layer remat policy (`jaxmp.parallel.scan_layers`).
      wire: the quantized collectives (`jaxmp.parallel._wire.Wire`), or None.
    """

    def __init__(self, layout: Layout, grad_shardings: Any, param_shardings: Any = None, *, reduce_dtype: Any,
                 grad_specs: Any, remat: Any = None, wire: Any = None):
        super().__init__(layout, grad_shardings, param_shardings, wire)
        self.reduce_dtype = reduce_dtype
        self.differentiate = per_shard_value_and_grad(layout, reduce_dtype, grad_specs, remat, wire)


class GlobalView(Sharded):
    """``reduce_dtype=None``: the loss on the global batch (`global_view_loss`, the step's
    ``wrap_loss``), its gradient reduced by XLA in each gradient's dtype.

    Args:
      layout: as `Sharded`.
      grad_shardings: as `Sharded`.
      param_shardings: as `Sharded`.
      base_specs: the params' specs over the other (model) axes (`param_tree_specs`).
      remat: the per-layer remat policy (`jaxmp.parallel.scan_layers`).
    """

    reduce_dtype = None

    def __init__(self, layout: Layout, grad_shardings: Any, param_shardings: Any = None, *, base_specs: Any,
                 remat: Any = None):
        super().__init__(layout, grad_shardings, param_shardings)
        self._wrap = global_view_loss(layout, base_specs, remat)

    def wrap_loss(self, loss_fn: Any) -> Any:
        return self._wrap(loss_fn)
