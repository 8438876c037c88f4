"""Unit tests of jaxmp.diagnostics._find_ops: the matmul census and the risky-op rules on small
traced programs (what precision_report builds on; its report is tested in test_precision_report.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxmp import _jaxpr
from jaxmp.diagnostics import _find_ops as jw

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


def _walk(fn, *args, **kw):
    return jw.walk_jaxpr(jax.make_jaxpr(fn)(*args).jaxpr, **kw)


def _first(fn, *args, prim):
    return next(e.eqn for e in _jaxpr.walk(jax.make_jaxpr(fn)(*args)) if e.primitive == prim)


def test_a_matmul_is_described_with_its_gemm_and_flops():
    (op,), risky, unknown = _walk(lambda a, b: a @ b, np.ones((16, 32), BF16), np.ones((32, 8), BF16))
    assert (op.primitive, op.lhs_dtype, op.out_dtype, op.m, op.n, op.k) == ("dot_general", "bf16", "bf16", 16, 8, 32)
    assert op.flops == op.flops_per_call == 2 * 16 * 8 * 32 and op.calls == 1 and op.counted
    assert op.low_precision and op.tensor_core_eligible and not op.missed and op.shape_problems == ()
    assert risky == () and unknown == 0
    assert op.source.startswith(__file__) and op.source.endswith(".<lambda>)")


def test_float32_matmuls_are_missed_only_when_the_policy_computes_in_half():
    a, b = np.ones((8, 30), np.float32), np.ones((30, 8), np.float32)
    (plain,), _, _ = _walk(jnp.matmul, a, b)
    (half,), _, _ = _walk(jnp.matmul, a, b, compute_half=True)
    assert not plain.missed and half.missed and not half.low_precision
    assert half.shape_problems == ("K=30",)  # floating operands: the shape rule is checked
    (ok,), _, _ = _walk(jnp.matmul, a, b, tc_multiple=2)
    assert ok.shape_problems == ()
    (ints,), _, _ = _walk(jnp.matmul, np.ones((8, 30), jnp.int32), np.ones((30, 8), jnp.int32), compute_half=True)
    assert not ints.missed and ints.shape_problems == ()  # integer matmuls are not the policy's


def test_scan_multiplies_calls_cond_counts_its_costliest_branch_while_counts_once():
    w = np.ones((8, 8), BF16)

    def f(x, p):
        x = jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]
        x = jax.lax.cond(p, lambda v: v @ w @ w, lambda v: v @ w, x)
        return jax.lax.while_loop(lambda c: c[0, 0] < 100, lambda c: c @ w, x)

    ops, _, unknown = _walk(f, np.ones((8, 8), BF16), True)
    per = 2 * 8 ** 3
    scan, cheap, dear1, dear2, loop = ops  # program order
    assert "cond branch 0/2" in cheap.context and "cond branch 1/2" in dear1.context and dear1.context == dear2.context
    assert scan.calls == 5 and scan.flops == 5 * per and scan.context == "scan x5"
    # the cond's branches are ordered (false, true): branch 1 has two matmuls and is counted
    assert not cheap.counted and dear1.counted and dear2.counted
    assert unknown == 1 and loop.calls == 1 and loop.context.startswith("while (trip count unknown")


@pytest.mark.parametrize("fn, category", [
    (jnp.exp, "exp"),
    (lambda x: (lambda e: e / jax.lax.reduce_sum(e, (0,)))(jnp.exp(x)), "softmax"),
    (jnp.log, "log"),
    (jax.lax.rsqrt, "pow"),
    (lambda x: x ** 2, "pow"),
])
def test_classify_risk_categories(fn, category):
    x = np.ones((4,), F16)
    jaxpr = jax.make_jaxpr(fn)(x).jaxpr
    consumers = {}
    for e in _jaxpr.equations(jaxpr):
        for v in e.invars:
            if _jaxpr.is_var(v):
                consumers.setdefault(v, []).append(e)
    cat, why = jw.classify_risk(_jaxpr.equations(jaxpr)[0], consumers)
    assert cat == category and "f16" in why and "float32" in why
    # in float32 nothing is risky
    assert jw.classify_risk(_jaxpr.equations(jax.make_jaxpr(fn)(x.astype(F32)))[0]) is None


def test_an_exp_without_consumers_is_an_exp_not_a_softmax():
    eqn = _first(lambda x: jnp.exp(x) / jnp.exp(x).sum(), np.ones(4, BF16), prim="exp")
    cat, why = jw.classify_risk(eqn, None)
    assert cat == "exp" and "x~88" in why  # bf16's exp overflows past 88, fp16's past 11


def test_a_half_sum_is_risky_from_the_threshold_on():
    red = _first(lambda x: jax.lax.reduce_sum(x, (1,)), np.ones((2, 1024), BF16), prim="reduce_sum")
    cat, why = jw.classify_risk(red)
    assert cat == "reduction" and "over 1024 elements" in why
    assert jw.classify_risk(red, reduction_threshold=1025) is None
    cumsum = _first(lambda x: jnp.cumsum(x, axis=0), np.ones((8, 2), F16), prim="cumsum")
    assert jw.classify_risk(cumsum, reduction_threshold=8)[0] == "reduction"
    assert jw.classify_risk(cumsum, reduction_threshold=9) is None


def test_a_half_all_reduce_is_risky():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    f = jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    _, risky, _ = _walk(f, np.ones(4, BF16))
    assert [(r.category, r.dtype) for r in risky] == [("all-reduce", "bf16")]
    assert risky[0].context.startswith("shard_map")


def test_a_half_scalar_reduction_and_a_half_scalar_output_are_reported_once():
    _, risky, _ = _walk(lambda x: jnp.mean(x), np.ones((4, 4), F16))
    assert [(r.primitive, r.category, r.shape) for r in risky] == [("reduce_sum", "loss", (4, 4))]
    _, risky, _ = _walk(lambda x: x[0], np.ones(4, BF16))  # a scalar output not made by a reduction
    assert [(r.primitive, r.category) for r in risky] == [("output", "loss")] and "output #0" in risky[0].detail
    assert _walk(lambda x: jnp.mean(x.astype(F32)), np.ones((4, 4), F16))[1] == ()


def test_a_float32_input_narrowed_before_an_elementwise_op_names_its_ulp():
    def f(w, x):
        return x + w.astype(F16)

    w, x = np.full((4,), 1000.0, np.float32), np.ones((4,), F16)
    _, risky, _ = _walk(f, w, x, values=[np.asarray(w), np.asarray(x)])
    (r,) = risky
    assert r.category == "narrowed" and r.primitive == "add" and r.shape == (4,)
    assert "|x| up to 1000, where the f16 ulp is 0.5" in r.detail  # 2**(9 - 10)
    _, risky, _ = _walk(f, w, x)  # no values: the relative ulp
    assert "2**-10 of its magnitude" in risky[0].detail
    # a float32 value made inside the program (a norm's output) is not a narrowed input
    assert _walk(lambda w, x: x + jnp.tanh(w).astype(F16), w, x)[1] == ()


def test_source_of_names_this_file_and_function():
    def emit(x):
        return jnp.sin(x)

    src = jw.source_of(_first(emit, 1.0, prim="sin"))
    path, line, rest = src.split(":", 2)
    assert path == __file__ and int(line) > 0 and rest.endswith(".emit)")
