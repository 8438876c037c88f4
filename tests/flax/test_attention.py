"""jaxmp/flax/_attention.py: float32_softmax_attention and fused_attention against a float64 reference."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmp.flax._attention import float32_softmax_attention, fused_attention

RNG = np.random.default_rng(0)
Q, K, V = (RNG.normal(size=(2, 4, 2, 8)).astype(np.float32) for _ in range(3))


def reference(q, k, v, bias=None, mask=None):
    """Softmax attention in float64 on the host."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("bqhd,bkhd->bhqk", q / np.sqrt(q.shape[-1]), k)
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = np.where(mask, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", w / w.sum(-1, keepdims=True), v)


def test_float32_inputs_match_the_float64_reference_with_bias_and_mask():
    bias = RNG.normal(size=(1, 2, 4, 4)).astype(np.float32)
    mask = RNG.random((2, 1, 4, 4)) > 0.3
    mask[..., 0] = True  # every query sees a key
    out = jax.jit(float32_softmax_attention)(Q, K, V, bias=bias, mask=mask)
    np.testing.assert_allclose(out, reference(Q, K, V, bias, mask), rtol=1e-5, atol=1e-5)


def test_is_causal_is_the_lower_triangular_mask_and_combines_with_a_mask():
    causal = np.tril(np.ones((4, 4), bool))
    pad = np.array([True, True, False, True])
    # Both calls in one compiled program (eagerly, every op compiles on its own).
    alone, padded = jax.jit(lambda q, k, v: (float32_softmax_attention(q, k, v, is_causal=True),
                                             float32_softmax_attention(q, k, v, mask=pad, is_causal=True)))(Q, K, V)
    np.testing.assert_allclose(alone, reference(Q, K, V, mask=causal), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(padded, reference(Q, K, V, mask=causal & pad), rtol=1e-5, atol=1e-5)


def test_half_inputs_whose_logits_overflow_float16_stay_finite():
    q = np.full((1, 2, 1, 64), 60.0, np.float16)  # q.k / sqrt(d) = 60 * 60 * 64 / 8 = 28800 per logit pair
    k = np.full((1, 2, 1, 64), 60.0, np.float16)
    k[0, 1] = 70.0  # logits 28800 vs 33600: beyond float16 after scaling would be inf - inf = nan
    v = np.arange(2 * 64, dtype=np.float16).reshape(1, 2, 1, 64)
    out = jax.jit(float32_softmax_attention)(q, k, v)
    assert out.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(v[:, 1:], np.float32)[:, [0, 0]], rtol=1e-3)


def test_dtype_sets_the_compute_and_output_dtype_and_the_weights_are_sown():
    class Attn(nn.Module):
        @nn.compact
        def __call__(self, q):
            return float32_softmax_attention(q, q, q, module=self)

    # Both in one compiled program (eagerly, every op compiles on its own).
    out, (_, state) = jax.jit(lambda q, k, v: (float32_softmax_attention(q, k, v, dtype=jnp.bfloat16),
                                               Attn().apply({}, q, mutable=["intermediates"])))(Q, K, V)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), reference(Q, K, V), atol=0.05)
    (weights,) = state["intermediates"]["attention_weights"]
    assert weights.shape == (2, 2, 4, 4) and np.allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)


def test_dropout_draws_a_mask_from_the_rng_and_is_off_when_deterministic():
    def f(rng, det):
        return float32_softmax_attention(Q, K, V, dropout_rate=0.5, dropout_rng=rng, deterministic=det)

    both = jax.jit(lambda rng: (f(rng, False), f(rng, True)))  # one program; called twice below
    key = jax.random.key(0)
    (a, off), (b, _) = both(key), both(key)
    assert np.array_equal(a, b) and not np.allclose(a, reference(Q, K, V), atol=1e-3)
    np.testing.assert_allclose(off, reference(Q, K, V), rtol=1e-5, atol=1e-5)


def test_dropout_without_an_rng_is_a_clear_error():
    with pytest.raises(ValueError, match="dropout_rng"):
        jax.eval_shape(lambda: float32_softmax_attention(Q, K, V, dropout_rate=0.1))  # refused at trace: nothing compiled


@pytest.mark.standard_promotion(reason="flax.linen.dot_product_attention, the non-fused path, promotes dtypes")
def test_fused_and_flax_paths_agree_with_the_reference():
    mask = np.ones((2, 1, 1, 4), bool)
    mask[0, ..., 3] = False
    want = reference(Q, K, V, mask=mask)
    bias = np.zeros((1, 1, 4, 4), np.float32)
    # Without and with a bias, in one compiled program.
    fused, flax_path = jax.jit(lambda q, k, v: (fused_attention(q, k, v, mask=mask),
                                                fused_attention(q, k, v, bias=bias, mask=mask)))(Q, K, V)
    np.testing.assert_allclose(fused, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(flax_path, want, rtol=1e-5, atol=1e-5)
    assert jax.eval_shape(lambda q: fused_attention(q, q, q, dtype=jnp.bfloat16), Q).dtype == jnp.bfloat16
