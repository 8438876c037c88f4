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
