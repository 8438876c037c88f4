"""jaxmp/engine/_attention.py: jax.nn.dot_product_attention routed to half inputs inside autocast only."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxmp
from jaxmp.engine import _attention as attention
from jaxmp.engine._attention import routed_attention
from jaxmp._jaxpr import walk

Q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 2, 8)), jnp.float32)


def _reference(q, **kw):
    """Attention in float32 on the host: softmax(q k^T / sqrt(d)) v."""
    q = np.asarray(q, np.float64)
    logits = np.einsum("bqhd,bkhd->bhqk", q, q) / np.sqrt(q.shape[-1])
    if kw.get("is_causal"):
        logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), q)


def test_outside_autocast_the_routed_function_is_jaxs_own():
    out = routed_attention(Q, Q, Q)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, _reference(Q), rtol=1e-5, atol=1e-5)


def test_inside_autocast_the_inputs_go_to_half_and_xla_runs_on_cpu():
    attention.last_choice.clear()
    f = jaxmp.autocast(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True), "O1-bf16")
    out = jax.jit(f)(Q)
    assert attention.last_choice["implementation"] == "xla" and out.dtype == jnp.float32
    np.testing.assert_allclose(out, _reference(Q, is_causal=True), atol=0.05)
    dots = [e for e in walk(jax.make_jaxpr(f)(Q)) if e.primitive == "dot_general"]
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def test_an_explicit_implementation_is_kept_and_a_mask_array_reaches_the_backward_pass():
    mask = jnp.tril(jnp.ones((1, 2, 4, 4), bool))

    def loss(q, m):
        return jnp.sum(jax.nn.dot_product_attention(q, q, q, mask=m, implementation="xla").astype(jnp.float32))

    g = jax.jit(jax.grad(jaxmp.autocast(loss, "O1-bf16")))(Q, mask)
    assert attention.last_choice["implementation"] == "xla"
    assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g)))


def test_float16_on_cpu_computes_in_float32_and_hands_back_float16():
    f = jaxmp.autocast(lambda q: jax.nn.dot_product_attention(q, q, q), "O3-fp16")
    out = jax.jit(f)(Q)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(out, np.float32), _reference(Q), atol=5e-3)
