"""jaxmp/diagnostics/_autocast_ops.py: reading back the rule each op of an explained autocast trace ran under."""

import jax
import jax.numpy as jnp

import jaxmp
from jaxmp.diagnostics._autocast_ops import AutocastOp, autocast_ops
from jaxmp.engine._build import explaining

X = jnp.ones((4, 4), jnp.float32)


def _explained(fn, *args):
    with explaining():
        return jax.make_jaxpr(fn)(*args)


def test_each_op_carries_its_rule_and_its_dtypes_in_short_form():
    ops = autocast_ops(_explained(jaxmp.autocast(lambda a: jnp.exp(a @ a), "O1-bf16"), X))
    dot, exp = [op for op in ops if op.primitive in ("dot_general", "exp")]
    assert isinstance(dot, AutocastOp) and dot.rule == "half list" and dot.in_dtypes == ("bf16", "bf16")
    assert exp.rule == "float32 list" and exp.out_dtypes == ("f32",)
    assert all("jaxmp.rule=" not in op.name for op in ops)  # the rule scope is taken out of the name


def test_a_closed_or_open_jaxpr_gives_the_same_ops():
    closed = _explained(jaxmp.autocast(lambda a: jnp.tanh(a @ a), "O1-fp16"), X)
    assert autocast_ops(closed) == autocast_ops(closed.jaxpr) and autocast_ops(closed)


def test_ops_inside_loops_and_nested_jits_are_found_with_the_outer_name():
    def f(a):
        def body(c, _):
            return jax.jit(lambda c: c @ a)(c), None
        with jax.named_scope("outer"):
            return jax.lax.scan(body, a, None, length=2)[0]

    ops = autocast_ops(_explained(jaxmp.autocast(f, "O1-bf16"), X))
    dots = [op for op in ops if op.primitive == "dot_general"]
    assert dots and all(op.rule == "half list" and "outer" in op.name for op in dots)


def test_a_trace_without_explain_mode_or_without_autocast_has_no_ops():
    assert autocast_ops(jax.make_jaxpr(jaxmp.autocast(lambda a: a @ a, "O1-bf16"))(X)) == ()
    assert autocast_ops(_explained(lambda a: jnp.exp(a @ a), X)) == ()
