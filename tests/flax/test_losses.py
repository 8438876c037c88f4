"""jaxmp/flax/_losses.py: the train steps' float32 cross-entropy, accuracy and batch unpacking."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmp.flax._losses import accuracy, softmax_cross_entropy, split_batch

# numpy data, and each test's calls jitted together: eagerly, every op compiles on its own.
LOGITS = np.array([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 5.0], [4.0, 0.0, 0.0]], np.float32)
LABELS = np.array([0, 1, 0, 0], np.int32)


def test_cross_entropy_is_optaxs_mean_in_float32_for_integer_and_one_hot_labels():
    @jax.jit
    def run(logits, labels):
        ref = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        outs = [softmax_cross_entropy(lg, labels) for lg in (logits, logits.astype(jnp.float16),
                                                               logits.astype(jnp.bfloat16))]
        return ref, outs, softmax_cross_entropy(logits, jax.nn.one_hot(labels, 3, dtype=jnp.bfloat16))

    ref, outs, from_one_hot = run(LOGITS, LABELS)
    for out in outs:
        assert out.dtype == jnp.float32 and out.shape == ()
        np.testing.assert_allclose(out, ref, rtol=1e-2)
    np.testing.assert_allclose(from_one_hot, ref, rtol=1e-6)


def test_cross_entropy_in_float32_does_not_overflow_where_float16_would():
    big = np.array([[60000.0, -60000.0]], np.float16)
    assert np.isfinite(float(jax.jit(softmax_cross_entropy)(big, np.array([1], np.int32))))


def test_cross_entropy_refuses_labels_of_the_wrong_shape():
    with pytest.raises(ValueError, match=r"integer labels must have shape \(4,\), got \(4, 1\)"):
        softmax_cross_entropy(LOGITS, LABELS[:, None])
    with pytest.raises(ValueError, match=r"one-hot labels must have the logits' shape \(4, 3\), got \(4, 2\)"):
        softmax_cross_entropy(LOGITS, np.ones((4, 2), np.float32))


def test_accuracy_for_integer_and_one_hot_labels():
    from_int, from_one_hot, from_bf16 = jax.jit(lambda lg, lb: (
        accuracy(lg, lb), accuracy(lg, jax.nn.one_hot(lb, 3)), accuracy(lg.astype(jnp.bfloat16), lb)))(LOGITS, LABELS)
    assert float(from_int) == 0.75
    assert float(from_one_hot) == 0.75
    assert from_bf16.dtype == jnp.float32


def test_accuracy_refuses_labels_that_would_broadcast_into_a_wrong_value():
    # [batch, 1] labels (a common dataset layout) would broadcast against the [batch] predictions
    # into a [batch, batch] comparison: a plausible, wrong accuracy.
    with pytest.raises(ValueError, match=r"integer labels must have shape \(4,\), got \(4, 1\) \(squeeze the last "):
        accuracy(LOGITS, LABELS[:, None])
    with pytest.raises(ValueError, match=r"integer labels must have shape \(4,\), got \(2,\)$"):
        accuracy(LOGITS, LABELS[:2])


def test_split_batch_reads_pairs_and_the_usual_dict_keys():
    assert split_batch(("x", "y")) == ("x", "y") and split_batch(["x", "y"]) == ("x", "y")
    assert split_batch({"image": 1, "label": 2}) == (1, 2)
    assert split_batch({"inputs": 1, "labels": 2, "extra": 3}) == (1, 2)
    assert split_batch({"x": 1, "y": 2}) == (1, 2)
    assert split_batch(types.MappingProxyType({"x": 1, "y": 2})) == (1, 2)  # any mapping, FrozenDict too


def test_split_batch_refuses_what_it_cannot_unpack():
    with pytest.raises(ValueError, match=r"needs an input key .* got keys \['features', 'y'\]"):
        split_batch({"features": 1, "y": 2})
    with pytest.raises(ValueError, match="must be \\(inputs, labels\\), got 3 items"):
        split_batch((1, 2, 3))
    with pytest.raises(TypeError, match="batch must be \\(inputs, labels\\) or a dict, got ndarray"):
        split_batch(np.ones(3))
