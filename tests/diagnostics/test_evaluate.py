"""The debugger's evaluator's sites (jaxmp/diagnostics/_evaluate.py): an op that reads a
parameter, in a module with no instance scope (NNX, Equinox), is named after that parameter
inside every construct the evaluator enters: the dispatcher (jaxmp._jaxpr.bodies) binds each
body's inputs to the operands they come from."""

import jax
import numpy as np
import pytest

from jaxmp.diagnostics._evaluate import Sites, leaf_paths

PARAMS = {"sched": {"kernel": np.ones((3, 3), np.float32)}}
X = np.ones((2, 3), np.float32)


def _scan(p, x):
    return jax.lax.scan(lambda c, _: (c @ p["sched"]["kernel"], None), x, None, length=2)[0]


def _while(p, x):
    return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] @ p["sched"]["kernel"]), (0, x))[1]


def _cond(p, x):
    return jax.lax.cond(x.sum() > 0, lambda y: y @ p["sched"]["kernel"], lambda y: -y, x)


@pytest.mark.parametrize("fn", [_scan, _while, _cond], ids=["scan", "while", "cond"])
def test_an_op_in_a_body_is_named_after_the_parameter_it_reads(fn):
    closed = jax.make_jaxpr(fn)(PARAMS, X)
    sites = Sites(closed.jaxpr, leaf_paths((PARAMS, X), {}))
    (dot,) = [s for s in sites.sites if s.primitive == "dot_general"]
    assert dot.path == "sched" and dot.from_param
    assert dot.context  # it sits inside the construct
    # the input that is no parameter names nothing
    assert not any(s.from_param for s in sites.sites if s.primitive == "neg")
