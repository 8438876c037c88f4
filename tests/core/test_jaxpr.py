"""Unit tests of jaxmp._jaxpr, the one jaxpr reader: the cases tests/engine/test_internals.py
(its main suite) leaves out -- the walk's order and nesting, the older string name stacks,
unknown source locations, rebinding with other parameters, and bad input."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxmp import _jaxpr

S, T = (lambda n: _jaxpr.StackItem("scope", n)), (lambda n: _jaxpr.StackItem("transform", n))


def _fake_eqn(name_stack, traceback=None, params=None):
    return SimpleNamespace(source_info=SimpleNamespace(name_stack=name_stack, traceback=traceback),
                           params=params or {})


def test_walk_is_pre_order_with_depth_and_parents():
    def f(x):
        y = jnp.sin(x)
        y = jax.jit(lambda v: jax.lax.scan(lambda c, _: (jnp.cos(c), None), v, None, length=2)[0])(y)
        return jnp.exp(y)

    eqns = list(_jaxpr.walk(jax.make_jaxpr(f)(1.0)))
    assert [(e.primitive, e.depth) for e in eqns] == [("sin", 0), ("jit", 0), ("scan", 1), ("cos", 2), ("exp", 0)]
    cos = eqns[3]
    assert cos.parent is eqns[2] and cos.parent.parent is eqns[1] and eqns[1].parent is None


def test_walk_enters_while_custom_derivatives_and_shard_map():
    @jax.custom_vjp
    def f(x):
        return jnp.tanh(x)

    f.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g,))

    @jax.custom_jvp
    def g(x):
        return jnp.log1p(x)

    g.defjvp(lambda p, t: (g(p[0]), t[0]))
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    smap = jax.shard_map(lambda a: jnp.sqrt(a), mesh=mesh, in_specs=P("x"), out_specs=P("x"))

    def prog(x):
        n = jax.lax.while_loop(lambda c: jnp.abs(c) < 10.0, lambda c: c * 2.0, x[0])
        return f(x) + g(x) + smap(x) + n

    found = {e.primitive for e in _jaxpr.walk(jax.make_jaxpr(prog)(jnp.ones(2)))}
    # lt/abs: the while's cond; mul: its body; tanh/log1p: the custom rules' primals; sqrt: shard_map's body
    assert {"abs", "lt", "mul", "tanh", "log1p", "sqrt"} <= found, found


def test_walk_refuses_what_is_not_a_jaxpr():
    with pytest.raises(TypeError, match=r"expected a Jaxpr or ClosedJaxpr \(from jax.make_jaxpr\), got function"):
        list(_jaxpr.walk(lambda x: x))  # a function not traced yet
    with pytest.raises(TypeError, match=r"got list"):
        _jaxpr.equations([])


def test_sub_jaxprs_reads_lists_and_tuples_in_parameter_order():
    a = jax.make_jaxpr(jnp.sin)(1.0)
    b = jax.make_jaxpr(jnp.cos)(1.0)
    eqn = _fake_eqn("", params={"first": [b.jaxpr, 3], "n": 2, "then": (a,), "last": a})
    assert _jaxpr.sub_jaxprs(eqn) == [b.jaxpr, a, a]
    assert _jaxpr.sub_jaxprs(eqn, opened=True) == [b.jaxpr, a.jaxpr, a.jaxpr]


def test_stack_of_reads_the_older_string_form_as_scopes():
    assert _jaxpr.stack_of(_fake_eqn("outer/inner")) == (S("outer"), S("inner"))
    assert _jaxpr.stack_of(_fake_eqn("a//b/")) == (S("a"), S("b"))  # empty components dropped
    assert _jaxpr.stack_of(_fake_eqn("")) == ()
    assert _jaxpr.scope_names(_fake_eqn("x/y")) == ("x", "y")


def test_render_of_transforms_with_no_scope_inside():
    assert _jaxpr.render((T("vmap"),)) == "vmap()"
    assert _jaxpr.render((T("jvp"), T("vmap"))) == "jvp(vmap())"
    assert _jaxpr.render((T("transpose"), S("a"), S("b"))) == "transpose(a)/b"


def test_equation_scopes_and_transforms_split_the_full_stack():
    e = _jaxpr.Equation(eqn=None, stack=(S("model"), T("jvp"), S("dense"), T("transpose")))
    assert e.scopes == ("model", "dense") and e.transforms == ("jvp", "transpose")
    assert e.name == "model/jvp(dense)/transpose()"  # a trailing transform wraps nothing
    # eq=False: two records of the same equation at different places are different records
    assert _jaxpr.Equation(eqn=None) != _jaxpr.Equation(eqn=None)


def test_source_is_empty_when_there_is_no_traceback():
    eqn = _fake_eqn("", traceback=None)
    assert _jaxpr.user_frames(eqn) == [] and _jaxpr.source_line(eqn) == ""
    assert _jaxpr.Equation(eqn).source == ""


def test_bind_with_other_parameters():
    eqn = _jaxpr.equations(jax.make_jaxpr(lambda x: x ** 3)(2.0))[0]
    assert eqn.primitive.name == "integer_pow" and eqn.params["y"] == 3
    assert float(_jaxpr.bind(eqn, [jnp.float32(2.0)])[0]) == 8.0
    assert float(_jaxpr.bind(eqn, [jnp.float32(2.0)], {**eqn.params, "y": 5})[0]) == 32.0
    assert eqn.params["y"] == 3  # the equation's own parameters are not changed


def test_equation_context_puts_the_callers_scope_in_front():
    def traced(x):
        with jax.named_scope("inner"):
            return jnp.sin(x)

    eqn = _jaxpr.equations(jax.make_jaxpr(traced)(1.0))[0]

    def again(x):
        with jax.named_scope("caller"), _jaxpr.equation_context(eqn):
            return _jaxpr.bind(eqn, [x])[0]

    rebound = _jaxpr.equations(jax.make_jaxpr(again)(1.0))[0]
    assert _jaxpr.scope_names(rebound) == ("caller", "inner")
    assert _jaxpr.source_line(rebound) == _jaxpr.source_line(eqn)  # the original line, not this wrapper's


def test_primitive_objects_keeps_the_order_and_skips_unknown_names():
    prims = _jaxpr.primitive_objects("cos_p", "not_a_primitive_p", "sin_p")
    assert [p.name for p in prims] == ["cos", "sin"]
    assert _jaxpr.primitive_objects() == ()


# -- the control-flow dispatcher -------------------------------------------------------------

def _top(fn, *args):
    """The last top-level equation of ``fn``'s jaxpr (the construct under test)."""
    return _jaxpr.equations(jax.make_jaxpr(fn)(*args))[-1]


def _loops_and_branches():
    def scan(w, c, xs):
        return jax.lax.scan(lambda c, x: (c * w + x, c), c, xs)

    def while_(limit, step, x):
        return jax.lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + step, c[1] * 2.0), (0.0, x))

    def cond(p, x, y):
        return jax.lax.cond(p, lambda a, b: a * b, lambda a, b: a - b, x, y)

    return {
        "scan": (scan, (2.0, 1.0, jnp.arange(3.0)), ["scan x3"]),
        "while": (while_, (8.0, 1.0, 1.0), ["while", "while"]),
        "cond": (cond, (True, 1.0, 2.0), ["cond branch 0/2", "cond branch 1/2"]),
        "call": (jax.jit(lambda a, b: a * b), (1.0, 2.0), [""]),
        "remat": (jax.checkpoint(lambda a, b: a * b), (1.0, 2.0), [""]),
    }


@pytest.mark.parametrize("kind", ["scan", "while", "cond", "call", "remat"])
def test_bodies_bind_each_input_to_the_operand_of_its_type(kind):
    fn, args, labels = _loops_and_branches()[kind]
    eqn = _top(fn, *args)
    assert _jaxpr.primitive_kind(eqn) == kind
    bodies = _jaxpr.bodies(eqn)
    assert [b.label for b in bodies] == labels
    for body in bodies:
        assert len(body.operands) == len(body.jaxpr.invars)
        for k, o in enumerate(body.operands):
            inner, outer = body.jaxpr.invars[k].aval, eqn.invars[o].aval
            scanned = kind == "scan" and k >= max(body.carries) + 1
            assert inner.dtype == outer.dtype
            assert inner.shape == (outer.shape[1:] if scanned else outer.shape), (kind, k, o)


def test_bodies_mark_the_loop_carries_and_the_trip_counts():
    fns = _loops_and_branches()
    (scan,) = _jaxpr.bodies(_top(fns["scan"][0], *fns["scan"][1]))
    assert scan.carries == {1} and scan.trips == 3  # w is a const, c the carry, xs scanned
    cond_fn, body = _jaxpr.bodies(_top(fns["while"][0], *fns["while"][1]))
    # the cond reads `limit` (operand 0), the body `step` (operand 1); both see the two carries
    assert cond_fn.operands == (0, 2, 3) and body.operands == (1, 2, 3)
    assert cond_fn.carries == {1, 2} and body.carries == {1, 2} and body.trips is None
    branches = _jaxpr.bodies(_top(fns["cond"][0], *fns["cond"][1]))
    assert all(b.operands == (1, 2) and not b.carries and b.trips == 1 for b in branches)  # the index is no input


def test_bodies_of_custom_derivatives_shard_map_and_closed_over_constants():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), t[0]))
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    smap = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    (body,) = _jaxpr.bodies(_top(f, 1.0))
    assert _jaxpr.primitive_kind(_top(f, 1.0)) == "custom_jvp"
    assert [e.primitive.name for e in _jaxpr.equations(body.jaxpr)] == ["sin"]
    (body,) = _jaxpr.bodies(_top(smap, jnp.ones(4)))
    assert body.label == "shard_map" and body.operands == (0,)
    # a scan body closing over an array keeps it as a const, given with the body
    big = np.arange(3.0)
    (body,) = _jaxpr.bodies(_top(lambda c: jax.lax.scan(lambda c, _: (c + jnp.asarray(big), None), c, None,
                                                        length=2)[0], jnp.zeros(3)))
    assert len(body.consts) == len(body.jaxpr.constvars)


def test_bodies_of_a_first_order_equation_are_none_and_a_missing_parameter_is_named():
    assert _jaxpr.bodies(_top(jnp.sin, 1.0)) == [] and _jaxpr.primitive_kind(_top(jnp.sin, 1.0)) is None
    eqn = _top(lambda x: jax.lax.scan(lambda c, _: (c, None), x, None, length=2)[0], 1.0)
    with pytest.raises(_jaxpr.JaxInternalsError, match="num_consts"):
        _jaxpr.bodies(eqn.replace(params={k: v for k, v in eqn.params.items() if k not in ("num_consts", "ft_in")}))
    with pytest.raises(_jaxpr.JaxInternalsError, match="'length'"):
        _jaxpr.bodies(eqn.replace(params={k: v for k, v in eqn.params.items() if k != "length"}))



def test_the_control_flow_dispatch_is_one_table_every_walk_reads():
    """`KIND_RUNS` covers the catalogue's control-flow classes; `dispatch` hands a walk its handler;
    the engine, the evaluator and the op finder key their tables by it and test no kind by name."""
    import pathlib
    import re

    from jaxmp import _ops
    from jaxmp.diagnostics import _evaluate
    from jaxmp.engine import _control_flow

    assert set(_jaxpr.KIND_RUNS) == set(_ops.CONTROL_FLOW)
    assert _jaxpr.INLINE | _jaxpr.LOOPS | _jaxpr.BRANCHES | _jaxpr.MAPPED == _ops.CONTROL_FLOW
    assert _jaxpr.LOOPS == {"scan", "while"} and _jaxpr.BRANCHES == {"cond"}
    fns = _loops_and_branches()
    cond = _top(fns["cond"][0], *fns["cond"][1])
    assert _jaxpr.dispatch(cond, {"cond": len, "scan": abs}) == ("cond", len)
    assert _jaxpr.dispatch(cond, {"scan": abs}) is None  # a kind the walk does not enter
    assert _jaxpr.dispatch(_top(jnp.sin, 1.0), {"cond": len}) is None  # first order
    assert set(_control_flow.HANDLERS) == _ops.CONTROL_FLOW - {"pmap"}  # pmap runs as traced
    assert set(_evaluate._ENTER) == _jaxpr.INLINE | _jaxpr.LOOPS | _jaxpr.BRANCHES  # a mapped body is one op
    # No walk outside the reader tests a kind by its name: `kind == "while"`, `kind in ("scan", ...)`.
    kinds = "|".join(sorted(_ops.CONTROL_FLOW))
    by_name = re.compile(r"""(kind\(eqn\)|\bkind)\s*(==|!=|not in|in)\s*\(?\s*["'](%s)["']""" % kinds)
    root = pathlib.Path(_jaxpr.__file__).parent
    found = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p.name not in ("_jaxpr.py", "_ops.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if by_name.search(line)]
    assert not found, found
    assert by_name.search('if kind in ("scan", "while", "cond"):') and by_name.search('primitive_kind(eqn) == "scan"')


# -- per-element dependencies -------------------------------------------------------------


def _deps(fn, *args):
    return _jaxpr.per_element_inputs(jax.make_jaxpr(fn)(*args))


def test_per_element_inputs_follows_elementwise_ops_and_scalars():
    x, y, c = jnp.ones((3, 4)), jnp.ones((3, 4)), jnp.float32(2.0)
    # an elementwise formula of x, y and the scalar c (broadcast), through a jitted helper
    assert _deps(lambda x, y, c: jax.jit(lambda a, b: jnp.sqrt(a * c) / (b + 1e-8))(x, y), x, y, c) == [
        frozenset({0, 1, 2})]
    # ops on scalars alone are fine: a bias correction from a count
    assert _deps(lambda x, n: x / (1 - 0.9 ** n), x, jnp.int32(3).astype(jnp.float32)) == [frozenset({0, 1})]
    assert _deps(lambda x, y: (x, y * 2), x, y) == [frozenset({0}), frozenset({1})]


@pytest.mark.parametrize("fn", [
    lambda x, y: x * jnp.sum(y),              # a reduction (a global norm) feeds every element
    lambda x, y: x + y.T.reshape(3, 4),       # elements moved
    lambda x, y: x @ y.T @ x,                 # a matmul
    lambda x, y: x + jnp.arange(12.0).reshape(3, 4),   # an array that is not an input
])
def test_per_element_inputs_refuses_what_mixes_elements(fn):
    x = jnp.ones((3, 4))
    assert _deps(fn, x, x) == [None]
