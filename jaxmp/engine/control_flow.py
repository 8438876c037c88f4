"""How the engine enters higher-order primitives: jit, scan, while, cond, remat, custom_jvp,
custom_vjp and shard_map.

Each body is interpreted under the same rules (its name stack extends the enclosing one, so
regions reach inside). Loop carries and the outputs of ``cond`` keep their *traced* dtype:
a float32 carry stays float32 across iterations, so an accumulator (or the cotangent of a
float32 parameter that the transpose of a scan accumulates) never rounds to half once per
step; values flowing into the next op are narrowed by that op's rule as usual.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxmp.engine.interpreter import Val, _np_dtype, dtype_of, is_float

_HANDLED = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint", "scan", "while", "cond",
            "custom_jvp_call", "custom_vjp_call", "shard_map")


def check_first_order(eqn) -> None:
    """Raises a clear error for a higher-order primitive the engine cannot enter."""
    from jaxmp.engine.rules import COMBINER_OPS

    name = eqn.primitive.name
    if name in COMBINER_OPS:
        return
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in items):
            raise NotImplementedError(
                f"jaxmp.autocast cannot enter the higher-order primitive {name!r}: it knows {sorted(_HANDLED)}. "
                "Call autocast inside it instead (e.g. jax.pmap(jaxmp.autocast(f)))."
            )


def _cast(x: Any, dtype: Any) -> Any:
    if dtype is None or not is_float(dtype) or not is_float(dtype_of(x)) or dtype_of(x) == np.dtype(dtype):
        return x
    return jax.lax.convert_element_type(x, dtype)


def _avals_dtypes(avals) -> list:
    return [_np_dtype(a.dtype) if hasattr(a, "dtype") else None for a in avals]


def _run_fn(interp, jaxpr: jcore.Jaxpr, consts, in_flags, comps, out_flags: list) -> Callable:
    """A plain function of arrays that interprets ``jaxpr``; records its outputs' strong flags."""

    def fn(*xs):
        outs = interp.run(jaxpr, consts, [Val(x, s, w) for x, (s, w) in zip(xs, in_flags)], comps)
        out_flags[:] = [(o.strong, o.weak) for o in outs]
        return [o.x for o in outs]

    return fn


def _flags(vals):
    return [(v.strong, v.weak) for v in vals]


def _inline(interp, eqn, vals, comps):
    closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(closed, jcore.ClosedJaxpr):
        return interp.run(closed.jaxpr, closed.consts, vals, comps)
    return interp.run(closed, [], vals, comps)


def _remat(interp, eqn, vals, comps):
    jaxpr = eqn.params["jaxpr"]
    flags: list = []
    fn = _run_fn(interp, jaxpr, [], _flags(vals), comps, flags)
    outs = jax.checkpoint(fn, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])(
        *[v.x for v in vals])
    return [Val(o, *f) for o, f in zip(outs, flags)]


def _scan_counts(params) -> tuple[int, int]:
    """(consts, carries) of a scan: jax < 0.11 names the counts, jax 0.11 packs a flat tree."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _scan(interp, eqn, vals, comps):
    p = eqn.params
    closed, (nc, ncarry) = p["jaxpr"], _scan_counts(p)
    consts, init, xs = vals[:nc], vals[nc:nc + ncarry], vals[nc + ncarry:]
    carry_dtypes = _avals_dtypes(closed.in_avals[nc:nc + ncarry])
    flags: list = []
    in_flags = _flags(consts) + [(False, False)] * ncarry + _flags(xs)
    fn = _run_fn(interp, closed.jaxpr, closed.consts, in_flags, comps, flags)

    def body(carry, x):
        outs = fn(*[c.x for c in consts], *carry, *x)
        return [_cast(o, d) for o, d in zip(outs[:ncarry], carry_dtypes)], outs[ncarry:]

    init_x = [_cast(v.x, d) for v, d in zip(init, carry_dtypes)]
    carry, ys = jax.lax.scan(body, init_x, [v.x for v in xs], length=p["length"], reverse=p["reverse"],
                             unroll=p["unroll"])
    return [Val(c) for c in carry] + [Val(y, *f) for y, f in zip(ys, flags[ncarry:])]


def _while(interp, eqn, vals, comps):
    p = eqn.params
    cj, bj, cn, bn = p["cond_jaxpr"], p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = vals[:cn], vals[cn:cn + bn], vals[cn + bn:]
    dtypes = _avals_dtypes(bj.out_avals)
    carry_flags = [(False, False)] * len(init)
    cond_fn = _run_fn(interp, cj.jaxpr, cj.consts, _flags(cconsts) + carry_flags, comps, [])
    body_fn = _run_fn(interp, bj.jaxpr, bj.consts, _flags(bconsts) + carry_flags, comps, [])

    def body(carry):
        outs = body_fn(*[c.x for c in bconsts], *carry)
        return [_cast(o, d) for o, d in zip(outs, dtypes)]

    out = jax.lax.while_loop(lambda c: cond_fn(*[c_.x for c_ in cconsts], *c)[0], body,
                             [_cast(v.x, d) for v, d in zip(init, dtypes)])
    return [Val(o) for o in out]


def _cond(interp, eqn, vals, comps):
    branches = eqn.params["branches"]
    index, ops = vals[0], vals[1:]
    dtypes = _avals_dtypes(branches[0].out_avals)

    def branch(closed):
        fn = _run_fn(interp, closed.jaxpr, closed.consts, _flags(ops), comps, [])
        return lambda *xs: [_cast(o, d) for o, d in zip(fn(*xs), dtypes)]

    outs = jax.lax.switch(index.x, [branch(b) for b in branches], *[v.x for v in ops])
    return [Val(o) for o in outs]


def _custom_jvp(interp, eqn, vals, comps):
    p = eqn.params
    closed, nc, jvp_fun = p["call_jaxpr"], p["num_consts"], p["jvp_jaxpr_fun"]
    flags: list = []
    primal = _run_fn(interp, closed.jaxpr, closed.consts, _flags(vals), comps, flags)
    nargs = len(vals) - nc

    def call(*xs):
        return primal(*xs)

    fun = jax.custom_jvp(call)

    def jvp(primals, tangents):
        out_p = primal(*primals)
        jaxpr, consts, out_zeros = jvp_fun.call_wrapped(*([False] * nargs))
        outs = interp.run(jaxpr, consts, [Val(x) for x in (*primals[nc:], *tangents[nc:])], comps)
        nz = iter(o.x for o in outs[len(out_zeros):])
        out_t = [jnp.zeros(jnp.shape(o), dtype_of(o)) if z else _cast(next(nz), dtype_of(o))
                 for o, z in zip(out_p, out_zeros)]
        return out_p, out_t

    fun.defjvp(jvp)
    outs = fun(*[v.x for v in vals])
    return [Val(o, *f) for o, f in zip(outs, flags)]


def _bwd_cotangents(out):
    """The cotangents a custom_vjp's flattened bwd returns: jax 0.11 pairs them with its logs."""
    if len(out) == 2 and isinstance(out[0], (list, tuple)) and (out[1] is None or isinstance(out[1], dict)):
        return out[0]
    return out


def _zero_to_array(x):
    from jax._src.ad_util import Zero

    if isinstance(x, Zero):
        return jnp.zeros(x.aval.shape, x.aval.dtype)
    return x


def _custom_vjp(interp, eqn, vals, comps):
    p = eqn.params
    closed, nc = p["call_jaxpr"], p["num_consts"]
    fwd_thunk, bwd, out_trees = p["fwd_jaxpr_thunk"], p["bwd"], p["out_trees"]
    nargs = len(vals) - nc
    flags: list = []
    primal = _run_fn(interp, closed.jaxpr, closed.consts, _flags(vals), comps, flags)
    in_avals = closed.in_avals

    def fwd_parts():
        fwd_jaxpr, fwd_consts = fwd_thunk.call_wrapped(*([True] * nargs))
        _, res_tree, input_fwds = out_trees()
        return fwd_jaxpr, fwd_consts, res_tree, input_fwds

    def fwd(*xs):
        fwd_jaxpr, fwd_consts, res_tree, input_fwds = fwd_parts()
        outs = [o.x for o in interp.run(fwd_jaxpr, fwd_consts, [Val(x) for x in xs[nc:]], comps)]
        num_res = res_tree.num_leaves - sum(f is not None for f in input_fwds)
        res_out = iter(outs[:num_res])
        res = [next(res_out) if f is None else xs[f] for f in input_fwds]
        out_dtypes = [dtype_of(o) for o in jax.eval_shape(primal, *xs)]
        return [_cast(o, d) for o, d in zip(outs[num_res:], out_dtypes)], (res, xs)

    def bwd_rule(saved, cts):
        res, xs = saved
        fwd_jaxpr, _, res_tree, input_fwds = fwd_parts()
        res_out_avals = iter(v.aval for v in fwd_jaxpr.outvars)
        res_avals = [next(res_out_avals) if f is None else in_avals[f] for f in input_fwds]
        ct_avals = [a.to_tangent_aval() for a in closed.out_avals]
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*res_avals, *ct_avals)]
        traced = jax.make_jaxpr(lambda *a: [_zero_to_array(c) for c in _bwd_cotangents(bwd.call_wrapped(*a))])(
            *structs)
        outs = interp.run(traced.jaxpr, traced.consts, [Val(x) for x in (*res, *cts)], comps)
        # The backward rule answers for the primal inputs in their own dtypes.
        cts_in = [_cast(o.x, dtype_of(x)) if is_float(dtype_of(x)) else None for o, x in zip(outs, xs[nc:])]
        return (*[None] * nc, *cts_in)

    fun = jax.custom_vjp(lambda *xs: primal(*xs))
    fun.defvjp(fwd, bwd_rule)
    outs = fun(*[v.x for v in vals])
    return [Val(o, *f) for o, f in zip(outs, flags)]


def _shard_map(interp, eqn, vals, comps):
    p = eqn.params
    flags: list = []
    fn = _run_fn(interp, p["jaxpr"], [], _flags(vals), comps, flags)
    mapped = jax.shard_map(lambda *xs: fn(*xs), mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                           out_specs=list(p["out_specs"]), check_vma=p["check_vma"],
                           axis_names=set(p.get("newly_manual_axes", p.get("manual_axes", ()))))
    outs = mapped(*[v.x for v in vals])
    return [Val(o, *f) for o, f in zip(outs, flags)]


HANDLERS: dict[str, Callable] = {
    "jit": _inline, "pjit": _inline, "closed_call": _inline, "core_call": _inline,
    "remat2": _remat, "checkpoint": _remat, "scan": _scan, "while": _while, "cond": _cond,
    "custom_jvp_call": _custom_jvp, "custom_vjp_call": _custom_vjp, "shard_map": _shard_map,
}
