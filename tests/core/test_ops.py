"""Unit tests of jaxmp._ops, the one catalogue of primitives every op list is read from."""

import pytest

import jaxmp
from jaxmp import _ops
from jaxmp.engine import FLOAT32_OPS, HALF_OPS


def test_every_row_has_a_known_class_and_known_facts():
    for name, op in _ops.TABLE.items():
        assert op.cls in _ops.CLASSES, name
        assert op.facts <= set(_ops.FACTS), (name, op.facts - set(_ops.FACTS))
    # every fact is read by someone: a fact no row has would be a list nobody can fill
    assert {f for op in _ops.TABLE.values() for f in op.facts} == set(_ops.FACTS)


def test_autocast_lists_are_the_catalogue_classes():
    assert HALF_OPS == _ops.of_class("half") and "dot_general" in HALF_OPS
    assert FLOAT32_OPS == _ops.of_class("float32") and {"exp", "reduce_sum", "rsqrt"} <= FLOAT32_OPS
    defaults = jaxmp.AutocastRules()
    assert defaults.half_ops == HALF_OPS and defaults.float32_ops == FLOAT32_OPS
    # the reductions are float32-list ops, every one
    assert _ops.having("reduction") <= FLOAT32_OPS


def test_control_flow_kinds_and_risk_families():
    assert _ops.control_flow_kind("scan") == "scan" and _ops.control_flow_kind("pjit") == "call"
    assert _ops.control_flow_kind("eval_jaxpr") == "call" and _ops.control_flow_kind("remat2") == "remat"
    assert _ops.control_flow_kind("exp") is None and _ops.control_flow_kind("no_such_op") is None
    assert _ops.of_class(*_ops.CONTROL_FLOW) == {n for n in _ops.TABLE if _ops.control_flow_kind(n)}
    assert [_ops.risk_family(n) for n in ("exp2", "log1p", "rsqrt", "cumsum", "add", "nope")] == [
        "exp", "log", "pow", "sum", None, None]


def test_unknown_class_or_fact_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown op class.*'halfs'"):
        _ops.of_class("halfs")
    with pytest.raises(ValueError, match="unknown op fact 'exactly'"):
        _ops.having("exactly")
