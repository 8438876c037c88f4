"""Differential tests of jaxmp.autocast on random programs (hypothesis, derandomized).

Programs are drawn from a small grammar of ops on an activation ``h`` (matmuls, biases,
elementwise ops, softmax, padding masks, an accumulating loop) and optionally differentiated.
Each program is checked three ways:

* dtype properties on the autocast jaxpr: every matmul takes half operands, every
  transcendental and reduction runs in float32, every gradient w.r.t. a float32 input is float32;
* the numbers against an independent reference that applies the documented rules by hand
  (explicit casts per op, written from docs/autocast.md, not from the engine): equal within a
  few bfloat16 ulps;
* against plain float32 on the well-conditioned sub-grammar (no exp of unbounded values).

The default profile (20 programs) runs in the default tier; the ``slow`` test runs 200.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxmp
from tests._support._op_dtypes import op_dtypes

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
OPS = ("matmul", "bias", "tanh", "scale", "softmax", "mask", "relu", "accumulate", "square")
D = 8


def _apply(op, i, h, params, mask):
    if op == "matmul":
        return h @ params["w"][i]
    if op == "bias":
        return h + params["b"][i]
    if op == "tanh":
        return jnp.tanh(h)
    if op == "scale":
        return h * 0.5
    if op == "softmax":
        return jax.nn.softmax(h, axis=-1)
    if op == "mask":
        return jnp.where(mask, h, jnp.finfo(jnp.float32).min) * 0.0 + jnp.where(mask, h, 0.0)
    if op == "relu":
        return jax.nn.relu(h)
    if op == "accumulate":
        return jax.lax.fori_loop(0, 16, lambda _, a: a + jnp.tanh(h) * 0.125, jnp.zeros_like(h))
    if op == "square":
        return jnp.mean(h * h, axis=-1, keepdims=True) + h
    raise AssertionError(op)


def program(ops):
    def f(params, x, mask):
        h = x
        for i, op in enumerate(ops):
            h = _apply(op, i, h, params, mask)
        return jnp.mean(h)

    return f


# -- the independent reference: the documented rules, by hand --------------------------------

def reference(ops, params, x, mask, half=jnp.bfloat16):
    """O1 by hand, from docs/autocast.md: each op with explicit casts.

    In this grammar a float32 activation only ever meets float32 parameters and constants,
    so the promotion rule reduces to "a parameter or constant takes the activation's dtype".
    """
    h = x
    for i, op in enumerate(ops):
        if op == "matmul":      # half list
            h = h.astype(half) @ params["w"][i].astype(half)
        elif op == "bias":      # follows: the float32 bias is narrowed to the activation's dtype
            h = h + params["b"][i].astype(h.dtype)
        elif op == "tanh":
            h = jnp.tanh(h)
        elif op == "scale":     # a Python scalar is weak: never decides
            h = h * 0.5
        elif op == "relu":
            h = jax.nn.relu(h)
        elif op == "softmax":   # reductions and exp on the float32 list
            h = jax.nn.softmax(h.astype(jnp.float32), axis=-1)
        elif op == "mask":      # the finfo.min constant saturates to the half type's finite range
            lo = jnp.asarray(jnp.finfo(h.dtype).min, h.dtype)
            h = jnp.where(mask, h, lo) * jnp.asarray(0.0, h.dtype) + jnp.where(mask, h, jnp.zeros((), h.dtype))
        elif op == "accumulate":  # the float32 carry adds in float32; the term in h's dtype
            term = (jnp.tanh(h) * 0.125).astype(jnp.float32)
            acc = jnp.zeros(h.shape, jnp.float32)
            for _ in range(16):
                acc = acc + term
            h = acc
        elif op == "square":    # x * x on the float32 list; its float32 result promotes h
            h32 = h.astype(jnp.float32)
            h = jnp.mean(h32 * h32, axis=-1, keepdims=True) + h32
    return jnp.mean(h.astype(jnp.float32))


def _inputs(seed):
    # numpy draws, not eager jax.random: every new shape of an eager draw compiles threefry,
    # and the rules under test do not depend on where the numbers come from
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    params = {"w": [jnp.asarray(normal(D, D) / np.float32(np.sqrt(D))) for _ in range(10)],
              "b": [jnp.asarray(normal(D) * np.float32(0.1)) for _ in range(10)]}
    x = jnp.asarray(normal(4, D))
    mask = jnp.asarray(np.arange(D)[None, :] < np.array([[8], [5], [1], [3]]))
    return params, x, mask


@pytest.fixture(scope="module")
def inputs():
    """``_inputs`` by seed, drawn once per seed for this module's examples (hypothesis repeats seeds)."""
    return functools.cache(_inputs)


programs = st.lists(st.sampled_from(OPS), min_size=1, max_size=6)


def _check(inputs, ops, seed, differentiate):
    params, x, mask = inputs(seed)
    f = program(ops)
    ac = jaxmp.autocast(f, "O1-bf16")
    ops_seen = op_dtypes(jax.grad(ac) if differentiate else ac, params, x, mask)
    for op in ops_seen:
        if op.primitive == "dot_general":
            assert set(op.in_dtypes) == {BF16}, (ops, op)
        if op.primitive in ("exp", "log", "reduce_sum", "reduce_max") and not differentiate:
            floats = [d for d in op.in_dtypes if jnp.issubdtype(d, jnp.floating)]
            assert all(d == F32 for d in floats), (ops, op)
    if differentiate:
        # the gradients' dtypes are fixed when the program is traced: read them off the abstract
        # evaluation (running it compiles a forward and a backward program and adds no check)
        grads = jax.eval_shape(jax.grad(ac), params, x, mask)
        assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}
        return
    got = float(ac(params, x, mask))
    want = float(reference(ops, params, x, mask))
    scale = max(1.0, abs(want))
    # "a few ulps": bfloat16's ulp at 1 is 2**-7; XLA may fuse the two programs differently
    assert abs(got - want) <= 4 * 2.0 ** -8 * scale, (ops, got, want)
    if "square" not in ops:  # the well-conditioned sub-grammar: bounded ops only
        f32 = float(f(params, x, mask))
        assert np.isfinite(got) and abs(got - f32) <= 0.1 * max(1.0, abs(f32)) + 0.05, (ops, got, f32)


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ops=programs, seed=st.integers(0, 3), differentiate=st.booleans())
def test_random_programs_follow_the_documented_rules(inputs, ops, seed, differentiate):
    _check(inputs, ops, seed, differentiate)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=10), seed=st.integers(0, 100),
       differentiate=st.booleans())
def test_random_programs_follow_the_documented_rules_large(inputs, ops, seed, differentiate):
    _check(inputs, ops, seed, differentiate)
