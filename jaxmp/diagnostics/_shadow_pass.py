"""One pass of the float32 shadow: the step's program re-evaluated as traced and in float32.

The hooks (`_Shadow`) bind each op twice, once as traced and once on float32 operands, and
attribute each op's share of the loss error (``<dL/dy_i, delta_i>``); `ShadowProgram` jits the two
runners; `rank_modules` ranks the modules. See docs/debugging.md#a-float32-shadow-run-ranked-by-module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.diagnostics import _format
from jaxmp.engine._seams import internals
from jaxmp.engine._seams import COMBINER_OPS
from jaxmp.diagnostics._shadow_report import ModuleError
from jaxmp.diagnostics._evaluate import (Hooks, Site, Sites, StrictJit, bind, evaluate, leaf_paths,
                                         trace)


_F32 = np.dtype(np.float32)
#: Ops that move or select values: exact in any dtype, they add no rounding of their own.
_EXACT = frozenset({
    "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "slice", "dynamic_slice",
    "dynamic_update_slice", "gather", "concatenate", "pad", "rev", "copy", "copy_p", "select_n", "max", "min",
    "neg", "abs", "sign", "reduce_max", "reduce_min", "argmax", "argmin", "eq", "ne", "lt", "le", "gt", "ge",
    "stop_gradient", "sharding_constraint", "iota", "floor", "ceil", "round", "is_finite", "clamp",
    "cummax", "cummin", "sort", "split", "pvary", "optimization_barrier", "name",
})


def is_floating(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and _format.is_floating(dtype)


def _up(x):
    return x.astype(jnp.float32) if is_floating(x) and np.dtype(x.dtype) != _F32 else x


def _f32_params(eqn) -> dict:
    p = dict(eqn.params)
    for name in ("new_dtype", "preferred_element_type", "dtype"):
        d = p.get(name)
        if d is not None and _format.is_floating(d) and np.dtype(d).itemsize < 4:
            p[name] = _F32
    return p


def _shadow_bind(eqn, xs: list) -> list:
    """``eqn`` on float32 operands, as float32 (a narrowing is the identity there)."""
    name = eqn.primitive.name
    if name == "reduce_precision" or (name == "convert_element_type" and is_floating(xs[0])
                                      and _format.is_floating(eqn.params["new_dtype"])):
        return [_up(xs[0])]
    if name not in COMBINER_OPS and not internals.sub_jaxprs(eqn):
        try:
            return [_up(o) for o in bind(eqn, xs, _f32_params(eqn))]
        except (TypeError, ValueError):  # an op whose parameters pin its dtypes: run as traced, below
            pass
    # Ops that carry a combiner typed for their traced dtypes (scatter-add, reduce, sort) run in
    # those dtypes: their shadow is as precise as the policy run there.
    traced = [getattr(getattr(a, "aval", None), "dtype", None) for a in eqn.invars]
    args = [x.astype(d) if is_floating(x) and d is not None and _format.is_floating(d) else x
            for x, d in zip(xs, traced)]
    return [_up(o) for o in bind(eqn, args)]


class _Shadow(Hooks):
    """Values are (policy array, float32 twin); the state is the max relative error per site."""

    def __init__(self, n: int, attribute: bool, record: bool = True):
        self.n, self.attribute, self.record, self.t = n, attribute, record, None
        self._frame: list = []

    def lift(self, x, aval):
        return (x, _up(jnp.asarray(x)) if is_floating(x) else x)

    def literal(self, atom):
        x = np.asarray(atom.val, atom.aval.dtype)
        return (x, x.astype(np.float32) if _format.is_floating(x.dtype) else x)

    def index(self, value):
        return value[0]

    def barrier(self, values):
        return [(p, jax.lax.stop_gradient(s)) for p, s in values]

    def first_order(self, site: Site, eqn, ins, state):
        ps, ss = [v[0] for v in ins], [v[1] for v in ins]
        p_out = bind(eqn, ps)
        s_out = _shadow_bind(eqn, ss)
        k = next((i for i, o in enumerate(p_out) if is_floating(o)), None)
        if k is None:
            return list(zip(p_out, s_out)), state
        if self.attribute and self.t is not None and site.half and not site.backward \
                and site.primitive not in _EXACT:
            s_out[k] = s_out[k] + self.t[site.index] * jax.lax.stop_gradient(self._rounding(eqn, ss, k))
        if self.record:
            self._frame.append((site.index, p_out[k], s_out[k]))
        return list(zip(p_out, s_out)), state

    @staticmethod
    def _rounding(eqn, ss, k):
        """Op ``eqn``'s own rounding: as traced on its (rounded) exact inputs, minus float32 on the same."""
        traced = [getattr(getattr(a, "aval", None), "dtype", None) for a in eqn.invars]
        rounded = [x.astype(d) if is_floating(x) and d is not None and _format.is_floating(d) else x
                   for x, d in zip(ss, traced)]
        out = bind(eqn, rounded)[k]
        local = _up(out)
        if np.dtype(out.dtype).itemsize < 4:
            # XLA may keep a half result in float32 inside a fusion (xla_allow_excess_precision);
            # reduce_precision is never elided, so the op's rounding is measured as the dtype has it.
            fi = jnp.finfo(out.dtype)
            local = jax.lax.reduce_precision(local, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
        exact = _shadow_bind(eqn, [_up(x) for x in rounded])[k]
        return local - exact

    def flush(self, errs):
        if not self._frame:
            return errs
        frame, self._frame = self._frame, []
        sizes = [int(np.size(p)) for _, p, _ in frame]
        p = jnp.concatenate([jnp.ravel(p).astype(jnp.float32) for _, p, _ in frame])
        s = jax.lax.stop_gradient(jnp.concatenate([jnp.ravel(s).astype(jnp.float32) for _, _, s in frame]))
        p, s = jax.lax.optimization_barrier((p, s))  # no constant folding through the scatter
        seg = jnp.asarray(np.repeat(np.arange(len(frame), dtype=np.int32), sizes))
        num = jax.ops.segment_sum(jnp.square(p - s), seg, len(frame), indices_are_sorted=True)
        den = jax.ops.segment_sum(jnp.square(s), seg, len(frame), indices_are_sorted=True)
        err = jnp.sqrt(num) / jnp.maximum(jnp.sqrt(den), jnp.finfo(jnp.float32).tiny)
        err = jnp.where((num == 0) & (den == 0), 0.0, err)
        ids = jnp.asarray(np.array([f[0] for f in frame], np.int32))
        return errs.at[ids].max(err)


def scalar_first(shape_tree) -> bool:
    leaves = jax.tree_util.tree_leaves(shape_tree)
    return bool(leaves) and getattr(leaves[0], "shape", None) == () and is_floating(leaves[0])


class ShadowProgram:
    """One traced step, its sites, and jitted runners (policy+shadow with attribution; shadow only)."""

    def __init__(self, run: Callable, args: Sequence[Any], attribute: bool):
        self.closed, self.out_tree = trace(run, tuple(args), {})
        self.sites = Sites(self.closed.jaxpr, leaf_paths(args, {}))
        self.attribute = attribute
        n = len(self.sites)

        def both(t, consts, leaves):
            hooks = _Shadow(n, attribute)
            hooks.t = t
            lifted = [hooks.lift(x, None) for x in leaves]
            outs, errs = evaluate(self.closed.jaxpr, [hooks.lift(c, None) for c in consts], lifted,
                                  jnp.zeros(n, jnp.float32), hooks, self.sites)
            loss = outs[0][1] if attribute else jnp.zeros((), jnp.float32)
            return jnp.asarray(loss, jnp.float32).reshape(()), ([o[0] for o in outs], [o[1] for o in outs], errs)

        self._both = both
        if attribute:
            analyse = jax.value_and_grad(both, has_aux=True)
        else:
            def analyse(t, c, l):
                return both(t, c, l), jnp.zeros(n, jnp.float32)
        # Compiled once per input shapes: the k-step mode runs it on the first and the last step.
        self.analyse = StrictJit(analyse)

        def shadow_only(consts, leaves):
            hooks = _Shadow(n, False, record=False)
            outs, _ = evaluate(self.closed.jaxpr, [hooks.lift(c, None) for c in consts],
                               [hooks.lift(x, None) for x in leaves], jnp.zeros(n, jnp.float32), hooks, self.sites)
            return [o[1] for o in outs]

        self.shadow_fn = shadow_only
        self.shadow = StrictJit(shadow_only)

    def prepare(self, args) -> None:
        """Starts compiling the analysis for inputs shaped as ``args`` in the background (see `run`)."""
        self.analyse.prepare(np.zeros(len(self.sites), np.float32), list(self.closed.consts),
                             jax.tree_util.tree_leaves(tuple(args)))

    def run(self, args):
        leaves = jax.tree_util.tree_leaves(tuple(args))
        t = np.zeros(len(self.sites), np.float32)
        (_, (p, s, errs)), contrib = self.analyse(t, list(self.closed.consts), leaves)
        return p, s, np.asarray(errs), np.asarray(contrib)

    def shadow_outputs(self, args):
        return self.shadow(list(self.closed.consts), jax.tree_util.tree_leaves(tuple(args)))


def relerr(p, s) -> float:
    p, s = np.asarray(p, np.float64), np.asarray(s, np.float64)
    den = np.linalg.norm(s)
    num = np.linalg.norm(p - s)
    return float(num / den) if den > 0 else float(num)


def rank_modules(sites: Sites, errs, contrib, total: float) -> list[ModuleError]:
    by: dict[str, dict] = {}
    for site in sites.sites:
        m = by.setdefault(site.path, {"impact": 0.0, "act": 0.0, "grad": float("nan"), "half": 0, "first": site.index})
        e = float(errs[site.index])
        if site.backward:
            m["grad"] = e if np.isnan(m["grad"]) else max(m["grad"], e)
        else:
            m["impact"] += float(contrib[site.index])
            m["act"] = max(m["act"], e)
        m["half"] += int(site.half)
    mods = [ModuleError(p, d["impact"], d["impact"] / total if total else float("nan"), d["act"], d["grad"],
                        d["half"], d["first"]) for p, d in by.items()]
    # The jump: in program order, the forward op whose error rises most over every op before it
    # (at least 4x); its module is marked.
    best, best_ratio, prev = None, 4.0, 0.0
    for site in sites.sites:
        if site.backward:
            continue
        e = float(errs[site.index])
        if prev > 0 and np.isfinite(e) and e / prev > best_ratio:
            best, best_ratio = site.path, e / prev
        if np.isfinite(e):
            prev = max(prev, e)
    return [dataclasses.replace(m, jump=m.path == best) for m in mods]


def half_dtype(sites: Sites):
    """The coarsest half dtype the program computes in (its rounding sets the noise floor), or None."""
    found = {np.dtype(d) for site in sites.sites for d in _dtypes_of(site.eqn) if _format.is_low_precision(d)}
    return max(found, key=lambda d: float(jnp.finfo(d).eps)) if found else None


def _dtypes_of(eqn) -> list:
    return [a.aval.dtype for a in (*eqn.invars, *eqn.outvars)
            if getattr(getattr(a, "aval", None), "dtype", None) is not None and is_floating(a.aval)]


