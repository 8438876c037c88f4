"""The locator names an overflow in the optimizer's own arithmetic as the optimizer (O3's culprit),
not as the line of jaxmp's wrapper that JAX's traceback stops at."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp.diagnostics import locate_non_finite


def _step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


@pytest.mark.standard_promotion(reason="optax's Adam bias correction mixes a float with its int32 count")
def test_adam_in_float16_is_named_as_the_optimizer_and_its_epsilon():
    # O3: float16 params and Adam state, no masters. A gradient of 1e-4 squares to 1e-8, which
    # float16 flushes to 0; eps=1e-8 flushes too, so the update divides by zero.
    params = {"w": np.ones(4, np.float16)}
    grads = {"w": np.full(4, 1e-4, np.float16)}
    tx = jaxmp.loss_scaling(optax.adam(1e-3), "none", master_weights=False)
    found = locate_non_finite(_step(tx), params, tx.init(params), grads)
    assert found.found and found.primitive == "div" and not found.backward
    summary = found.summary()
    assert "the optimizer update" in summary and "jaxmp/_scaling/_transform.py" not in summary, summary
    assert "Adam's eps" in summary and "master_weights=True" in summary, summary
    # The fix it names works: with float32 masters and state the same step is finite.
    tx = jaxmp.loss_scaling(optax.adam(1e-3), "none", master_weights=True)
    new_params, _ = jax.jit(_step(tx))(params, tx.init(params), grads)
    assert bool(jnp.isfinite(new_params["w"]).all())
