"""Unit tests of jaxmp.engine._control_flow's analyses: which loop carries are accumulators,
which inputs are weights, and the handler table. The handlers themselves run under autocast in
tests/engine/test_contract.py and test_autocast.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp import _jaxpr
from jaxmp.engine import _control_flow as cf
from jaxmp.engine import _internals

HALF = frozenset({"dot_general", "conv_general_dilated"})


def _scan_body(body, carry, xs):
    """The open body jaxpr of ``lax.scan(body, carry, xs)`` and its carry count."""
    eqn = next(e for e in _jaxpr.walk(jax.make_jaxpr(lambda c, x: jax.lax.scan(body, c, x))(carry, xs))
               if e.primitive == "scan")
    # scan's params changed across JAX releases (num_consts/num_carry, then ft_in): the seam reads them
    return (eqn.params["jaxpr"].jaxpr, *_internals.scan_counts(eqn))


def _acc(body, carry, xs=None):
    xs = jnp.ones((3, 4)) if xs is None else xs
    jaxpr, nc, ncarry = _scan_body(body, carry, xs)
    return cf.accumulators(jaxpr, range(nc, nc + ncarry), range(ncarry))


@pytest.mark.parametrize("body, want", [
    (lambda a, x: (a + x, None), [True]),
    (lambda a, x: (a - 0.5 * x, None), [True]),
    (lambda a, x: (jnp.where(x > 0, a + x, a), None), [True]),       # a masked sum: the predicate is not the carry
    (lambda a, x: (jnp.where(a > 0, a + x, a), None), [False]),      # ... it is: the carry is read, not summed
    (lambda a, x: (a * x, None), [False]),                          # scaled, never added
    (lambda a, x: (a + x, a), [False]),                             # also an output of its own
    (lambda a, x: (a + x, jnp.sin(a)), [False]),                    # read by something else
    (lambda a, x: (jnp.tanh(a + x), None), [False]),                # the sum goes through a non-add op
])
def test_accumulators_of_a_single_carry(body, want):
    assert _acc(body, jnp.zeros(4)) == want


def test_accumulators_per_carry_and_non_float_carries():
    def body(c, x):
        i, a, b = c
        return (i + 1, a + x, b * 2.0), None

    assert _acc(body, (0, jnp.zeros(4), jnp.ones(4))) == [False, True, False]  # an int counter is not one


def test_accumulators_refuse_a_chain_that_ends_in_two_outputs():
    def body(c, x):
        a, b = c
        s = a + x
        return (s, s), None

    assert _acc(body, (jnp.zeros(4), jnp.zeros(4))) == [False, False]


def _weights(fn, *args, runs_in_half=None):
    return cf.weight_inputs(jax.make_jaxpr(fn)(*args).jaxpr, HALF, runs_in_half)


def test_weight_inputs_are_those_every_use_of_which_is_a_half_op():
    w, b, x = jnp.ones((4, 4)), jnp.zeros(4), jnp.ones((2, 4))
    assert _weights(lambda w, b, x: x @ w.T.reshape(4, 4) + b, w, b, x) == [True, False, True]
    assert _weights(lambda w, b, x: x @ w + jnp.sum(w) + b, w, b, x) == [False, False, True]  # also read elsewhere
    assert _weights(lambda w, b, x: (x @ w, w), w, b, x) == [False, False, True]  # returned as it is
    assert _weights(lambda w, b, x: x @ w, w, b, x) == [True, False, True]  # b unused: no half use, not a weight


def test_weight_inputs_follow_nested_jits_scans_and_conds():
    w, x = jnp.ones((4, 4)), jnp.ones((3, 2, 4))
    assert _weights(lambda w, x: jax.jit(lambda w, x: x @ w)(w, x), w, x) == [True, True]
    scanned = lambda w, x: jax.lax.scan(lambda h, xi: (h + xi @ w, None), jnp.zeros((2, 4)), x)[0]  # noqa: E731
    assert _weights(scanned, w, x) == [True, True]  # w: a scan constant used by the matmul
    carried = lambda w, x: jax.lax.scan(lambda h, xi: (h @ w, None), x[0], x)[0]  # noqa: E731
    assert _weights(carried, w, x) == [True, False]  # x[0] is the carry (not a weight); xs unused
    cond = lambda p, w, x: jax.lax.cond(p, lambda w, x: x @ w, lambda w, x: x @ w.T, w, x)  # noqa: E731
    assert _weights(cond, True, w, x[0]) == [False, True, True]
    half_only_in_one = lambda p, w, x: jax.lax.cond(p, lambda w, x: x @ w, lambda w, x: x + w[0], w, x)  # noqa: E731
    assert _weights(half_only_in_one, True, w, x[0]) == [False, False, False]  # both read by an add in one branch


def test_weight_inputs_ask_whether_the_scope_runs_in_half():
    def f(w1, w2, x):
        with jax.named_scope("head"):
            y = x @ w2
        return x @ w1 + y

    args = jnp.ones((4, 4)), jnp.ones((4, 4)), jnp.ones((2, 4))
    seen = []

    def runs_in_half(comps):
        seen.append(comps)
        return "head" not in comps

    # x is used in both scopes: one use in float32 makes it no weight
    assert _weights(f, *args, runs_in_half=runs_in_half) == [True, False, False]
    assert ("head",) in seen and () in seen


def test_handler_for_maps_each_construct_and_none_for_first_order():
    def eqn(fn, *args, prim):
        return next(e.eqn for e in _jaxpr.walk(jax.make_jaxpr(fn)(*args)) if e.primitive in prim)

    assert cf.handler_for(eqn(jnp.sin, 1.0, prim=("sin",))) is None
    assert cf.handler_for(eqn(lambda x: jax.lax.scan(lambda c, _: (c, None), x, None, length=2)[0], 1.0,
                              prim=("scan",))) is cf._scan
    assert cf.handler_for(eqn(jax.jit(jnp.sin), 1.0, prim=("jit", "pjit"))) is cf._call
    assert cf.handler_for(eqn(jax.checkpoint(jnp.sin), 1.0, prim=("checkpoint", "remat", "remat2"))) is cf._remat
    assert set(cf.HANDLERS) == {"call", "remat", "scan", "while", "cond", "custom_jvp", "custom_vjp", "shard_map"}


def test_cast_touches_only_floats_of_another_dtype():
    x = jnp.ones(2)
    assert cf._cast(x, None) is x and cf._cast(x, jnp.float32) is x
    assert cf._cast(x, jnp.bfloat16).dtype == jnp.bfloat16
    i = jnp.ones(2, jnp.int32)
    assert cf._cast(i, jnp.float32) is i and cf._cast(x, jnp.int32) is x  # never to or from an integer


def test_strong_out_needs_a_wide_float_and_one_strong_flag():
    strong, plain = (True, False, False), (False, False, False)
    assert cf._strong_out(jnp.ones(2), [plain, strong])
    assert not cf._strong_out(jnp.ones(2), [plain, plain])
    assert not cf._strong_out(jnp.ones(2, jnp.bfloat16), [strong])
    assert not cf._strong_out(jnp.ones(2, jnp.int32), [strong])
    assert not cf._strong_out(np.float32(1.0), [])
