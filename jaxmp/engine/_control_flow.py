"""How the engine enters higher-order primitives: jit, scan, while, cond, remat, custom_jvp,
custom_vjp and shard_map.

Bodies run under the same rules; loop carries and ``cond`` outputs keep their traced dtype, and a
carry used only by the add chain that makes its next value is an accumulator kept in its dtype.
See docs/autocast.md#control-flow-differentiation-and-parallelism.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmp import _ops
from jaxmp.engine import _internals as internals
from jaxmp.engine._internals import Literal
from jaxmp.engine._values import Val, dtype_of, is_float, np_dtype

#: Ops an accumulator's value may pass through on its way to the next carry (the op catalogue's).
_ACCUMULATE = _ops.having("accumulates")
_ADDS = _ops.having("adds")


def accumulators(jaxpr: Any, carry_in: Sequence[int], carry_out: Sequence[int]) -> list[bool]:
    """Which carries of a loop body are accumulators.

    See docs/autocast.md#control-flow-differentiation-and-parallelism.

    Args:
      jaxpr: the loop body.
      carry_in: the positions of the carries among ``jaxpr.invars``.
      carry_out: their positions among ``jaxpr.outvars``.

    Returns:
      One flag per carry.
    """
    uses: dict[Any, list] = {}
    for eqn in internals.equations(jaxpr):
        for a in eqn.invars:
            if not internals.is_literal(a):
                uses.setdefault(a, []).append(eqn)
    out_pos: dict[Any, list[int]] = {}
    for i, a in enumerate(jaxpr.outvars):
        if not internals.is_literal(a):
            out_pos.setdefault(a, []).append(i)
    flags = []
    for i_in, i_out in zip(carry_in, carry_out):
        v = jaxpr.invars[i_in]
        if not is_float(np_dtype(getattr(v.aval, "dtype", None))):
            flags.append(False)
            continue
        flags.append(_accumulates(v, i_out, uses, out_pos))
    return flags


def _accumulates(carry: Any, i_out: int, uses: dict, out_pos: dict) -> bool:
    """Whether every use of ``carry`` is the chain of ops that makes the body's output ``i_out``.

    The chain passes through `_ACCUMULATE` ops (one operand from the chain each) and may
    branch and rejoin through ``select_n`` -- ``jnp.where(valid, acc + y, acc)``, the masked sum
    of padded steps -- whose predicate does not come from the chain. It must add something.
    """
    chain, todo, added, ends = {carry}, [carry], False, []
    while todo:
        v = todo.pop()
        if out_pos.get(v):
            ends.append(v)
        for eqn in uses.get(v, []):
            name = eqn.primitive.name
            if len(eqn.outvars) != 1:
                return False
            if name == "select_n":
                if _in(eqn.invars[0], chain):  # the predicate must not come from the chain
                    return False
            elif name in _JITS and _is_where(eqn, chain):
                pass
            elif name not in _ACCUMULATE or sum(_in(a, chain) for a in eqn.invars) != 1:
                return False
            added = added or name in _ADDS
            o = eqn.outvars[0]
            if o not in chain:
                chain.add(o)
                todo.append(o)
    return added and len(ends) == 1 and out_pos[ends[0]] == [i_out] and not uses.get(ends[0])


def _is_where(eqn, chain: set) -> bool:
    """A nested jit that only selects (``jnp.where``), its predicates not from ``chain``."""
    inner, _ = internals.call_jaxpr(eqn)
    from_chain = {iv for iv, a in zip(inner.invars, eqn.invars) if _in(a, chain)}
    return len(eqn.outvars) == 1 and all(
        e.primitive.name == "select_n" and not _in(e.invars[0], from_chain) for e in internals.equations(inner))


def _in(atom: Any, chain: set) -> bool:
    return not isinstance(atom, Literal) and atom in chain


def _cast(x: Any, dtype: Any) -> Any:
    if dtype is None or not is_float(dtype) or not is_float(dtype_of(x)) or dtype_of(x) == np.dtype(dtype):
        return x
    return jax.lax.convert_element_type(x, dtype)


#: The call primitives that are a nested ``jax.jit`` (its shardings and donation kept).
_JITS = _ops.having("jit")


def _in_avals(body) -> list:
    return [v.aval for v in body.jaxpr.invars]


def _out_avals(body) -> list:
    return [v.aval for v in body.jaxpr.outvars]


def _avals_dtypes(avals) -> list:
    return [np_dtype(a.dtype) if hasattr(a, "dtype") else None for a in avals]


def _run_fn(interp, jaxpr: Any, consts, in_flags, comps, out_flags: list) -> Callable:
    """A plain function of arrays that interprets ``jaxpr``; records its outputs' strong flags."""

    def fn(*xs):
        outs = interp.run(jaxpr, consts, [Val(x, *f) for x, f in zip(xs, in_flags)], comps)
        out_flags[:] = [(o.strong, o.weak, o.const) for o in outs]
        return [o.x for o in outs]

    return fn


def _flags(vals):
    return [(v.strong, v.weak, v.const) for v in vals]


_PLAIN = (False, False, False)
_ACCUMULATOR = (True, False, False)


def _call(interp, eqn, vals, comps):
    """A nested jit or call: inlined, unless it carries shardings or donation, which are kept."""
    (body,) = internals.bodies(eqn)
    jaxpr, consts = body.jaxpr, body.consts
    if eqn.primitive.name in _JITS:
        flags: list = []
        jitted = internals.jit_wrapper(eqn, _run_fn(interp, jaxpr, consts, _flags(vals), comps, flags))
        if jitted is not None:
            outs = jitted(*[v.x for v in vals])
            return [Val(o, *f) for o, f in zip(outs, flags)]
    return interp.run(jaxpr, consts, vals, comps)


def _remat(interp, eqn, vals, comps):
    (body,) = internals.bodies(eqn)
    flags: list = []
    fn = _run_fn(interp, body.jaxpr, body.consts, _flags(vals), comps, flags)
    outs = jax.checkpoint(fn, prevent_cse=internals.param(eqn, "prevent_cse"), policy=internals.param(eqn, "policy"))(
        *[v.x for v in vals])
    return [Val(o, *f) for o, f in zip(outs, flags)]


def _scan(interp, eqn, vals, comps):
    (closed,), (nc, ncarry) = internals.bodies(eqn), internals.scan_counts(eqn)
    consts, init, xs = vals[:nc], vals[nc:nc + ncarry], vals[nc + ncarry:]
    carry_dtypes = _avals_dtypes(_in_avals(closed)[nc:nc + ncarry])
    flags: list = []
    acc = accumulators(closed.jaxpr, range(nc, nc + ncarry), range(ncarry))
    in_flags = _flags(consts) + [_ACCUMULATOR if a else _PLAIN for a in acc] + _flags(xs)
    fn = _run_fn(interp, closed.jaxpr, closed.consts, in_flags, comps, flags)

    def body(carry, x):
        outs = fn(*[c.x for c in consts], *carry, *x)
        return [_cast(o, d) for o, d in zip(outs[:ncarry], carry_dtypes)], outs[ncarry:]

    init_x = [_cast(v.x, d) for v, d in zip(init, carry_dtypes)]
    carry, ys = jax.lax.scan(body, init_x, [v.x for v in xs], length=internals.param(eqn, "length"),
                             reverse=internals.param(eqn, "reverse"), unroll=internals.param(eqn, "unroll"))
    carry_flags = [[in_flags[nc + i], flags[i]] for i in range(ncarry)]
    return [Val(c, _strong_out(c, f)) for c, f in zip(carry, carry_flags)] + \
        [Val(y, *f) for y, f in zip(ys, flags[ncarry:])]


def _while(interp, eqn, vals, comps):
    _, _, cn, bn = internals.while_parts(eqn)
    cj, bj = internals.bodies(eqn)
    cconsts, bconsts, init = vals[:cn], vals[cn:cn + bn], vals[cn + bn:]
    dtypes = _avals_dtypes(_out_avals(bj))
    acc = accumulators(bj.jaxpr, range(bn, bn + len(init)), range(len(init)))
    carry_flags = [_ACCUMULATOR if a else _PLAIN for a in acc]
    cond_fn = _run_fn(interp, cj.jaxpr, cj.consts, _flags(cconsts) + [_PLAIN] * len(init), comps, [])
    out_flags: list = []
    body_fn = _run_fn(interp, bj.jaxpr, bj.consts, _flags(bconsts) + carry_flags, comps, out_flags)

    def body(carry):
        outs = body_fn(*[c.x for c in bconsts], *carry)
        return [_cast(o, d) for o, d in zip(outs, dtypes)]

    out = jax.lax.while_loop(lambda c: cond_fn(*[c_.x for c_ in cconsts], *c)[0], body,
                             [_cast(v.x, d) for v, d in zip(init, dtypes)])
    out_flags = out_flags or [_PLAIN] * len(out)  # filled when while_loop traces the body
    return [Val(o, _strong_out(o, [c, f])) for o, c, f in zip(out, carry_flags, out_flags)]


def _cond(interp, eqn, vals, comps):
    branches = internals.bodies(eqn)
    index, ops = vals[0], vals[1:]
    dtypes = _avals_dtypes(_out_avals(branches[0]))

    flags: list[list] = []

    def branch(closed):
        flags.append([])
        fn = _run_fn(interp, closed.jaxpr, closed.consts, _flags(ops), comps, flags[-1])
        return lambda *xs: [_cast(o, d) for o, d in zip(fn(*xs), dtypes)]

    outs = jax.lax.switch(index.x, [branch(b) for b in branches], *[v.x for v in ops])
    # A float32 output that any branch computes as float32 (a batch mean) stays float32 for the
    # ops after the cond, as it would without the cond.
    return [Val(o, _strong_out(o, [f[i] for f in flags if i < len(f)])) for i, o in enumerate(outs)]


def _strong_out(x: Any, flags: Sequence[tuple]) -> bool:
    return is_float(dtype_of(x)) and dtype_of(x).itemsize >= 4 and any(f[0] for f in flags)


def _custom_jvp(interp, eqn, vals, comps):
    closed, nc, jvp_fun = internals.custom_jvp_parts(eqn)
    symbolic = internals.custom_symbolic_zeros(eqn)
    flags: list = []
    primal = _run_fn(interp, closed.jaxpr, closed.consts, _flags(vals), comps, flags)

    def call(*xs):
        return primal(*xs)

    # The rule sees the tangents JAX gives it in float32: symbolic zeros where the input is not
    # differentiated when it asked for them (symbolic_zeros=True; Equinox's rules do), zeros
    # otherwise, which JAX instantiates for a wrapper declared the same way.
    fun = jax.custom_jvp(call)

    def jvp(primals, tangents):
        out_p = primal(*primals)
        tangents = tangents[nc:]  # the consts' tangents are dropped, as JAX's lift_jvp drops them
        zeros = [internals.is_zero(t) for t in tangents]
        jaxpr, consts, out_zeros = internals.custom_jvp_rule(jvp_fun, zeros)
        nonzero = [t for t, z in zip(tangents, zeros) if not z]
        outs = interp.run(jaxpr, consts, [Val(x) for x in (*primals[nc:], *nonzero)], comps)
        nz = iter(o.x for o in outs[len(out_zeros):])
        out_t = [internals.symbolic_zero(o) if z else _cast(next(nz), dtype_of(o)) for o, z in zip(out_p, out_zeros)]
        return out_p, out_t

    fun.defjvp(jvp, symbolic_zeros=symbolic)
    outs = fun(*[v.x for v in vals])
    return [Val(o, *f) for o, f in zip(outs, flags)]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Perturbed:
    """Which inputs a custom_vjp's forward pass saw differentiated: a residual with no leaves."""

    flags: tuple[bool, ...]


def _custom_vjp(interp, eqn, vals, comps):
    closed, nc, fwd_thunk, bwd, out_trees = internals.custom_vjp_parts(eqn)
    symbolic = internals.custom_symbolic_zeros(eqn)
    flags: list = []
    primal = _run_fn(interp, closed.jaxpr, closed.consts, _flags(vals), comps, flags)
    in_avals = closed.in_avals
    ct_avals = [a.to_tangent_aval() for a in closed.out_avals]
    rules: dict = {}  # the forward rule traced once per pattern of differentiated inputs

    def fwd_parts(perturbed: tuple[bool, ...]):
        if perturbed not in rules:
            rules[perturbed] = internals.custom_vjp_fwd(fwd_thunk, out_trees, perturbed)
        return rules[perturbed]

    # The wrapper takes symbolic zeros whatever the rule's setting: its forward pass learns which
    # inputs are differentiated (CustomVJPPrimal.perturbed), as JAX tells the rule in float32;
    # Equinox's filter_custom_vjp asserts it, and every rule skips work with it.
    def fwd(*args):
        xs = [a.value for a in args]
        if any(a.perturbed for a in args[:nc]):
            # a closed-over value is differentiated: the rule has no cotangent for it (JAX says so too)
            raise internals.closed_over_perturbed()
        perturbed = tuple(a.perturbed for a in args[nc:])
        fwd_jaxpr, fwd_consts, res_tree, input_fwds = fwd_parts(perturbed)
        outs = [o.x for o in interp.run(fwd_jaxpr, fwd_consts, [Val(x) for x in xs[nc:]], comps)]
        num_res = res_tree.num_leaves - sum(f is not None for f in input_fwds)
        res_out = iter(outs[:num_res])
        res = [next(res_out) if f is None else xs[f] for f in input_fwds]
        out_dtypes = [dtype_of(o) for o in jax.eval_shape(primal, *xs)]
        return [_cast(o, d) for o, d in zip(outs[num_res:], out_dtypes)], (res, xs, _Perturbed(perturbed))

    def bwd_rule(saved, cts):
        res, xs, perturbed = saved
        fwd_jaxpr, _, res_tree, input_fwds = fwd_parts(perturbed.flags)
        res_out = iter(fwd_jaxpr.outvars)
        res_atoms = [next(res_out) if f is None else None for f in input_fwds]
        res_avals = [in_avals[f] if a is None else a.aval for a, f in zip(res_atoms, input_fwds)]
        # A residual the forward rule returns as a constant (Equinox's `perturbed` booleans) reaches
        # the rule as that constant, as JAX's evaluation of the forward jaxpr gives it: a rule may
        # branch on it in Python.
        literal = [a is not None and internals.is_literal(a) for a in res_atoms]
        zero_cts = [internals.is_zero(c) for c in cts]
        nonzero_cts = [c for c, z in zip(cts, zero_cts) if not z]
        zero_outs: list = []

        def run_bwd(traced_res, nonzero_):
            given = iter(traced_res)
            res_ = [a.val if lit else next(given) for a, lit in zip(res_atoms, literal)]
            nz = iter(nonzero_)
            # zero cotangents reach the rule as JAX gives them: symbolic when it takes symbolic zeros
            zero = internals.symbolic_zero_of if symbolic else (
                lambda a: internals.instantiate_zero(internals.symbolic_zero_of(a)))
            cts_ = [zero(a) if z else next(nz) for a, z in zip(ct_avals, zero_cts)]
            got = internals.custom_vjp_bwd_cotangents(bwd.call_wrapped(*res_, *cts_))
            zero_outs[:] = [internals.is_zero(g) for g in got]
            return [g for g in got if not internals.is_zero(g)]

        # The avals themselves, not shape-and-dtype copies: inside a shard_map they say which mesh
        # axes a value varies over, and JAX checks the rule's cotangents against the primal's.
        structs = [a for a, lit in zip(res_avals, literal) if not lit]
        ct_structs = [a for a, z in zip(ct_avals, zero_cts) if not z]
        traced = jax.make_jaxpr(run_bwd)(structs, ct_structs)
        traced_res = [r for r, lit in zip(res, literal) if not lit]
        outs = iter(interp.run(traced.jaxpr, traced.consts, [Val(x) for x in (*traced_res, *nonzero_cts)], comps))
        # The backward rule answers for the primal inputs in their own dtypes; a symbolic zero
        # stays one (None).
        cts_in = []
        for x, z in zip(xs[nc:], zero_outs):
            o = None if z else next(outs)
            cts_in.append(_cast(o.x, dtype_of(x)) if o is not None and is_float(dtype_of(x)) else None)
        return (*[None] * nc, *cts_in)

    fun = jax.custom_vjp(lambda *xs: primal(*xs))
    fun.defvjp(fwd, bwd_rule, symbolic_zeros=True)
    outs = fun(*[v.x for v in vals])
    return [Val(o, *f) for o, f in zip(outs, flags)]


def _shard_map(interp, eqn, vals, comps):
    parts = internals.shard_map_parts(eqn)
    flags: list = []
    fn = _run_fn(interp, parts.pop("jaxpr"), [], _flags(vals), comps, flags)
    mapped = jax.shard_map(lambda *xs: fn(*xs), **parts)
    outs = mapped(*[v.x for v in vals])
    return [Val(o, *f) for o, f in zip(outs, flags)]


#: Ops that only move or re-type a value: a weight passes through them to its matmul.
_LAYOUT = _ops.having("weight_path")


def weight_inputs(jaxpr: Any, half_ops: frozenset[str],
                  runs_in_half: Callable[[tuple[str, ...]], bool] | None = None) -> list[bool]:
    """Which inputs of ``jaxpr`` are weights: every use of them, through layout ops and into nested
    jits, loops (as constants or scanned inputs), conds, remat and custom derivatives, is a
    half-list op. O2 casts exactly these on entry; everything else (running statistics, biases,
    norm scales, state) enters as passed and is narrowed at its uses by the promotion rule.

    Args:
      jaxpr: an open jaxpr.
      half_ops: the half list.
      runs_in_half: whether a half-list op under these name-stack components runs in half (a
        float32 region, scope rule or nested ``O0`` autocast says no: its weights stay as passed).

    Returns:
      One flag per invar.
    """
    memo: dict = {}

    def var(j, v, prefix=()) -> tuple[bool, bool]:  # (every use is half, some use is half)
        key = (id(j), v, prefix)
        if key in memo:
            return memo[key]
        memo[key] = (False, False)  # cycles cannot happen in a jaxpr; guards recursion anyway
        if any(a is v for a in j.outvars):
            memo[key] = (False, False)
            return memo[key]
        every, some = True, False
        for eqn in internals.equations(j):
            positions = [i for i, a in enumerate(eqn.invars) if a is v]
            if not positions:
                continue
            for i in positions:
                e, s = use(eqn, i, prefix)
                every, some = every and e, some or s
            if not every:
                break
        memo[key] = (every, some)
        return memo[key]

    def use(eqn, i, prefix) -> tuple[bool, bool]:
        name = eqn.primitive.name
        comps = prefix + internals.scope_names(eqn)
        if name in half_ops:
            half = runs_in_half is None or runs_in_half(comps)
            return half, half
        if name in _LAYOUT:
            return var_all(eqn.outvars, prefix)

        # Into the bodies the engine enters (`HANDLERS`), operand i bound to their inputs as the
        # dispatcher maps them; a loop carry is no weight (it changes), nor what a body does not read.
        if internals.dispatch(eqn, HANDLERS) is None:
            return False, False
        try:
            results = []
            for body in internals.bodies(eqn):
                for k, o in enumerate(body.operands):
                    if o == i:
                        if k in body.carries:
                            return False, False
                        results.append(var(body.jaxpr, body.jaxpr.invars[k], comps))
        except (IndexError, internals.JaxInternalsError):
            return False, False
        if not results:
            return False, False
        return all(r[0] for r in results), any(r[1] for r in results)

    def var_all(outvars, prefix) -> tuple[bool, bool]:
        every, some = True, False
        for o in outvars:
            e, s = var(parents[o], o, prefix)
            every, some = every and e, some or s
        return every, some

    parents: dict = {}

    def index(j):
        for eqn in internals.equations(j):
            for o in eqn.outvars:
                parents[o] = j
            for sub in internals.sub_jaxprs(eqn):
                index(internals.open_jaxpr(sub))

    index(jaxpr)
    flags = []
    for v in jaxpr.invars:
        every, some = var(jaxpr, v)
        flags.append(every and some)
    return flags


#: The kinds the engine enters (all but ``pmap``, run as traced), read through `jaxmp._jaxpr.dispatch`.
HANDLERS: dict[str, Callable] = {
    "call": _call, "remat": _remat, "scan": _scan, "while": _while, "cond": _cond,
    "custom_jvp": _custom_jvp, "custom_vjp": _custom_vjp, "shard_map": _shard_map,
}


def handler_for(eqn) -> Callable | None:
    """The handler of a higher-order equation the engine enters, or None (first-order or opaque)."""
    found = internals.dispatch(eqn, HANDLERS)
    return None if found is None else found[1]
