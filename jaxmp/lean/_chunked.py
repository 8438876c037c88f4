"""The quantized update a slice at a time, for an inner optimizer that works element by element.

Dequantize, update, requantize as one program over whole leaves holds every large leaf's moments
in float32 at once, twice (the old ones dequantized, the new ones before their absmax): 16 bytes
a parameter of temporaries at GPT-2 width, more than the 4 bytes of state the 8-bit moments save
over float32 ones. When the inner optimizer's update is per element (Adam, AdamW, Lion, SGD with
momentum, a schedule or a mask: `jaxmp._jaxpr.per_element_inputs` reads it off the traced update),
each large leaf is updated instead in slices of whole blocks along its first axis, in a
``fori_loop`` that writes each slice's codes and absmax back into the old ones: the float32
temporaries are one slice's (``SLICE`` values), whatever the model's size. The codes are the
whole-leaf update's (the stochastic rounding draws the same bits: each slice's at its offset in
the leaf); the float32 absmax and updates agree to float32's rounding (XLA contracts
multiply-adds differently in the two programs). Private: `jaxmp.lean.quantized_moments` calls
it; docs/lean-recipes.md says what it saves.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp

from jaxmp import _formats, _jaxpr

#: Values a slice: its float32 temporaries (old and new moments, the update) are a few MiB.
SLICE = 1 << 20

_WHOLE_LEAVES: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxmp_lean_whole_leaves", default=False)


@contextlib.contextmanager
def whole_leaves() -> Iterator[None]:
    """Updates traced inside run on whole leaves. jaxmp.parallel's ZeRO and FSDP enter it: a loop
    over the first axis of a leaf split on that axis makes XLA's partitioner gather and permute
    each slice (tests/parallel/test_layouts.py compares the collectives), and each device's share
    of a leaf is already an eighth of it."""
    token = _WHOLE_LEAVES.set(True)
    try:
        yield
    finally:
        _WHOLE_LEAVES.reset(token)


def whole_leaves_only() -> bool:
    return _WHOLE_LEAVES.get()


class Sliced(NamedTuple):
    """A param leaf updated a slice at a time."""

    shape: tuple    # the param's shape
    rows: int       # rows of its first axis a slice
    slices: int     # whole slices (a shorter last one follows when rows do not divide)
    state: tuple    # the indices of the state leaves that mirror it (all quantized)


def mirrors(state_template: Any, params_def: Any) -> list:
    """For each leaf of an inner state: the index of the param it mirrors (a leaf of a sub-tree
    shaped like the params, of its param's shape), or None (counts, hyperparameters)."""
    n = params_def.num_leaves

    def is_param_tree(x):
        return jax.tree_util.tree_structure(x) == params_def and n > 0 and not (
            n == 1 and jax.tree_util.treedef_is_leaf(params_def))

    out: list = []
    for piece in jax.tree_util.tree_leaves(state_template, is_leaf=is_param_tree):
        out += list(range(n)) if is_param_tree(piece) else [None]
    return out


def plan(param_shapes: list, positions: list, state_shapes: list, quantized: list, grid: _formats.Grid,
         slice_size: int) -> dict:
    """``{param index: Sliced}``: the params large enough to update in two or more slices of about
    ``slice_size`` values, all of whose mirrored state leaves are quantized (cut by ``grid``), with
    slices of whole blocks."""
    if grid.codes_per_byte == 2 and grid.block % 2:
        return {}   # a slice must end on a whole byte of 4-bit codes
    out = {}
    for j, shape in enumerate(param_shapes):
        state = tuple(i for i, pos in enumerate(positions) if pos == j)
        size = math.prod(shape)
        if not state or len(shape) == 0 or size >= 2**32 or not all(
                quantized[i] and state_shapes[i] == shape for i in state):
            continue
        unit = math.prod(shape[1:])
        rows = max(1, slice_size // unit)
        if not grid.axis(shape):   # no slabs within the first axis
            step = grid.block // math.gcd(unit, grid.block)   # flattened blocks: a slice of whole blocks
            rows = max(step, rows // step * step)
        if shape[0] // rows >= 2:
            out[j] = Sliced(tuple(shape), rows, shape[0] // rows, state)
    return out


def per_element(inner_update: Callable, grads: Any, wide: Any, params: Any, positions: list,
                sliced: dict) -> list | None:
    """The dtypes of ``inner_update(grads, wide, params)``'s updates when each of its outputs reads
    the sliced params' leaves only element by element, and only its own param's
    (`_jaxpr.per_element_inputs`); else None. Arguments may be ``jax.ShapeDtypeStruct``."""
    n = len(jax.tree_util.tree_leaves(grads))
    closed, (updates, _) = jax.make_jaxpr(inner_update, return_shape=True)(grads, wide, params)
    ins = list(range(n)) + list(positions) + (list(range(n)) if params is not None else [])
    for pos, deps in zip(list(range(n)) + list(positions), _jaxpr.per_element_inputs(closed)):
        if deps is None:
            return None
        touched = {ins[i] for i in deps if ins[i] in sliced}
        if touched and (pos not in sliced or touched != {pos}):
            return None
    return [u.dtype for u in jax.tree_util.tree_leaves(updates)]


def _span(x_shape: tuple, shape: tuple, start: Any, n_rows: int, per: int, last: bool) -> tuple:
    """``(offset, length)`` on ``x``'s first axis of rows ``start .. start + n_rows`` of a
    ``shape`` leaf: the same rows when ``x`` keeps the leaf's first axis (codes; the absmax of
    slabs within it), else its flat share, ``per`` values an entry (2 for 4-bit codes, ``block``
    for a flat absmax; a slice starts on a whole block, and the last one takes what is left: a
    partial block, an odd code)."""
    if len(x_shape) >= 2 and len(shape) >= 2:
        return start, n_rows
    unit = math.prod(shape[1:])
    offset = start * unit // per
    return offset, (x_shape[0] - offset if last else n_rows * unit // per)


class Inputs(NamedTuple):
    """The gradients or params the inner update reads, as leaf-by-leaf functions of what the
    caller holds: ``fn(*(part leaves))``. A lean wrapper that widens bfloat16 grads and params
    to float32 (`jaxmp.lean.bf16_params`, `param_remainders`: a master from a param and its
    remainder) hands them over unwidened, so that each slice is widened in the loop, never a
    whole float32 copy of a large leaf."""

    parts: tuple      # trees of the params' structure
    fn: Callable      # one leaf of each part -> the leaf the inner update reads

    def leaf(self, treedef: Any, j: int, rows: tuple | None = None) -> jax.Array:
        """Leaf ``j``, or rows ``(start, n)`` of its first axis."""
        leaves = [treedef.flatten_up_to(part)[j] for part in self.parts]
        if rows is not None:
            leaves = [_from_bits(jax.lax.dynamic_slice_in_dim(_to_bits(x), rows[0], rows[1]), x.dtype)
                      for x in leaves]
        return self.fn(*leaves)

    def whole(self, treedef: Any) -> Any:
        return treedef.unflatten([self.leaf(treedef, j) for j in range(treedef.num_leaves)])


def _to_bits(x: jax.Array) -> jax.Array:
    # XLA:CPU computes on a 16-bit float array that a loop slices as a whole float32 copy (a
    # loop over a bfloat16 leaf: 4 bytes an element of temporaries, measured); on its bits, as
    # uint16, it slices in place.
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def identity(x: jax.Array) -> jax.Array:
    return x


class SlicePlan(NamedTuple):
    """What `update` does besides its values: the trees' shapes and which params it slices."""

    g_def: Any          # the params' treedef
    state_def: Any      # the inner state's treedef
    sliced: dict        # {param index: Sliced} (`plan`)
    out_dtypes: list    # the dtypes of the updates' leaves


class Stored(NamedTuple):
    """The inner state's leaves as stored, each with what it is quantized by."""

    grid: _formats.Grid
    codes: list         # the stored leaves (codes where quantized)
    scales: list        # their absmax (None where not quantized)
    signed: list        # per leaf its map's sign
    keys: list          # per leaf the stochastic rounding key, or None (nearest)


def update(inner_update: Callable, plan: SlicePlan, grads: Inputs, params: Inputs | None, wide: list,
           stored: Stored) -> tuple:
    """The inner update with each `Sliced` param's state updated a slice at a time.

    Args:
      inner_update: ``(grads, state, params) -> (updates, state)``, float32 state.
      plan: the trees and the sliced params (`SlicePlan`).
      grads, params: what the inner update reads (`Inputs`); params None when it reads none.
      wide: the inner state's leaves, dequantized (None at the sliced params' state leaves).
      stored: the stored state leaves, their absmax, grid, signs and keys (`Stored`).

    Returns:
      ``(updates, new wide leaves (None at sliced ones), new codes, new scales)``; the lists are
      per state leaf.
    """
    g_def, sliced = plan.g_def, plan.sliced
    base_g = _base(grads, plan)
    base_p = None if params is None else _base(params, plan)
    base_s = list(wide)
    for s in sliced.values():
        for i in s.state:
            base_s[i] = jnp.zeros((0,) + s.shape[1:], jnp.float32)
    run = _Run(inner_update=inner_update, plan=plan, grads=grads, params=params, base_g=base_g, base_p=base_p,
               base_s=base_s, stored=stored)

    # Everything but the sliced leaves, whole (counts, small leaves).
    rest_updates, rest_state = run.call(base_g, base_s, base_p)
    updates = list(rest_updates)
    new_wide = [None if any(i in s.state for s in sliced.values()) else x for i, x in enumerate(rest_state)]
    new_codes, new_scales = list(stored.codes), list(stored.scales)
    for j, s in sliced.items():
        updates[j], codes, scales = run.param(j, s)
        for k, i in enumerate(s.state):
            new_codes[i], new_scales[i] = codes[k], scales[k]
    return g_def.unflatten(updates), new_wide, new_codes, new_scales


def _base(inputs: Inputs, plan: SlicePlan) -> list:
    """Whole leaves but the sliced ones, which are empty: rows of none."""
    out = []
    for j in range(plan.g_def.num_leaves):
        if j in plan.sliced:
            x = jax.eval_shape(lambda j=j: inputs.leaf(plan.g_def, j))
            out.append(jnp.zeros((0,) + tuple(x.shape[1:]), x.dtype))
        else:
            out.append(inputs.leaf(plan.g_def, j))
    return out


class _Run(NamedTuple):
    """One `update`: the inner update, its inputs, and the whole-leaf arguments each slice's call
    shares (the sliced leaves empty in them)."""

    inner_update: Callable
    plan: SlicePlan
    grads: Inputs
    params: Inputs | None
    base_g: list
    base_p: list | None
    base_s: list
    stored: Stored

    def call(self, g: list, s: list, p: list | None) -> tuple:
        g_def, state_def = self.plan.g_def, self.plan.state_def
        updates, new = self.inner_update(g_def.unflatten(g), state_def.unflatten(s),
                                         None if p is None else g_def.unflatten(p))
        return g_def.flatten_up_to(updates), state_def.flatten_up_to(new)

    def param(self, j: int, s: Sliced) -> tuple:
        """``(update, codes, scales)`` of param ``j``, its state's codes and scales per `Sliced.state`."""
        stored = self.stored
        carry = (jnp.zeros(s.shape, self.plan.out_dtypes[j]), tuple(stored.codes[i] for i in s.state),
                 tuple(stored.scales[i] for i in s.state))
        # Each slice reads its own rows of the codes and absmax before writing them: the loop
        # updates them in place.
        carry = jax.lax.fori_loop(0, s.slices, lambda k, c: self.one_slice(j, s, k * s.rows, s.rows, c), carry)
        tail = s.shape[0] - s.slices * s.rows
        if tail:
            carry = self.one_slice(j, s, s.slices * s.rows, tail, carry, last=True)
        return carry

    def one_slice(self, j: int, s: Sliced, start: Any, n_rows: int, carry: tuple, last: bool = False) -> tuple:
        """Rows ``start .. start + n_rows`` of param ``j``: dequantized, updated, requantized."""
        upd, cs, ss = carry
        grid, signed, keys = self.stored.grid, self.stored.signed, self.stored.keys

        def take(x, per):
            offset, length = _span(x.shape, s.shape, start, n_rows, per, last)
            return jax.lax.dynamic_slice_in_dim(x, offset, length)

        def put(x, value, per):
            return jax.lax.dynamic_update_slice_in_dim(x, value, _span(x.shape, s.shape, start, n_rows, per,
                                                                       last)[0], 0)

        g = list(self.base_g)
        g[j] = self.grads.leaf(self.plan.g_def, j, (start, n_rows))
        p = None
        if self.base_p is not None and self.params is not None:
            p = list(self.base_p)
            p[j] = self.params.leaf(self.plan.g_def, j, (start, n_rows))
        st = list(self.base_s)
        piece = (n_rows,) + s.shape[1:]
        for k, i in enumerate(s.state):
            st[i] = grid.dequantize(take(cs[k], grid.codes_per_byte), take(ss[k], grid.block), signed[i], piece)
        u, new = self.call(g, st, p)
        upd = jax.lax.dynamic_update_slice_in_dim(upd, u[j].astype(upd.dtype), start, 0)
        cs, ss = list(cs), list(ss)
        for k, i in enumerate(s.state):
            c, a = grid.quantize(new[i], signed[i], keys[i], start * math.prod(s.shape[1:]))
            cs[k], ss[k] = put(cs[k], c, grid.codes_per_byte), put(ss[k], a, grid.block)
        return upd, tuple(cs), tuple(ss)
