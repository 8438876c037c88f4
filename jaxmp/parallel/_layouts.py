"""How the training state is laid out over a mesh's data axis on the sharded-``jit`` path.

``"replicated"``, ``"zero"`` (ZeRO-1/2) and ``"fsdp"`` (ZeRO-3) as ``NamedSharding`` trees for
``jit`` and ``with_sharding_constraint``, XLA inserting the collectives (the per-shard loss of a
reduce dtype is in `jaxmp.parallel._shard_step`). Which dimension of a leaf is split, a model axis, the bytes per parameter:
docs/parallel.md#sharded-state-zero-and-fsdp-layouts; the reduce: docs/parallel.md#gradient-reduce-dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxmp._tree import ShardsItself
from jaxmp.parallel._checks import check_not_donated
from jaxmp.parallel._replication import PMAP_LAYOUT_HINT, is_pmap_replicated, replica_axis_size

from jaxmp._typing import PyTree


@dataclasses.dataclass(frozen=True)
class LayoutKind:
    """What a layout does, as the facts the step reads (never its name).

    Attributes:
      name: the layout's name (``layout="..."``).
      shards_state: the optimizer state (and masters) and the reduced gradients are split over
        the data axis: each device updates its slice (ZeRO-1/2, FSDP).
      shards_params: the params are split at rest too, gathered where the loss uses them (FSDP).
      gathers_in_turn: the new params, made on the slices, are gathered back whole after the
        update (ZeRO: sharded state, whole params), one leaf after another on XLA:CPU.
      summary: what the layout keeps where, for messages.
    """

    name: str
    shards_state: bool
    shards_params: bool
    gathers_in_turn: bool
    summary: str


#: The layouts, by name: a new layout is one row here (the step reads only these facts).
KINDS = {kind.name: kind for kind in (
    LayoutKind("replicated", shards_state=False, shards_params=False, gathers_in_turn=False,
               summary="today's full copy"),
    LayoutKind("zero", shards_state=True, shards_params=False, gathers_in_turn=True,
               summary="optimizer state and masters sharded"),
    LayoutKind("fsdp", shards_state=True, shards_params=True, gathers_in_turn=False, summary="params too"),
)}

LAYOUTS = tuple(KINDS)
"""The layout names: a full copy; optimizer state sharded (ZeRO-1/2); params sharded too (FSDP)."""

DEFAULT_MIN_SHARD_SIZE = 1024


def check_layout(layout: Any) -> str:
    """``layout`` if it is one of `LAYOUTS`, else a ValueError listing them."""
    if not isinstance(layout, str) or layout not in KINDS:
        raise ValueError(f"unknown layout {layout!r}: the layouts are {', '.join(repr(x) for x in LAYOUTS)} "
                         f"({'; '.join(f'{k.name}: {k.summary}' for k in KINDS.values())})")
    return layout


def check_data_axis(mesh: Any, data_axis: str | None) -> str:
    """The data axis's name, with a clear error for a mesh that lacks it."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if data_axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"mesh has axes {mesh.axis_names}: name the data axis with data_axis=...")
        return mesh.axis_names[0]
    if data_axis not in mesh.axis_names:
        raise ValueError(f"data_axis {data_axis!r} is not an axis of the mesh (axes: {mesh.axis_names})")
    return data_axis


def check_auto_axes(mesh: Mesh) -> None:
    """A ValueError naming a mesh's ``Explicit`` (or ``Manual``) axes: the sharded step needs ``Auto`` ones.

    The step places its state and batch with sharding constraints and reduces the gradients in a
    ``shard_map`` over the data axis: on an ``Explicit`` axis every op of the loss must resolve its
    output sharding and the shard_map's inputs must already carry its specs, so the call fails
    inside JAX (a ``shard_map`` in_specs mismatch, or a matmul's ambiguous sharding) whatever the
    batch. docs/parallel.md ("Explicit sharding's unreduced/reduced states") says why it keeps to Auto.
    """
    types = getattr(mesh, "axis_types", None) or ()
    auto = getattr(getattr(jax.sharding, "AxisType", None), "Auto", None)
    other = [(name, t) for name, t in zip(mesh.axis_names, types) if auto is not None and t != auto]
    if other:
        listing = ", ".join(f"{name!r} is {getattr(t, 'name', t)}" for name, t in other)
        raise ValueError(f"the sharded step needs a mesh whose axes are all Auto (GSPMD): {listing}. Build it with "
                         "jaxmp.parallel.make_data_mesh() or jax.make_mesh(shape, names, "
                         "axis_types=(jax.sharding.AxisType.Auto, ...))")


def check_min_size(min_shard_size: Any) -> int:
    """``min_shard_size`` as an int, or a ValueError for anything but an int >= 0."""
    if isinstance(min_shard_size, bool) or not isinstance(min_shard_size, (int, np.integer)) or min_shard_size < 0:
        raise ValueError(f"min_shard_size must be an int >= 0, got {min_shard_size!r}")
    return int(min_shard_size)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Where a training state lives: the mesh, the layout and its options, given once.

    A sharded step's ``step.layout``: pass it to [`shard_state`][jaxmp.parallel.shard_state]
    in place of the mesh (docs/parallel.md#sharded-state-zero-and-fsdp-layouts).

    Attributes:
      mesh: the ``jax.sharding.Mesh``.
      name: ``"replicated"``, ``"zero"`` or ``"fsdp"`` (`LAYOUTS`).
      data_axis: the mesh axis the batch and a sharded state are split over.
      param_specs: the params' ``PartitionSpec`` tree over the other (model) axes, or None.
      min_shard_size: leaves with fewer elements stay replicated over the data axis.

    What the layout does is read from its facts (`LayoutKind`, by ``name``): ``kind``,
    ``shards_state``, ``shards_params``, ``gathers_in_turn``.
    """

    mesh: Mesh
    name: str
    data_axis: str
    param_specs: Any = None
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE

    def __str__(self) -> str:
        return self.name

    @property
    def kind(self) -> LayoutKind:
        """The layout's facts (`LayoutKind`), by its name."""
        return KINDS[check_layout(self.name)]

    @property
    def shards_state(self) -> bool:
        """The optimizer state and the reduced gradients are split over the data axis (zero, fsdp)."""
        return self.kind.shards_state

    @property
    def shards_params(self) -> bool:
        """The params are split over the data axis at rest, gathered where used (fsdp)."""
        return self.kind.shards_params

    @property
    def gathers_in_turn(self) -> bool:
        """The new params are gathered whole from their slices after the update (zero)."""
        return self.kind.gathers_in_turn


def resolve_layout(mesh: Any, layout: Any = None, *, data_axis: str | None = None, param_specs: Any = None,
                   min_shard_size: Any = None) -> Layout:
    """One `Layout` from either spelling: a mesh plus a layout name and options, or a `Layout`.

    Args:
      mesh: a ``jax.sharding.Mesh``, or a `Layout` (e.g. a sharded step's ``step.layout``).
      layout: ``"replicated"`` (None means it), ``"zero"``, ``"fsdp"``, or a `Layout` on ``mesh``.
      data_axis: the mesh axis the state is split over; default the mesh's only axis.
      param_specs: the params' ``PartitionSpec`` tree over the other mesh axes.
      min_shard_size: leaves with fewer elements stay replicated over the data axis (None:
        `DEFAULT_MIN_SHARD_SIZE`, 1024).

    Returns:
      The validated `Layout`.

    Raises:
      ValueError: a `Layout` with options that differ from its own, a `Layout` on another
        mesh, or any invalid option.
    """
    given = mesh if isinstance(mesh, Layout) else layout if isinstance(layout, Layout) else None
    if given is None:
        return Layout(mesh=mesh, name=check_layout("replicated" if layout is None else layout),
                      data_axis=check_data_axis(mesh, data_axis), param_specs=param_specs,
                      min_shard_size=check_min_size(DEFAULT_MIN_SHARD_SIZE if min_shard_size is None
                                                    else min_shard_size))
    if isinstance(mesh, Layout) and layout is not None and layout is not mesh:
        raise ValueError(f"the layout is given twice: a Layout ({mesh.name!r}) in place of the mesh and "
                         f"layout={layout!r}; pass the Layout alone")
    if not isinstance(mesh, Layout) and mesh is not given.mesh:
        raise ValueError("layout is a Layout on another mesh than the mesh passed with it: pass the Layout in "
                         "place of the mesh, alone")
    conflicts = [name for name, value, own in (("data_axis", data_axis, given.data_axis),
                                               ("param_specs", param_specs, given.param_specs))
                 if value is not None and value is not own and value != own]
    if min_shard_size is not None and min_shard_size != given.min_shard_size:
        conflicts.append("min_shard_size")
    if conflicts:
        raise ValueError(f"{', '.join(conflicts)} given besides a Layout that sets them already: the Layout "
                         "carries the whole layout, so pass it alone (or build the state's layout from the "
                         "same options)")
    return given


def _spec_entries(spec: PartitionSpec, ndim: int) -> list:
    entries = list(spec) + [None] * (ndim - len(spec))
    if len(entries) > ndim:
        raise ValueError(f"PartitionSpec {spec} has more entries than the leaf has dimensions ({ndim})")
    return entries


def make_spec(entries: list) -> PartitionSpec:
    # Trailing unsharded dimensions dropped: P(None, None) and P() are the same layout.
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def axes_of(entry: Any) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def leaf_spec(shape: Sequence[int], mesh: Mesh, data_axis: str, base: PartitionSpec | None = None, *,
              min_shard_size: int = DEFAULT_MIN_SHARD_SIZE, allowed: Sequence[int] | None = None) -> PartitionSpec:
    """The ``PartitionSpec`` of one leaf sharded over ``data_axis``.

    The rule: docs/parallel.md#sharded-state-zero-and-fsdp-layouts ("Which dimension is split").

    Args:
      shape: the leaf's (global) shape.
      mesh: the mesh.
      data_axis: the mesh axis to shard over.
      base: the user's spec for this leaf over other mesh axes (kept as is); default replicated.
      min_shard_size: leaves with fewer elements stay replicated over ``data_axis``.
      allowed: the dimensions that may be split (default all): for a param whose state says
        how it may split (``jaxmp._tree.ShardsItself``: quantized moments), those it allows.

    Returns:
      ``base`` with ``data_axis`` added on the largest allowed dimension it divides, or ``base`` itself.
    """
    base = PartitionSpec() if base is None else base
    entries = _spec_entries(base, len(shape))
    if any(data_axis in axes_of(e) for e in entries):
        raise ValueError(f"the parameter spec {base} already uses the data axis {data_axis!r}: param_specs name the "
                         "other (model) axes only; the layout adds the data axis")
    n = mesh.shape[data_axis]
    size = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if n == 1 or len(shape) == 0 or size < min_shard_size:
        return make_spec(entries)
    best = None
    for d, dim in enumerate(shape):
        if entries[d] is not None:  # the user's own split of this dimension (another axis) stays alone
            continue
        if allowed is not None and d not in allowed:
            continue
        if dim % n == 0 and dim > 0 and (best is None or dim > shape[best]):
            best = d
    if best is None:
        return make_spec(entries)
    entries[best] = data_axis
    return make_spec(entries)


def param_tree_specs(params: Any, param_specs: Any) -> Any:
    """The user's ``param_specs`` as a ``PartitionSpec`` per params leaf (``PartitionSpec()`` where none)."""
    treedef = jax.tree_util.tree_structure(params)
    if param_specs is None:
        return jax.tree_util.tree_unflatten(treedef, [PartitionSpec()] * treedef.num_leaves)
    is_spec = lambda x: isinstance(x, (PartitionSpec, NamedSharding)) or x is None  # noqa: E731
    leaves = jax.tree_util.tree_leaves(param_specs, is_leaf=is_spec)
    try:
        flat = treedef.flatten_up_to(jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(param_specs, is_leaf=is_spec), leaves))
    except (ValueError, TypeError) as e:
        raise ValueError(f"param_specs must be a pytree of PartitionSpec with the params' structure: {e}") from e
    out = []
    for s in flat:
        if isinstance(s, NamedSharding):
            s = s.spec
        if s is None:
            s = PartitionSpec()
        if not isinstance(s, PartitionSpec):
            raise TypeError(f"param_specs leaves must be PartitionSpec (or NamedSharding), got {type(s).__name__}")
        out.append(s)
    return jax.tree_util.tree_unflatten(treedef, out)


def is_float_leaf(x: Any) -> bool:
    # Arrays and jax.ShapeDtypeStruct alike (PRNG key arrays are not floating).
    dtype = getattr(x, "dtype", None)
    if dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return False
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _is_codes(x: Any) -> bool:
    # The uint8 codes of jaxmp.lean.quantized_moments (4-bit ones are packed, so not param-shaped):
    # sharded like a float leaf of their shape, or ZeRO would keep them whole on every device.
    return getattr(x, "dtype", None) == jnp.uint8 and len(_shape(x)) >= 1


def _shape(x: Any) -> tuple:
    return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)


def state_specs(params: optax.Params, opt_state: optax.OptState, mesh: Mesh, layout: str = "replicated", *,
                data_axis: str | None = None, param_specs: PyTree | None = None,
                min_shard_size: int = DEFAULT_MIN_SHARD_SIZE) -> tuple[Any, Any, Any]:
    """``(param_specs, opt_state_specs, grad_specs)``: the ``PartitionSpec`` trees of a layout.

    ``grad_specs``: where the reduced gradients go (the slice each device updates under
    ``"zero"`` and ``"fsdp"``). Only shapes are read (arrays or ``jax.ShapeDtypeStruct``).
    """
    layout = check_layout(layout)
    axis = check_data_axis(mesh, data_axis)
    min_shard_size = check_min_size(min_shard_size)
    base = param_tree_specs(params, param_specs)
    p_treedef: Any  # jax's PyTreeDef stubs lack flatten_up_to and num_leaves
    p_leaves, p_treedef = jax.tree_util.tree_flatten(params)
    b_leaves = p_treedef.flatten_up_to(base)
    for b in b_leaves:
        for e in b:
            for a in axes_of(e):
                if a not in mesh.axis_names:
                    raise ValueError(f"param_specs name the axis {a!r}, which the mesh does not have "
                                     f"(axes: {mesh.axis_names})")

    def is_param_tree(x):
        return jax.tree_util.tree_structure(x) == p_treedef and p_treedef.num_leaves > 0 and not (
            p_treedef.num_leaves == 1 and jax.tree_util.treedef_is_leaf(p_treedef))

    split_axes = _split_axes(opt_state, p_treedef, [_shape(p) for p in p_leaves], mesh.shape[axis])

    def allowed(j: int, shape: tuple) -> tuple | None:
        # A param whose state says where it splits (quantized moments: each block on one device).
        return split_axes.get(j)

    sharded = [leaf_spec(_shape(p), mesh, axis, b, min_shard_size=min_shard_size, allowed=allowed(j, _shape(p)))
               for j, (p, b) in enumerate(zip(p_leaves, b_leaves))]
    shard_params, shard_state = KINDS[layout].shards_params, KINDS[layout].shards_state
    p_specs = jax.tree_util.tree_unflatten(p_treedef, sharded if shard_params else b_leaves)
    g_specs = jax.tree_util.tree_unflatten(p_treedef, sharded if shard_state else b_leaves)

    def spec_of(x, matched=None):
        # A leaf of a sub-tree shaped like the params: its param's spec when the shapes agree (or,
        # for 4-bit codes, two a byte on the last axis, the ranks).
        if matched is not None and (_shape(x) == matched[0] or (
                _is_codes(x) and len(_shape(x)) == len(matched[0]) and _shape(x)[:-1] == matched[0][:-1])):
            return matched[2] if shard_state else matched[1]
        if matched is not None and _is_codes(x):
            return matched[1]   # 4-bit codes packed flat (an odd last axis): no split keeps them whole
        if not shard_state or not (is_float_leaf(x) or _is_codes(x)):
            # Counters, keys, the loss scale: replicated (they are scalars or tiny anyway).
            return PartitionSpec()
        return leaf_spec(_shape(x), mesh, axis, min_shard_size=min_shard_size)

    infos = [(_shape(p), b, s) for p, b, s in zip(p_leaves, b_leaves, sharded)]

    def specs_of(node):
        pieces, tdef = jax.tree_util.tree_flatten(
            node, is_leaf=lambda x: isinstance(x, ShardsItself) or is_param_tree(x))
        out = []
        for x in pieces:
            if isinstance(x, ShardsItself):
                out.append(x.partition_specs(specs_of))   # its own layout, its plain parts by specs_of
            elif is_param_tree(x):
                out.append(jax.tree_util.tree_unflatten(
                    p_treedef, [spec_of(v, m) for v, m in zip(p_treedef.flatten_up_to(x), infos)]))
            else:
                out.append(spec_of(x))
        return tdef.unflatten(out)

    return p_specs, specs_of(opt_state), g_specs


def _split_axes(opt_state: Any, params_def: Any, param_shapes: list, n: int) -> dict:
    """``{param index: axes}``: the params some node of ``opt_state`` allows to split on some axes
    only (`ShardsItself.split_axes`: quantized moments keep each block on one device), with the
    axes every such node allows, sorted."""
    axes: dict = {}
    for node in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, ShardsItself)):
        if isinstance(node, ShardsItself):
            for j, ok in node.split_axes(params_def, param_shapes, n).items():
                axes[j] = axes.get(j, set(ok)) & set(ok)
    return {j: tuple(sorted(ok)) for j, ok in axes.items()}


def pmap_state_error(what: str, where: str, shape: tuple, layout: str, why: str = "") -> ValueError:
    """The error for a pmap-layout state (a leading replica axis) given to a sharded layout."""
    return ValueError(
        f"{what} leaf at {where} {why or 'is pmap-replicated'} (shape {tuple(shape)}: {PMAP_LAYOUT_HINT}), not a state "
        f"for the sharded step's layout {layout!r}: its replica axis would be laid out as data; take one copy with "
        f"jaxmp.parallel.unreplicate(state) and lay it out with "
        f"jaxmp.parallel.shard_state((params, opt_state), mesh, {layout!r})")


def check_not_pmap_state(params: Any, opt_state: Any, layout: str) -> None:
    """Raises `pmap_state_error` for a state in the pmap layout: one copy per device, stacked.

    Two signs: a leaf laid out by a pmap replicator (its sharding), or a ``jaxmp.loss_scaling``
    state whose scalar counters carry a leading axis (a pmap step's output, or any of these
    fetched to the host, whose leaves no longer say where they came from). Shapes and shardings
    only: no transfer. Without it the replica axis is sharded as a data dimension and the step
    fails inside JAX ("Gradient only defined for scalar-output functions").
    """
    for what, tree in (("params", params), ("opt_state", opt_state)):
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            if is_pmap_replicated(x):
                raise pmap_state_error(what, jax.tree_util.keystr(path) or "<root>", x.shape, layout)
    found = replica_axis_size(opt_state)
    if found is not None:
        where, n = found
        raise pmap_state_error("opt_state", where, (n,), layout,
                               "is a jaxmp.loss_scaling step counter, a scalar, with a leading replica axis")


def named_shardings(mesh: Mesh, specs: Any) -> Any:
    """A tree of ``PartitionSpec`` as the ``NamedSharding`` tree on ``mesh``."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


def state_shardings(params: optax.Params, opt_state: optax.OptState, mesh: Mesh | Layout, layout: str | None = None, *,
                    data_axis: str | None = None, param_specs: PyTree | None = None,
                    min_shard_size: int | None = None) -> tuple[Any, Any]:
    """The ``NamedSharding`` trees ``(params, opt_state)`` of a layout.

    Args:
      params: the params (arrays or ``jax.ShapeDtypeStruct``; only shapes are read).
      opt_state: the optimizer state (``tx.init(params)``, or ``jax.eval_shape`` of it).
      mesh: the mesh, or a `Layout` (a sharded step's ``step.layout``: then nothing else).
      layout: ``"replicated"`` (default), ``"zero"`` or ``"fsdp"`` (`LAYOUTS`).
      data_axis: the mesh axis the state is split over; default the mesh's only axis.
      param_specs: the params' ``PartitionSpec`` over the other (model) mesh axes; default none.
      min_shard_size: leaves with fewer elements stay replicated over the data axis (default 1024).

    Returns:
      ``(param_shardings, opt_state_shardings)``, trees of ``NamedSharding`` matching the inputs.

    Raises:
      ValueError: unknown layout, a data axis the mesh lacks, ``param_specs`` naming the data
        axis or an axis the mesh lacks, or not matching the params; a pmap-replicated state
        (a leading replica axis: ``unreplicate`` it first).

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> tx = jaxmp.loss_scaling(optax.adam(1e-3), "none", master_weights=True)
      >>> params = {"w": jnp.zeros((8, 1024), jnp.bfloat16)}
      >>> ps, ss = jaxmp.parallel.state_shardings(params, tx.init(params), mesh, "zero")
      >>> ps["w"].spec, jaxmp.master_params(ss)["w"].spec
      (P(), P(None, 'data'))
    """
    lay = resolve_layout(mesh, layout, data_axis=data_axis, param_specs=param_specs, min_shard_size=min_shard_size)
    check_not_pmap_state(params, opt_state, lay.name)
    p, o, _ = state_specs(params, opt_state, lay.mesh, lay.name, data_axis=lay.data_axis,
                          param_specs=lay.param_specs, min_shard_size=lay.min_shard_size)
    return named_shardings(lay.mesh, p), named_shardings(lay.mesh, o)


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # A global array of several processes: let JAX move the shards (a reshard, no host copy).
        return jax.device_put(x, sharding)
    host = np.asarray(jax.device_get(x))
    # Each process fills its own devices from the same host value (works with several processes).
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_state(state: tuple[Any, Any], mesh: Mesh | Layout, layout: str | None = None, *, data_axis: str | None = None,
                param_specs: PyTree | None = None, min_shard_size: int | None = None) -> tuple[Any, Any]:
    """Places (or re-lays out) ``(params, opt_state)`` on the mesh in a layout.

    Args:
      state: ``(params, opt_state)``: host arrays, or arrays in any layout or on any mesh
        (the same values on every process).
      mesh: the mesh, or a sharded step's ``step.layout`` (`Layout`).
      layout: ``"replicated"`` (default), ``"zero"`` or ``"fsdp"``.
      data_axis: as in [`state_shardings`][jaxmp.parallel.state_shardings].
      param_specs: as in [`state_shardings`][jaxmp.parallel.state_shardings].
      min_shard_size: as in [`state_shardings`][jaxmp.parallel.state_shardings].

    Returns:
      ``(params, opt_state)`` as global ``jax.Array`` leaves with the layout's shardings.

    Raises:
      ValueError: as [`state_shardings`][jaxmp.parallel.state_shardings] (a pmap-replicated
        state included), or a leaf a ``donate=True`` step deleted (pass the state it returned).

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> tx = jaxmp.loss_scaling(optax.adam(1e-3), "none", master_weights=True)
      >>> params = {"w": jnp.zeros((8, 1024), jnp.bfloat16)}
      >>> p, s = jaxmp.parallel.shard_state((params, tx.init(params)), mesh, "fsdp")
      >>> p["w"].addressable_shards[0].data.shape == (8, 1024 // mesh.size)
      True
    """
    if not (isinstance(state, (tuple, list)) and len(state) == 2):
        raise TypeError(f"state must be a (params, opt_state) pair, got {type(state).__name__}")
    params, opt_state = state
    check_not_donated(params, opt_state, by="a step built with donate=True")
    ps, ss = state_shardings(params, opt_state, mesh, layout, data_axis=data_axis, param_specs=param_specs,
                             min_shard_size=min_shard_size)
    return jax.tree_util.tree_map(_place, params, ps), jax.tree_util.tree_map(_place, opt_state, ss)


def abstract_state(state: tuple[Any, Any], mesh: Mesh | Layout, layout: str | None = None,
                   **kwargs: Any) -> tuple[Any, Any]:
    """``(params, opt_state)`` as ``jax.ShapeDtypeStruct`` leaves carrying the layout's shardings.

    A checkpoint restore target (docs/guides/checkpointing.md), or what ``step.lower`` compiles
    without allocating the state.

    Args:
      state: ``(params, opt_state)``, arrays or ``jax.ShapeDtypeStruct``.
      mesh: the mesh, or a sharded step's ``step.layout`` (`Layout`).
      layout: ``"replicated"`` (default), ``"zero"`` or ``"fsdp"``.
      **kwargs: ``data_axis``, ``param_specs``, ``min_shard_size`` as in [`state_shardings`][jaxmp.parallel.state_shardings].

    Returns:
      ``(params, opt_state)`` with ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> tx = jaxmp.loss_scaling(optax.adam(1e-3), "none", master_weights=True)
      >>> params = {"w": jax.ShapeDtypeStruct((8, 1024), jnp.bfloat16)}
      >>> state = (params, jax.eval_shape(tx.init, params))
      >>> p, s = jaxmp.parallel.abstract_state(state, mesh, "fsdp")
      >>> jaxmp.parallel.state_bytes_per_device(p) * mesh.size == 8 * 1024 * 2
      True
    """
    params, opt_state = state
    ps, ss = state_shardings(params, opt_state, mesh, layout, **kwargs)
    to = lambda x, s: jax.ShapeDtypeStruct(_shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,  # noqa: E731
                                           sharding=s)
    return jax.tree_util.tree_map(to, params, ps), jax.tree_util.tree_map(to, opt_state, ss)


def state_bytes_per_device(tree: PyTree) -> int:
    """Bytes of ``tree`` that one device holds (the largest shard where shards are uneven).

    Args:
      tree: ``jax.Array`` or ``jax.ShapeDtypeStruct`` leaves with a ``sharding`` (never allocated).

    Returns:
      The bytes of each leaf's shard shape, summed.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> mesh = jaxmp.parallel.make_data_mesh()
      >>> w = jaxmp.parallel.shard_state(({"w": jnp.zeros((8, 1024))}, ()), mesh, "fsdp")[0]
      >>> jaxmp.parallel.state_bytes_per_device(w) == 8 * 1024 * 4 // mesh.size
      True
    """
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = _shape(x) if sharding is None else sharding.shard_shape(_shape(x))
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total
