"""jaxmp/flax/_steps.py: the Linen eval and train steps' own contract (losses, arguments, fp8 state check);
training end to end is in test_train_state.py, the NNX step in test_nnx.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.flax
from jaxmp.flax._steps import make_eval_step, make_train_step

X = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
Y = np.array([0, 1, 1, 0], np.int32)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, scale: float = 1.0):
        return nn.Dense(2)(x) * scale


def _state(policy="O0"):  # float32: the step's arithmetic checked exactly
    model = jaxmp.flax.mixed_precision(Net(), policy)
    return jaxmp.flax.TrainState.create(model, jax.jit(model.init)(jax.random.key(0), X),
                                        jaxmp.loss_scaling(optax.sgd(0.1), "none"))


@pytest.fixture(scope="module")
def state():
    return _state()


def test_eval_step_reports_the_cross_entropy_and_accuracy_of_the_models_logits(state):
    metrics = jax.jit(make_eval_step())(state, {"image": X, "label": Y})
    logits = np.asarray(state.model.apply({"params": state.params}, X), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert metrics["loss"].dtype == jnp.float32
    np.testing.assert_allclose(float(metrics["loss"]), -logp[np.arange(4), Y].mean(), rtol=1e-5)
    assert float(metrics["accuracy"]) == np.mean(logits.argmax(-1) == Y)


def test_model_kwargs_and_loss_fn_reach_the_forward_pass(state):
    def total(logits, labels):
        return jnp.sum(logits.astype(jnp.float32))

    plain = jax.jit(make_eval_step(loss_fn=total))(state, (X, Y))["loss"]
    tripled = jax.jit(make_eval_step(loss_fn=total, model_kwargs={"scale": 3.0}))(state, (X, Y))["loss"]
    np.testing.assert_allclose(float(tripled), 3 * float(plain), rtol=1e-5)


def test_a_train_step_applies_the_gradient_of_the_given_loss(state):
    def first_logit(logits, labels):
        return jnp.mean(logits[:, 0].astype(jnp.float32))

    new, metrics = jax.jit(make_train_step(loss_fn=first_logit))(state, (X, Y))
    # d mean(x @ W[:, 0] + b[0]) / dW[:, 0] = mean(x), / db[0] = 1; the second column gets no gradient.
    dense = lambda s: s.params["Dense_0"]  # noqa: E731
    np.testing.assert_allclose(dense(state)["kernel"][:, 0] - dense(new)["kernel"][:, 0], 0.1 * X.mean(0), atol=1e-6)
    np.testing.assert_allclose(dense(new)["kernel"][:, 1], dense(state)["kernel"][:, 1])
    assert float(dense(state)["bias"][0] - dense(new)["bias"][0]) == pytest.approx(0.1)
    assert int(new.step) == 1 and bool(metrics["last_step_finite"])
    assert sorted(metrics) == ['accuracy', 'consecutive_skips', 'last_step_finite', 'loss', 'loss_scale',
                               'total_skips']


def test_an_fp8_collection_without_a_delayed_recipe_is_named(state):
    odd = state.replace(model_state={**state.model_state, "fp8_meta": {}})
    with pytest.raises(ValueError, match="'fp8_meta' collection .* no DelayedScaling recipe.*O2-fp8"):
        make_train_step()(odd, (X, Y))
