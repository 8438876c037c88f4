"""8-bit and 4-bit optimizer moments as an optax transformation (re-exported as ``jaxmp.lean.quantized_moments``).

Blockwise dynamic quantization (bitsandbytes' 8-bit Adam, torchao's 4-bit AdamW): each large moment
leaf is stored as uint8 codes plus one float32 absmax per block; ``update`` dequantizes, runs the
inner optimizer in float32 and requantizes. The scheme: jaxmp/_formats/_code_maps.py; the choices and the
measurements: docs/lean-recipes.md#8-bit-and-4-bit-moments.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from jaxmp import _formats, _keys
from jaxmp.lean import _chunked
from jaxmp.lean._widening import WidensItself
from jaxmp._dtypes import is_floating_array
from jaxmp._keys import key_data as _key_data, leaf_keys
from jaxmp._misuse import MixedPrecisionWarning
from jaxmp._scaling._transform import check_inner
from jaxmp._typing import PyTree

#: NamedTuple fields (optax's state classes) that hold non-negative moments: squares and their
#: running means. A leaf under one of them gets the non-negative map; every other quantized leaf
#: the signed one (correct for any sign, one bit less precise for a non-negative leaf).
NON_NEGATIVE_FIELDS = frozenset({"nu", "nu_max", "sum_of_squares", "v_row", "v_col", "e_g", "e_x"})

#: Leaves with fewer elements stay float32 (bitsandbytes' ``min_8bit_size``, torchao's 4096):
#: biases and norms cost little and their per-block scale would cost more than it saves.
MIN_SIZE = 4096

_BLOCKS = {8: 256, 4: 128}   # torchao's AdamW8bit / AdamW4bit (bitsandbytes: 256 on the GPU path)
_ROUNDINGS = ("nearest", "stochastic")


class QuantizedMomentsState(NamedTuple):
    """State of [`quantized_moments`][jaxmp.lean.quantized_moments].

    Attributes:
      inner_state: the wrapped transformation's state with each quantized leaf (floating, ``ndim >= 1``,
        at least ``min_size`` elements) replaced by its codes: uint8 of the leaf's shape (8 bits), or two
        4-bit codes a byte (the last axis halved when it is even, else flat: ``ceil(size / 2)``). Other
        leaves (small moments, counts, hyperparameters) as the inner transformation keeps them.
      absmax: the same tree as ``inner_state`` with one float32 scale per block of ``block``
        consecutive elements (C order) at each quantized leaf and None elsewhere: of shape
        ``shape[:k] + (blocks a slab,)`` when the leaf's axes from ``k`` on are a whole number of
        blocks (``jaxmp._formats.Grid.axis``: the last axis of a matrix whose rows are whole
        blocks), else ``(ceil(size / block),)``.
      key: uint32[2], the raw threefry2x32 key data (zeros for nearest rounding; constant).
      count: int32 [], updates applied so far (folded into ``key`` for each update's bits).
      grid: the ``bits`` and ``block`` the leaves are cut by: static (part of the tree's structure,
        no leaf), so that jaxmp.parallel's ZeRO and FSDP layouts split each quantized leaf where
        no block crosses a device. A checkpoint holds no grid: restore into the structure of
        ``tx.init(params)`` (``jax.eval_shape(tx.init, params)``), which carries it.
      map_revision: int32 [], the revision of the code maps the codes index
        (``jaxmp._formats.MAP_REVISION``: 2, bitsandbytes' and torchao's maps bit for bit). A leaf,
        so that a checkpoint records it: one written before it existed (maps of revision 1) has no
        such leaf, and orbax's restore into a ``tx.init`` target refuses it by name rather than
        decode its codes with other maps (docs/lean-recipes.md#8-bit-and-4-bit-moments).

    The state lays itself out (``jaxmp._tree.ShardsItself``): jaxmp.parallel's ZeRO and FSDP
    layouts ask it which axes of each param keep its blocks whole (`split_axes`) and for its
    ``PartitionSpec`` tree (`partition_specs`), and name none of its fields.
    """

    inner_state: optax.OptState
    absmax: PyTree
    key: jax.Array
    count: jax.Array  # type: ignore[assignment]  # optax names its step counters count
    grid: _formats.Grid
    map_revision: jax.Array | None = None

    def split_axes(self, params_def: jax.tree_util.PyTreeDef, param_shapes: Sequence[tuple], n: int) -> dict[int, set]:
        """``{param index: axes}``: for each param with a quantized moment, the axes it may be
        split ``n`` ways on with every block of each of its moments on one device
        (``Grid.aligned_axes``). Refuses a state that lost its grid (`check_restored`) first."""
        check_restored(self)   # a grid lost by a hand-written restore, named before its bits are read
        positions = _chunked.mirrors(self.inner_state, params_def)
        inner_def: Any = jax.tree_util.tree_structure(self.inner_state)
        out: dict = {}
        for j, a in zip(positions, inner_def.flatten_up_to(self.absmax)):
            if j is not None and a is not None:
                axes = set(self.grid.aligned_axes(param_shapes[j], n))
                out[j] = out.get(j, axes) & axes
        return out

    def partition_specs(self, specs_of: Callable[[Any], Any]) -> QuantizedMomentsState:
        """The state's ``PartitionSpec`` tree: the codes as ``specs_of`` lays out the inner state
        (a param's split, on axes `split_axes` allowed), each absmax following its codes, every
        other leaf (key, count, map revision, any later one) replicated."""
        inner = specs_of(self.inner_state)
        inner_def: Any = jax.tree_util.tree_structure(self.inner_state)
        scales = []
        for c, spec, a in zip(inner_def.flatten_up_to(self.inner_state), inner_def.flatten_up_to(inner),
                              inner_def.flatten_up_to(self.absmax)):
            # The absmax of slabs starting at axis k has the codes' axes up to k (the split, if
            # any, is on one of them: aligned); that of flattened blocks is not split.
            scales.append(None if a is None else _leading_spec(spec, _ndim(c), _ndim(a)))
        replicated = QuantizedMomentsState(*(jax.tree_util.tree_map(lambda _: PartitionSpec(), getattr(self, f))
                                             for f in self._fields))
        return replicated._replace(inner_state=inner, absmax=inner_def.unflatten(scales), grid=self.grid)


def _ndim(x: Any) -> int:
    # Arrays and jax.ShapeDtypeStruct alike.
    return len(x.shape) if hasattr(x, "shape") else np.ndim(x)


def _leading_spec(spec: PartitionSpec, ndim: int, keep: int) -> PartitionSpec:
    """The first ``keep`` entries of the spec of an ``ndim`` leaf (trailing unsplit ones dropped)."""
    entries = (list(spec) + [None] * (ndim - len(spec)))[:keep]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _non_negative(path: tuple) -> bool:
    """The leaf's class from the state's structure: a NamedTuple field on its path named in
    `NON_NEGATIVE_FIELDS` (dict keys, the user's param names, never count)."""
    return any(isinstance(k, jax.tree_util.GetAttrKey) and k.name in NON_NEGATIVE_FIELDS for k in path)


def _quantizable(x: Any, min_size: int) -> bool:
    # Every floating dtype: the inner update runs on the float32 decoding either way, and a
    # float16 moment is no better kept as it is (fp8 ones are refused at init: `_refuse_fp8`).
    return is_floating_array(x) and jnp.ndim(x) >= 1 and int(np.prod(jnp.shape(x))) >= max(min_size, 1)


def _refuse_fp8(leaves: list) -> None:
    """fp8 moments (optax keeps fp8 params' moments in fp8) decode to float32, which optax's update
    cannot mix with fp8 gradients (JAX promotes no 8-bit float implicitly): refused, by name."""
    fp8 = [f"{jax.tree_util.keystr(path)} ({jnp.result_type(x)})" for path, x in leaves
           if jnp.dtype(jnp.result_type(x)).itemsize == 1]
    if fp8:
        raise ValueError(f"quantized_moments: the inner state keeps fp8 moments ({', '.join(fp8)}), the moments of "
                         "fp8 params: decoded to float32 they would meet fp8 gradients, which JAX does not promote. "
                         "Keep float32 masters of the params, whose moments are float32 and quantize: "
                         "jaxmp.loss_scaling(jaxmp.lean.quantized_moments(inner), 'none', master_weights=True)")


_RESTORE = ("restore into the structure of the optimizer's own init, which carries it: orbax's "
            "`ckptr.restore(path, jax.eval_shape(tx.init, params))`, or for a sharded state "
            "`jaxmp.parallel.abstract_state((params, tx.init(params)), mesh, layout)`")


def check_restored(state: QuantizedMomentsState) -> None:
    """Refuses a quantized state whose static ``grid`` or ``map_revision`` a hand-written restore
    lost (a checkpoint holds neither a grid nor, before revision 2, a map revision)."""
    if not isinstance(state.grid, _formats.Grid):
        raise ValueError(f"QuantizedMomentsState.grid is {state.grid!r}, not a jaxmp._formats.Grid: the state was "
                         "rebuilt without its structure (a checkpoint holds no grid; it is static, part of the "
                         f"tree's structure). To resume it, {_RESTORE}")
    revision = state.map_revision
    if revision is None:
        raise ValueError("QuantizedMomentsState.map_revision is None: the state was rebuilt without the revision of its "
                         "code maps, e.g. from a checkpoint written before jaxmp recorded it (8-bit codes of maps one "
                         "or two float32 ulps off the peers' at 22 signed and 26 unsigned entries: they would decode "
                         f"differently). A checkpoint with the revision restores whole: {_RESTORE}. One without it "
                         "cannot be resumed by this jaxmp: start the moments afresh with tx.init(params)")
    # Its value when it has one here (an eager call; a jitted step sees a tracer, an abstract
    # target a ShapeDtypeStruct).
    concrete = isinstance(revision, (jax.Array, np.ndarray, np.generic)) and not isinstance(
        revision, jax.core.Tracer) and getattr(revision, "is_fully_addressable", True) and np.shape(revision) == ()
    if concrete and int(np.asarray(revision)) != _formats.MAP_REVISION:
        raise ValueError(f"QuantizedMomentsState.map_revision is {int(np.asarray(revision))}: its codes index code maps "
                         f"of another revision than this jaxmp's ({_formats.MAP_REVISION}), which would decode them "
                         "differently; resume it with the jaxmp that wrote it, or start the moments afresh with "
                         "tx.init(params)")


#: The way out of `unused_key_warning` for a transformation with a ``rounding`` argument.
ROUND_STOCHASTICALLY = "Drop key=, or pass rounding='stochastic' to round stochastically with it"


def unused_key_warning(what: str, key: Any, why: str, fix: str = ROUND_STOCHASTICALLY, stacklevel: int = 3) -> None:
    """Warns (MixedPrecisionWarning, at the caller's caller) that ``key`` is unused: ``what`` (a
    call) draws no random bits (``why``). Nothing is refused: code that picks a recipe by name
    often passes one key to every one."""
    if key is not None:
        warnings.warn(f"{what}: key={key!r} is unused: {why}, so it draws no random bits. {fix}",
                      MixedPrecisionWarning, stacklevel=stacklevel)


def _check_int(value: Any, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def quantized_moments(inner: optax.GradientTransformation, key: jax.Array | int | None = None, *, bits: int = 8,
                      block: int | None = None, rounding: str = "nearest",
                      min_size: int = MIN_SIZE, slice_size: int | None = _chunked.SLICE
                      ) -> optax.GradientTransformationExtraArgs:
    """Stores ``inner``'s moments in 8 or 4 bits a value, blockwise (bitsandbytes' 8-bit Adam, torchao's 4-bit).

    Each floating state leaf with ``ndim >= 1`` and at least ``min_size`` elements, whatever its dtype (float32,
    bfloat16 or float16: optax keeps float16 params' moments in float16; fp8 ones are refused), is kept as uint8 codes
    plus a float32 absmax per ``block`` consecutive elements: 1 + 4/256 bytes a value at 8 bits, 0.5 +
    4/128 at 4. ``update`` dequantizes them, runs ``inner`` in float32 and requantizes the new state.
    A leaf under a NamedTuple field named ``nu``, ``nu_max``, ``sum_of_squares``, ``v_row``, ``v_col``,
    ``e_g`` or ``e_x`` is non-negative (unsigned dynamic map at 8 bits; the zero-free linear map
    ``(i + 1) / 16`` at 4 bits, so no second moment rounds to 0); every other one is signed (dynamic
    map). The class comes from the state's structure, never from the values' signs at run time.
    A partial last block is zero-padded in the computation (the padding is not stored); smaller
    leaves and scalars (step counts) keep their dtype. See docs/lean-recipes.md#8-bit-and-4-bit-moments.

    Args:
      inner: the optax transformation whose moments are quantized (e.g. ``optax.adamw``).
      key: an int seed or a threefry2x32 ``jax.random.key``; required for stochastic rounding and
        unused with nearest rounding (a ``MixedPrecisionWarning`` says so).
      bits: 8 or 4.
      block: elements per absmax (default 256 at 8 bits, 128 at 4: torchao's). jaxmp.parallel's
        ZeRO and FSDP split a quantized leaf only where each block stays on one device.
      rounding: ``"nearest"`` (default, as bitsandbytes and torchao) or ``"stochastic"``.
      min_size: leaves with fewer elements stay in their dtype (4096, bitsandbytes' ``min_8bit_size``).
      slice_size: when ``inner``'s update works element by element (Adam, AdamW, Lion, SGD;
        not a global-norm clip or Adafactor), larger leaves are updated about this many values at
        a time, in a loop over slices of their first axis, so that the float32 moments of one
        slice, not of the whole model, are live at once: the same codes, the updates to float32's
        rounding. None: whole leaves, in one program (for a sharding of your own that splits
        leaves on their first axis, which a loop over it would gather; jaxmp.parallel's ZeRO and
        FSDP steps update whole leaves themselves).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is [`QuantizedMomentsState`][jaxmp.lean.QuantizedMomentsState].

    Raises:
      ValueError: ``bits`` not 8 or 4, a ``block`` < 2, a ``min_size`` < 0 or an unknown ``rounding``;
        at ``init``, fp8 moment leaves to quantize (fp8 params: keep float32 masters, the message says
        how); at ``update``, a state that lost its static ``grid`` or its ``map_revision`` (a
        hand-written restore; the message names the restore target), or other bits/block/params.
      TypeError: no ``key`` for stochastic rounding.

    Warns:
      MixedPrecisionWarning: a ``key`` with ``rounding="nearest"`` (unused).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxmp.lean import quantized_moments
      >>> tx = quantized_moments(optax.adam(1e-3), bits=8)
      >>> state = tx.init({"w": jnp.zeros((64, 128)), "b": jnp.zeros(128)})
      >>> adam = state.inner_state[0]
      >>> # "b" is too small:
      >>> adam.mu["w"].dtype, state.absmax[0].nu["w"].shape, adam.mu["b"].dtype
      (dtype('uint8'), (32,), dtype('float32'))
      >>> updates, state = tx.update({"w": jnp.ones((64, 128)), "b": jnp.ones(128)}, state)
    """
    inner = check_inner(inner)
    grid = _grid(bits, block)
    min_size = _check_int(min_size, "min_size", 0)
    slice_size = None if slice_size is None else _check_int(slice_size, "slice_size", 1)
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic":
        key_data = _key_data(key, "quantized_moments")
    else:
        unused_key_warning("quantized_moments", key, "rounding='nearest' rounds each moment to the nearest map entry")
        key_data = jnp.zeros(2, jnp.uint32)

    def init_fn(params):
        state = inner.init(params)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        _refuse_fp8([(path, x) for path, x in leaves if _quantizable(x, min_size)])
        stored, scales = _quantized_leaves(leaves, grid, min_size)
        return QuantizedMomentsState(treedef.unflatten(stored), treedef.unflatten(scales), jnp.array(key_data),
                                     jnp.zeros([], jnp.int32), grid, _revision())

    def update_fn(grads, state, params=None, *, widening=None, **extra_args):  # widening: see WidensItself
        if not isinstance(state, QuantizedMomentsState):
            raise TypeError(f"state must be the QuantizedMomentsState made by quantized_moments' init, got "
                            f"{type(state).__name__}")
        check_restored(state)
        if state.grid != grid:
            raise ValueError(f"quantized_moments: the state was made with bits={state.grid.bits}, "
                             f"block={state.grid.block}, this transformation has bits={grid.bits}, block={grid.block}")
        # A lean wrapper's float32 grads and params, as it holds them (see WidensItself).
        lazy = widening
        g_def = jax.tree_util.tree_structure(grads)
        g_in = _chunked.Inputs((grads,), _chunked.identity) if lazy is None else lazy.grads
        p_in = None if params is None else _chunked.Inputs((params,), _chunked.identity) if lazy is None else lazy.params
        if lazy is not None:
            grads, params = g_in.whole(g_def), None if p_in is None else p_in.whole(g_def)
        # The leaves' own shapes (4-bit codes are packed): the inner state the grads' shapes give.
        template = jax.eval_shape(inner.init, grads)
        t_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
        stored = treedef.flatten_up_to(state.inner_state)
        scales = treedef.flatten_up_to(state.absmax)
        _check_leaves(t_leaves, stored, scales, grid)
        signed = [not _non_negative(path) for path, _ in t_leaves]
        keys = [None] * len(t_leaves) if rounding == "nearest" else leaf_keys(state.key, state.count, len(t_leaves))

        def inner_update(g, s, p):
            return inner.update(g, s, p, **extra_args)

        held = _chunked.Stored(grid, stored, scales, signed, keys)
        # Stochastic rounding draws a slice's bits only where random_bits computes JAX's itself.
        slices = slice_size if rounding == "nearest" or _keys.fused_bits_available() else None
        plan = _slice_plan(inner_update, (grads, params), template, held, slices)
        in_slices = set() if plan is None else {i for s in plan.sliced.values() for i in s.state}
        wide = [None if i in in_slices else c if a is None else grid.dequantize(c, a, signed[i], t.shape)
                for i, ((_, t), c, a) in enumerate(zip(t_leaves, stored, scales))]
        if plan is not None:
            updates, new_wide, codes_out, scales_out = _chunked.update(inner_update, plan, g_in, p_in, wide, held)
        else:
            updates, new_inner = inner_update(grads, treedef.unflatten(wide), params)
            new_wide, codes_out, scales_out = treedef.flatten_up_to(new_inner), list(stored), list(scales)
        out, out_scales = _requantized(held, new_wide, in_slices, (codes_out, scales_out))
        return updates, QuantizedMomentsState(treedef.unflatten(out), treedef.unflatten(out_scales), state.key,
                                              (state.count + 1).astype(jnp.int32), grid, state.map_revision)

    return QuantizedMoments(init_fn, update_fn)


def _grid(bits: Any, block: Any) -> _formats.Grid:
    """The grid of `quantized_moments`' ``bits`` and ``block`` (None: torchao's for the bits)."""
    if bits not in _formats.CODE_BITS or isinstance(bits, bool):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    return _formats.Grid(bits, _BLOCKS[bits] if block is None else _check_int(block, "block", 2))


def _quantized_leaves(leaves: list, grid: _formats.Grid, min_size: int) -> tuple[list, list]:
    """``(stored, scales)`` of an inner state's ``(path, leaf)`` pairs: the codes and absmax of
    each quantizable leaf (its map's sign from its path), the others as they are and None."""
    stored: list[Any] = []
    scales: list[Any] = []
    for path, x in leaves:
        if _quantizable(x, min_size):
            codes, absmax = grid.quantize(x, not _non_negative(path))
            stored.append(codes)
            scales.append(absmax)
        else:
            stored.append(x)
            scales.append(None)
    return stored, scales


def _check_leaves(t_leaves: list, stored: list, scales: list, grid: _formats.Grid) -> None:
    """Refuses quantized leaves whose codes or absmax are not those of their moment's shape."""
    for (path, t), c, a in zip(t_leaves, stored, scales):
        if a is not None and (jnp.shape(c) != grid.codes_shape(t.shape) or a.shape != grid.absmax_shape(t.shape)):
            raise ValueError(f"quantized_moments: state leaf at {jax.tree_util.keystr(path)} holds codes of shape "
                             f"{jnp.shape(c)} and {a.shape} scales, not those of a {t.shape} moment: the "
                             "state was made for other params (or another bits/block)")


def _slice_plan(inner_update: Any, inputs: tuple, template: Any, held: _chunked.Stored,
                slice_size: int | None) -> _chunked.SlicePlan | None:
    """The large leaves to update a slice at a time (docs/lean-recipes.md#the-update-a-slice-at-a-time),
    or None: whole leaves. ``inputs``: ``(grads, params)``; ``template``: the inner state the
    grads' shapes give; ``slice_size`` None: no slices."""
    if slice_size is None or _chunked.whole_leaves_only():
        return None
    grads, params = inputs
    shapes, treedef = jax.tree_util.tree_flatten(template)
    g_leaves, g_def = jax.tree_util.tree_flatten(grads)
    positions = _chunked.mirrors(template, g_def)
    if len(positions) != len(shapes):
        return None
    sliced = _chunked.plan([tuple(jnp.shape(g)) for g in g_leaves], positions, [t.shape for t in shapes],
                           [a is not None for a in held.scales], held.grid, slice_size)
    if not sliced:
        return None
    abstract = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)
    wide = jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(t.shape, jnp.float32) if a is not None
                                                  else abstract(c) for t, c, a in zip(shapes, held.codes, held.scales)])
    dtypes = _chunked.per_element(inner_update, abstract(grads), wide,
                                  None if params is None else abstract(params), positions, sliced)
    return None if dtypes is None else _chunked.SlicePlan(g_def, treedef, sliced, dtypes)


def _requantized(held: _chunked.Stored, new_wide: list, in_slices: set, sliced_out: tuple) -> tuple[list, list]:
    """The new state's leaves and absmax: those of sliced params as the loop left them
    (``sliced_out``: codes and scales per leaf), the other quantized ones requantized from
    ``new_wide``, the rest as the inner update returned them."""
    out, out_scales = [], []
    for i, wide in enumerate(new_wide):
        if i in in_slices:
            out.append(sliced_out[0][i])
            out_scales.append(sliced_out[1][i])
        elif held.scales[i] is None:
            out.append(wide)
            out_scales.append(None)
        else:
            codes, absmax = held.grid.quantize(wide, held.signed[i], held.keys[i])
            out.append(codes)
            out_scales.append(absmax)
    return out, out_scales


def _revision() -> jax.Array:
    return jnp.asarray(_formats.MAP_REVISION, jnp.int32)


class QuantizedMoments(WidensItself):
    """`quantized_moments`' transformation: jaxmp.lean's wrappers around it hand over their float32
    grads and params unwidened (its ``update``'s keyword ``widening``)."""
