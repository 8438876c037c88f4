"""The seam to JAX's internals, adapter by adapter, against the installed JAX.

``jaxmp/engine/_internals.py`` (the engine's adapters: higher-order primitives' parameters, trace
state, config states) and ``jaxmp/_jaxpr.py`` (the one jaxpr reader under everything) are what a
JAX release can break. Each public name of both is exercised here on a real program, with an
assertion about what the engine relies on; `test_every_adapter_has_a_test` fails when a name is
added without one. .ci/run runs this file under every JAX of the CI matrix (engine/_tested.py).
"""

from __future__ import annotations

import inspect
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmp import _jaxpr
from jaxmp.engine import _internals as internals


def _eqn(fn, *args, primitive=None):
    """The first equation of ``fn``'s jaxpr (of ``primitive`` when given)."""
    eqns = _jaxpr.equations(jax.make_jaxpr(fn)(*args))
    return next(e for e in eqns if primitive is None or e.primitive.name == primitive)


def _scan(w, c):
    return jax.lax.scan(lambda carry, _: ((carry[0] * w, carry[1] + 1.0), None), (c, c), None, length=3)[0]


def _while(limit, x):
    return jax.lax.while_loop(lambda v: v < limit, lambda v: v * 2.0, x)


@jax.custom_jvp
def _cj(x):
    return jnp.sin(x)


@_cj.defjvp
def _cj_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), jnp.cos(x) * t


@jax.custom_vjp
def _cv(x, y):
    return jnp.sin(x) * y


def _cv_fwd(x, y):
    return jnp.sin(x) * y, (jnp.cos(x) * y,)


def _cv_bwd(res, ct):
    return res[0] * ct, None  # None: a symbolic zero cotangent for y


_cv.defvjp(_cv_fwd, _cv_bwd)


_SEEN: list = []  # what the symbolic-zeros rules below were told, recorded while tracing


@jax.custom_jvp
def _cj_sz(x, y):
    return jnp.sin(x) * y


def _cj_sz_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    _SEEN.append(("jvp", type(tx) is jax.custom_derivatives.SymbolicZero,
                  type(ty) is jax.custom_derivatives.SymbolicZero))
    return _cj_sz(x, y), jnp.cos(x) * y * tx  # tx is given here: the test's flags say so


_cj_sz.defjvp(_cj_sz_jvp, symbolic_zeros=True)


@jax.custom_vjp
def _cv_sz(x, y):
    return jnp.sin(x) * y


def _cv_sz_fwd(x, y):
    _SEEN.append(("fwd", x.perturbed, y.perturbed))
    return jnp.sin(x.value) * y.value, (jnp.cos(x.value) * y.value,)


_cv_sz.defvjp(_cv_sz_fwd, lambda res, ct: (res[0] * ct, None), symbolic_zeros=True)


# -- engine/_internals.py --------------------------------------------------------------------

def test_jax_version_is_the_installed_one():
    assert internals.JAX_VERSION[:2] == tuple(int(p) for p in jax.__version__.split(".")[:2])


def test_param_reads_a_parameter_and_names_a_missing_one():
    eqn = _eqn(_scan, 2.0, 1.0, primitive="scan")
    assert internals.param(eqn, "length") == 3
    fake = eqn.replace(params={})
    with pytest.raises(internals.JaxInternalsError, match=rf"'length'.*jax {jax.__version__}"):
        internals.param(fake, "length")


def test_jit_key_state_is_part_of_jits_cache_key():
    state = internals.jit_key_state(f"jaxmp_test_{uuid.uuid4().hex}", None, "test state")
    f = jax.jit(lambda x: x + (0.0 if state.value is None else float(state.value)))
    assert float(f(1.0)) == 1.0
    with state(2):
        assert state.value == 2
        assert float(f(1.0)) == 3.0  # retraced under the new value, not the cached trace
    assert state.value is None and float(f(1.0)) == 1.0
    flag = internals.jit_key_state(f"jaxmp_test_{uuid.uuid4().hex}", False, "test flag", kind="bool")
    with flag(True):
        assert flag.value is True


def test_params_key_compares_by_type_and_value():
    assert internals.params_key({"b": 1, "a": 2.0}) == (("a", float, 2.0), ("b", int, 1))
    assert internals.params_key({"a": 1}) != internals.params_key({"a": 1.0})
    hash(internals.params_key(_eqn(jnp.sin, 1.0).params))


def test_bind_rebinds_an_equation_plain_staged_and_with_a_sub_jaxpr():
    x = jnp.arange(3.0)
    sin = _eqn(jnp.sin, x)
    np.testing.assert_allclose(internals.bind(sin, [x], sin.params)[0], np.sin(np.arange(3.0)), rtol=1e-6)
    grads = jax.grad(lambda v: internals.bind(sin, [v], sin.params, staged=True)[0].sum())(x)
    np.testing.assert_allclose(grads, np.cos(np.arange(3.0)), rtol=1e-6)
    call = _eqn(jax.jit(jnp.cos), x)
    assert _jaxpr.sub_jaxprs(call)  # get_bind_params turns the body into what bind takes
    np.testing.assert_allclose(internals.bind(call, [x], call.params)[0], np.cos(np.arange(3.0)), rtol=1e-6)


def test_staged_cast_casts_and_is_cached():
    cast = internals.staged_cast(np.dtype(jnp.bfloat16))
    assert cast is internals.staged_cast(np.dtype(jnp.bfloat16))
    assert cast(jnp.ones(2)).dtype == jnp.bfloat16


def test_primitive_kind_of_every_construct():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    smap = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    cases = {
        "call": (jax.jit(jnp.sin), (1.0,)),
        "remat": (jax.checkpoint(jnp.sin), (1.0,)),
        "scan": (_scan, (2.0, 1.0)),
        "while": (_while, (8.0, 1.0)),
        "cond": (lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x), (True, 1.0)),
        "custom_jvp": (_cj, (1.0,)),
        "custom_vjp": (_cv, (1.0, 2.0)),
        "shard_map": (smap, (jnp.ones(4),)),
    }
    for kind, (fn, args) in cases.items():
        kinds = [internals.primitive_kind(e) for e in _jaxpr.equations(jax.make_jaxpr(fn)(*args))]
        assert kind in kinds, (kind, kinds)
    assert internals.primitive_kind(_eqn(jnp.sin, 1.0)) is None
    assert _eqn(jax.jit(jnp.sin), 1.0).primitive.name in internals.CALL_NAMES
    assert _eqn(jax.checkpoint(jnp.sin), 1.0).primitive.name in internals.REMAT_NAMES
    assert "pallas_call" in internals.OPAQUE_NAMES


def test_call_jaxpr_gives_the_body_and_its_consts():
    jaxpr, consts = internals.call_jaxpr(_eqn(jax.jit(jnp.sin), 1.0))
    assert [e.primitive.name for e in _jaxpr.equations(jaxpr)] == ["sin"] and consts == []
    with pytest.raises(internals.JaxInternalsError, match="jaxpr"):
        internals.call_jaxpr(_eqn(jnp.sin, 1.0))


def test_jit_wrapper_keeps_shardings_and_inlines_a_plain_jit():
    assert internals.jit_wrapper(_eqn(jax.jit(jnp.sin), 1.0), jnp.sin) is None
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("x",)), P("x"))
    eqn = _eqn(jax.jit(jnp.sin, out_shardings=sharding), jnp.ones(4))
    wrapped = internals.jit_wrapper(eqn, lambda x: [jnp.sin(x)])
    assert wrapped is not None
    (out,) = wrapped(jnp.ones(4))
    np.testing.assert_allclose(out, np.sin(np.ones(4)), rtol=1e-6)
    assert out.sharding.is_equivalent_to(sharding, 1)


def test_scan_counts_and_while_parts():
    assert internals.scan_counts(_eqn(_scan, 2.0, 1.0, primitive="scan")) == (1, 2)  # w; two carries
    cond, body, cn, bn = internals.while_parts(_eqn(_while, 8.0, 1.0, primitive="while"))
    assert (cn, bn) == (1, 0)  # the limit is the cond's one const
    assert [e.primitive.name for e in _jaxpr.equations(cond)] == ["lt"]
    assert [e.primitive.name for e in _jaxpr.equations(body)] == ["mul"]


def test_custom_jvp_parts_and_rule():
    eqn = _eqn(_cj, 1.0)
    closed, nconsts, jvp_fun = internals.custom_jvp_parts(eqn)
    assert nconsts == 0 and [e.primitive.name for e in _jaxpr.equations(closed)] == ["sin"]
    assert internals.custom_symbolic_zeros(eqn) is False
    jaxpr, consts, out_zeros = internals.custom_jvp_rule(jvp_fun, [False])
    assert list(out_zeros) == [False]
    primal, tangent = jax.core.eval_jaxpr(jaxpr, consts, 0.5, 2.0)
    np.testing.assert_allclose([primal, tangent], [np.sin(0.5), np.cos(0.5) * 2.0], rtol=1e-6)


def test_custom_jvp_rule_is_told_which_tangents_are_symbolic_zeros():
    eqn = _eqn(_cj_sz, 1.0, 2.0)
    assert internals.custom_symbolic_zeros(eqn) is True
    _, _, jvp_fun = internals.custom_jvp_parts(eqn)
    _SEEN.clear()
    jaxpr, consts, out_zeros = internals.custom_jvp_rule(jvp_fun, [False, True])
    assert _SEEN == [("jvp", False, True)] and list(out_zeros) == [False]
    # the rule's jaxpr takes the primals and the one non-zero tangent
    primal, tangent = jax.core.eval_jaxpr(jaxpr, consts, 0.5, 2.0, 3.0)
    np.testing.assert_allclose([primal, tangent], [np.sin(0.5) * 2.0, np.cos(0.5) * 2.0 * 3.0], rtol=1e-6)


def test_custom_vjp_parts_fwd_and_bwd():
    closed, nconsts, fwd_thunk, bwd, out_trees = internals.custom_vjp_parts(_eqn(_cv, 1.0, 2.0))
    assert nconsts == 0 and "sin" in [e.primitive.name for e in _jaxpr.equations(closed)]
    fwd_jaxpr, fwd_consts, res_tree, input_fwds = internals.custom_vjp_fwd(fwd_thunk, out_trees, [True, True])
    xs = (0.5, 2.0)
    outs = jax.core.eval_jaxpr(fwd_jaxpr, fwd_consts, *xs)
    num_res = res_tree.num_leaves - sum(f is not None for f in input_fwds)
    np.testing.assert_allclose(outs[num_res:], [np.sin(0.5) * 2.0], rtol=1e-6)
    res_out = iter(outs[:num_res])
    res = [next(res_out) if f is None else xs[f] for f in input_fwds]
    cts = internals.custom_vjp_bwd_cotangents(bwd.call_wrapped(*res, 3.0))
    assert len(cts) == 2
    np.testing.assert_allclose(cts[0], np.cos(0.5) * 2.0 * 3.0, rtol=1e-6)
    assert not isinstance(cts[1], (jax.Array, np.ndarray, float))  # bwd's None: a symbolic zero
    zero = internals.instantiate_zero(cts[1])
    assert zero.shape == () and float(zero) == 0.0
    assert internals.is_zero(cts[1]) and not internals.is_zero(cts[0])
    x = jnp.ones(2)
    assert internals.instantiate_zero(x) is x
    assert internals.custom_vjp_bwd_cotangents(([x], None)) == [x]  # jax 0.11 pairs them with logs
    assert internals.custom_vjp_bwd_cotangents([x, x]) == [x, x]


def test_custom_vjp_fwd_passes_the_perturbation_flags():
    eqn = _eqn(_cv_sz, 1.0, 2.0)
    assert internals.custom_symbolic_zeros(eqn) is True
    _, _, fwd_thunk, _, out_trees = internals.custom_vjp_parts(eqn)
    _SEEN.clear()
    fwd_jaxpr, fwd_consts, res_tree, _ = internals.custom_vjp_fwd(fwd_thunk, out_trees, [True, False])
    assert _SEEN == [("fwd", True, False)] and res_tree.num_leaves == 1
    res, out = jax.core.eval_jaxpr(fwd_jaxpr, fwd_consts, 0.5, 2.0)
    np.testing.assert_allclose([res, out], [np.cos(0.5) * 2.0, np.sin(0.5) * 2.0], rtol=1e-6)


_SHIFT = np.linspace(0.0, 1.0, 3, dtype=np.float32)  # an array constant: a constvar of the rules' jaxprs


@jax.custom_vjp
def _cv_const(x):
    return jnp.sin(x + _SHIFT)


_cv_const.defvjp(lambda x: (jnp.sin(x + _SHIFT), jnp.cos(x + _SHIFT)), lambda res, ct: (res * ct,))


@jax.custom_jvp
def _cj_const(x):
    return jnp.sin(x + _SHIFT)


_cj_const.defjvp(lambda p, t: (_cj_const(p[0]), jnp.cos(p[0] + _SHIFT) * t[0]))


def test_rule_jaxprs_name_their_constants_as_constvars():
    """jax 0.11+ returns a traced rule's constants as leading plain inputs with the values beside;
    the adapters hand the engine a jaxpr whose constvars are bound to the consts, on every JAX."""
    x = np.full(3, 0.5, np.float32)
    _, _, fwd_thunk, _, out_trees = internals.custom_vjp_parts(_eqn(_cv_const, x))
    fwd_jaxpr, consts, _, _ = internals.custom_vjp_fwd(fwd_thunk, out_trees, [True])
    assert consts and len(fwd_jaxpr.constvars) == len(consts) and len(fwd_jaxpr.invars) == 1
    res, out = jax.core.eval_jaxpr(fwd_jaxpr, consts, x)
    np.testing.assert_allclose([res, out], [np.cos(x + _SHIFT), np.sin(x + _SHIFT)], rtol=1e-6)
    _, _, jvp_fun = internals.custom_jvp_parts(_eqn(_cj_const, x))
    jaxpr, consts, _ = internals.custom_jvp_rule(jvp_fun, [False])
    assert consts and len(jaxpr.constvars) == len(consts) and len(jaxpr.invars) == 2
    _, tangent = jax.core.eval_jaxpr(jaxpr, consts, x, 2 * x)
    np.testing.assert_allclose(tangent, np.cos(x + _SHIFT) * 2 * x, rtol=1e-6)


def test_symbolic_zeros_made_recognised_and_instantiated():
    x = jnp.ones((2, 3), jnp.bfloat16)
    z = internals.symbolic_zero(x)
    assert type(z) is jax.custom_derivatives.SymbolicZero and internals.is_zero(z) and not internals.is_zero(x)
    assert (z.aval.shape, z.aval.dtype) == ((2, 3), jnp.bfloat16)
    assert internals.symbolic_zero_of(z.aval).aval == z.aval
    zeros = internals.instantiate_zero(z)
    assert zeros.dtype == jnp.bfloat16 and not np.any(np.asarray(zeros, np.float32))
    # an integer value's tangent type is float0, which only a NumPy array holds
    i0 = internals.instantiate_zero(internals.symbolic_zero(jnp.arange(3)))
    assert i0.dtype == jax.dtypes.float0 and i0.shape == (3,)


def test_closed_over_perturbed_is_jaxs_own_error():
    err = internals.closed_over_perturbed()
    assert isinstance(err, Exception) and "closed-over value" in str(err)


def test_shard_map_parts_rebuild_the_same_shard_map():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    smap = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    parts = internals.shard_map_parts(_eqn(smap, jnp.arange(4.0), primitive="shard_map"))
    assert parts["axis_names"] == {"x"} and parts["mesh"] == mesh
    body = parts.pop("jaxpr")
    rebuilt = jax.shard_map(lambda *xs: jax.core.eval_jaxpr(body, [], *xs), **parts)
    np.testing.assert_array_equal(np.asarray(rebuilt(jnp.arange(4.0))[0]), np.arange(4.0) * 2)


def test_tracer_and_trace_state():
    x = jnp.ones(2)
    assert not internals.is_tracer(x) and internals.trace_of([x]) is None
    assert not internals.staging() and not internals.transformed([x])
    seen = {}

    def probe(name):
        def f(v):
            seen[name] = (internals.is_tracer(v), internals.staging(), internals.transformed([v]),
                          internals.trace_of([x, v]) is not None)
            return v.sum()
        return f

    jax.jit(probe("jit"))(x)
    jax.grad(probe("grad"))(x)
    jax.vmap(probe("vmap"))(jnp.ones((2, 2)))
    assert seen["jit"] == (True, True, False, True)  # staging, not a transformation
    assert seen["grad"] == (True, False, True, True)  # an eager grad transforms, stages nothing
    assert seen["vmap"][2] and seen["vmap"][0]


def test_typeof_gives_shape_dtype_and_weak_type():
    aval = internals.typeof(jnp.ones((2, 3), jnp.bfloat16))
    assert aval.shape == (2, 3) and aval.dtype == jnp.bfloat16
    assert internals.typeof(1.0).weak_type


def test_all_primitive_names_lists_this_jaxs_primitives():
    names = internals.all_primitive_names()
    assert {"sin", "dot_general", "scan", "while", "cond", "convert_element_type"} <= names
    assert _eqn(jax.checkpoint(jnp.sin), 1.0).primitive.name in names


def test_the_engine_reads_jaxprs_through_the_reader():
    # The engine's names for the reader's functions are the reader's (one implementation).
    for name in ("equation_context", "equations", "is_literal", "open_jaxpr", "scope_names", "sub_jaxprs", "Literal"):
        assert getattr(internals, name) is getattr(_jaxpr, name), name


# -- jaxmp/_jaxpr.py ------------------------------------------------------------------------

def _scoped_grad(x):
    def loss(v):
        with jax.named_scope("head"):
            return jnp.sum(jax.jit(jnp.sin)(v) * 2.0)

    return jax.grad(loss)(x)


def test_equations_open_jaxpr_and_type_checks():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0)(1.0)
    assert _jaxpr.is_jaxpr(closed) and _jaxpr.is_jaxpr(closed.jaxpr) and not _jaxpr.is_jaxpr(1.0)
    assert isinstance(closed, _jaxpr.ClosedJaxpr) and isinstance(_jaxpr.open_jaxpr(closed), _jaxpr.Jaxpr)
    assert _jaxpr.open_jaxpr(closed.jaxpr) is closed.jaxpr
    assert [e.primitive.name for e in _jaxpr.equations(closed)] == ["sin", "mul"]
    with pytest.raises(TypeError, match="Jaxpr or ClosedJaxpr"):
        _jaxpr.open_jaxpr("not a jaxpr")
    mul = _jaxpr.equations(closed)[1]
    assert _jaxpr.is_var(mul.invars[0]) and not _jaxpr.is_literal(mul.invars[0])
    assert _jaxpr.is_literal(mul.invars[1]) and not _jaxpr.is_var(mul.invars[1])
    assert isinstance(mul.invars[1], _jaxpr.Literal) and isinstance(mul.invars[0], _jaxpr.Var)


def test_sub_jaxprs_of_a_cond_are_its_branches():
    eqn = _eqn(lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x), True, 1.0, primitive="cond")
    found = _jaxpr.sub_jaxprs(eqn)
    assert len(found) == 2 and all(isinstance(j, _jaxpr.ClosedJaxpr) for j in found)
    opened = _jaxpr.sub_jaxprs(eqn, opened=True)
    assert all(isinstance(j, _jaxpr.Jaxpr) for j in opened)
    assert sorted(e.primitive.name for j in opened for e in _jaxpr.equations(j)) == ["cos", "sin"]
    assert _jaxpr.sub_jaxprs(_eqn(jnp.sin, 1.0)) == []


def test_name_stacks_are_read_as_data_through_transformations():
    eqns = list(_jaxpr.walk(jax.make_jaxpr(_scoped_grad)(jnp.ones(3))))
    backward = [e for e in eqns if "transpose" in e.transforms]
    assert backward, [e.stack for e in eqns]
    for e in eqns:
        if e.primitive in ("sin", "cos"):
            assert e.scopes == ("head",), e.stack  # JAX prints them as jvp(head), transpose(jvp(head))
    item = _jaxpr.stack_of(next(e.eqn for e in backward))
    assert all(isinstance(i, _jaxpr.StackItem) and i.kind in ("scope", "transform") for i in item)
    assert ("scope", "head") in item and "head" in _jaxpr.scope_names(next(e.eqn for e in backward))


def test_the_current_stack_is_the_scopes_being_traced():
    seen = []

    def f(x):
        with jax.named_scope("outer"), jax.named_scope("inner"):
            seen.append(_jaxpr.current_stack())
            return jnp.sin(x)

    jax.make_jaxpr(jax.grad(f))(1.0)
    assert [i.name for i in seen[0] if i.kind == "scope"] == ["outer", "inner"]
    assert _jaxpr.current_stack() == ()  # outside any trace


def test_render_prints_a_stack_as_jax_does():
    S, T = (lambda n: _jaxpr.StackItem("scope", n)), (lambda n: _jaxpr.StackItem("transform", n))
    assert _jaxpr.render((S("a"), T("transpose"), T("jvp"), S("b"), S("c"))) == "a/transpose(jvp(b))/c"
    assert _jaxpr.render((S("a"), T("jvp"))) == "a/jvp()"
    assert _jaxpr.render(()) == ""
    forward = next(e for e in _jaxpr.walk(jax.make_jaxpr(_scoped_grad)(jnp.ones(3))) if e.primitive == "sin")
    assert forward.name == "jvp(head)", forward.stack


def test_walk_enters_every_construct_with_the_enclosing_stack():
    def f(x):
        with jax.named_scope("outer"):
            y = jax.jit(jnp.sin)(x)
            y = jax.lax.scan(lambda c, _: (jnp.cos(c), None), y, None, length=2)[0]
            return jax.lax.cond(True, jnp.exp, jnp.log, y)

    eqns = list(_jaxpr.walk(jax.make_jaxpr(f)(1.0)))
    by_name = {e.primitive: e for e in eqns}
    assert {"sin", "cos", "exp", "log"} <= set(by_name)
    for name in ("sin", "cos", "exp", "log"):
        e = by_name[name]
        assert e.scopes[0] == "outer" and e.depth == 1 and e.parent is not None, (name, e.stack)
        assert e.in_avals[0].shape == () and e.out_avals[0].dtype == jnp.float32
        assert e.params is e.eqn.params and e.invars is e.eqn.invars and e.outvars is e.eqn.outvars
    assert by_name["cos"].parent.primitive == "scan" and by_name["jit"].depth == 0
    assert by_name["sin"].name.startswith("outer")
    assert [e.scopes for e in _jaxpr.walk(jax.make_jaxpr(jnp.sin)(1.0), (_jaxpr.StackItem("scope", "pre"),))] \
        == [("pre",)]


def test_source_line_points_at_this_file():
    eqn = _eqn(lambda x: jnp.sin(x), 1.0)
    assert __file__.rsplit("/", 1)[-1] in _jaxpr.source_line(eqn)
    frames = _jaxpr.user_frames(eqn)
    assert frames and frames[0].start_line > 0
    (e,) = list(_jaxpr.walk(jax.make_jaxpr(lambda x: jnp.sin(x))(1.0)))
    assert e.source == _jaxpr.source_line(e.eqn)


def test_bind_and_bind_primitive():
    x = jnp.arange(3.0)
    sin = _eqn(jnp.sin, x)
    np.testing.assert_allclose(_jaxpr.bind(sin, [x])[0], np.sin(np.arange(3.0)), rtol=1e-6)
    (out,) = _jaxpr.bind_primitive(sin.primitive, sin.params, x)
    np.testing.assert_allclose(out, np.sin(np.arange(3.0)), rtol=1e-6)
    scan = _eqn(_scan, 2.0, 1.0, primitive="scan")  # multiple results, a body to convert
    assert [float(o) for o in _jaxpr.bind(scan, [2.0, 1.0, 1.0])] == [8.0, 4.0]


def test_one_equation_program_reruns_one_op_on_its_distinct_inputs():
    closed = jax.make_jaxpr(lambda x, y: (x * x + y,))(jnp.float32(3.0), jnp.float32(1.0))
    mul = _jaxpr.equations(closed)[0]
    one, ins = _jaxpr.one_equation_program(mul)
    assert ins == [mul.invars[0]] and len(_jaxpr.equations(one)) == 1  # x * x reads x once
    assert float(jax.core.eval_jaxpr(one, [], jnp.float32(4.0))[0]) == 16.0


def test_equation_context_keeps_the_name_stack_on_rebinding():
    eqn = _eqn(_scoped_grad, jnp.ones(3), primitive="jit")

    def again(x):
        with _jaxpr.equation_context(eqn):
            return _jaxpr.bind(eqn, [x])

    rebound = _jaxpr.equations(jax.make_jaxpr(again)(jnp.ones(3)))[0]
    assert _jaxpr.scope_names(rebound) == _jaxpr.scope_names(eqn) == ("head",)


def test_primitive_objects_and_primitive_class():
    (sin_p,) = _jaxpr.primitive_objects("sin_p", "no_such_primitive_p")
    assert sin_p is _eqn(jnp.sin, 1.0).primitive
    p = _jaxpr.Primitive("jaxmp_test_identity")
    p.def_impl(lambda x: x)
    p.def_abstract_eval(lambda x: x)
    assert float(p.bind(jnp.float32(2.0))) == 2.0


def test_all_gather_invariant_gathers_every_shard_and_is_typed_the_same_on_every_device():
    """The wire's gather of a replicated leaf's sums: out_specs=P() (no data axis) accepts only a
    value typed invariant over the axis, which a plain all_gather is not."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

    def body(a):
        gathered = internals.all_gather_invariant(a, "x", tiled=True)
        assert gathered is not None, f"JAX {jax.__version__} has no all_gather_invariant: the wire falls back to a psum"
        return gathered

    out = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P())(jnp.arange(8.0))
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0))
    with pytest.raises(Exception, match="(?i)vary|varying|invariant|replicat"):
        jax.shard_map(lambda a: jax.lax.all_gather(a, "x", tiled=True), mesh=mesh, in_specs=P("x"),
                      out_specs=P())(jnp.arange(8.0))


# -- completeness ----------------------------------------------------------------------------

TESTED = {
    internals: {"JAX_VERSION", "JaxInternalsError", "param", "jit_key_state", "params_key", "bind", "staged_cast",
                "primitive_kind", "CALL_NAMES", "REMAT_NAMES", "OPAQUE_NAMES", "call_jaxpr", "jit_wrapper",
                "scan_counts", "while_parts", "custom_jvp_parts", "custom_jvp_rule", "custom_vjp_parts",
                "custom_vjp_fwd", "custom_vjp_bwd_cotangents", "instantiate_zero", "shard_map_parts", "is_tracer",
                "custom_symbolic_zeros", "is_zero", "symbolic_zero", "symbolic_zero_of", "closed_over_perturbed",
                "staging", "transformed", "trace_of", "typeof", "all_primitive_names",
                # the reader's, re-exported (tested below and in test_the_engine_reads_jaxprs_through_the_reader)
                "equation_context", "equations", "is_literal", "open_jaxpr", "scope_names", "sub_jaxprs", "Literal",
                "bodies", "dispatch", "LOOPS",
                # the quantized wire's gather of a replicated leaf (tested below)
                "all_gather_invariant"},
    _jaxpr: {"Jaxpr", "ClosedJaxpr", "Literal", "Var", "Primitive", "is_jaxpr", "open_jaxpr", "is_literal", "is_var",
             "equations", "sub_jaxprs", "primitive_objects", "StackItem", "stack_of", "current_stack", "scope_names",
             "render", "user_frames", "source_line", "Equation", "walk", "bind", "bind_primitive", "equation_context",
             "one_equation_program",
             # the control-flow dispatcher (re-exported by internals; tested in tests/core/test_jaxpr.py)
             "JaxInternalsError", "param", "primitive_kind", "call_jaxpr", "scan_counts", "while_parts", "Body",
             "bodies", "KIND_RUNS", "INLINE", "LOOPS", "BRANCHES", "MAPPED", "dispatch",
             # the lean slice loop's reader (tested in tests/core/test_jaxpr.py)
             "per_element_inputs"},
}


@pytest.mark.parametrize("module", list(TESTED), ids=lambda m: m.__name__)
def test_every_adapter_has_a_test(module):
    public = {n for n, v in vars(module).items()
              if not n.startswith("_") and not inspect.ismodule(v) and n not in ("annotations", "Any", "Callable",
                                                                                  "Iterator", "NamedTuple", "Sequence",
                                                                                  "Mapping", "TypeVar")}
    assert public == TESTED[module], (public - TESTED[module], TESTED[module] - public)
