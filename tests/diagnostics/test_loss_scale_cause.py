"""check_health names the loss scale when it is the cause (issue 60, item 4): a static scale that
overflows float16 in the backward pass of a real Flax model, where the same step is finite unscaled,
is reported as the cause with a scale that fits, as code that trains when pasted."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp.diagnostics import locate_non_finite


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="hidden")(x))
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(10, name="out")(x)


_MODEL = _MLP()
_X = jax.random.normal(jax.random.key(0), (32, 20))
_Y = jnp.arange(32) % 10


def _loss(params, x, y):
    logits = _MODEL.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def _train(tx, steps):
    """``steps`` steps of the README's loop at O1-fp16; the final params and optimizer state."""
    mp_loss = jaxmp.autocast(_loss, "O1-fp16")

    @jax.jit
    def step(params, opt_state):
        _, grads = jaxmp.value_and_grad(mp_loss, opt_state)(params, _X, _Y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jaxmp.apply_updates(params, updates, opt_state), opt_state

    params = _MODEL.init(jax.random.key(1), _X)["params"]
    opt_state = tx.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return params, opt_state


_ADAMW = "optax.adamw: bias correction is a Python float ** int32 count"


@pytest.fixture(scope="module")
def diverged():
    """The run of the issue: adamw under a static scale of 1e9 at O1-fp16, every step skipped."""
    with jax.numpy_dtype_promotion("standard"):
        params, opt_state = _train(jaxmp.loss_scaling(optax.adamw(1e-3), "static:1e9"), 4)
    assert int(jaxmp.scaling_stats(opt_state)["consecutive_skips"]) == 4
    return params, opt_state


@pytest.mark.standard_promotion(reason=_ADAMW)
def test_check_health_names_an_overflowing_static_scale_and_what_to_pass_instead(diverged):
    params, opt_state = diverged
    # Without a locator: the static scale is named as a candidate cause.
    with pytest.raises(jaxmp.TrainingDivergedError, match=r"the scale 1e\+09 is the cause") as e:
        jaxmp.check_health(opt_state, max_consecutive_skips=3)
    assert 'jaxmp.loss_scaling(tx, "dynamic")' in str(e.value)

    def locate():
        return locate_non_finite(_loss, params, _X, _Y, policy="O1-fp16",
                                 loss_scale=jaxmp.get_loss_scale(opt_state).loss_scale)

    with pytest.raises(jaxmp.TrainingDivergedError) as e:
        jaxmp.check_health(opt_state, max_consecutive_skips=3, locate=locate)
    message = str(e.value)
    assert "Culprit: first inf from finite inputs" in message and "(backward" in message
    assert "The loss scale 1e+09 overflows float16" in message and "finite unscaled" in message
    assert "learning rate" not in message and "bfloat16 instead" not in message
    fixes = re.findall(r'jaxmp\.loss_scaling\(tx, "[^"]+"\)', message)
    assert 'jaxmp.loss_scaling(tx, "dynamic")' in fixes and any('"static:' in f for f in fixes), message
    # Each printed fix, pasted with tx the optimizer the run wrapped, trains without skipping.
    for fix in fixes:
        tx = eval(fix, {"jaxmp": jaxmp, "tx": optax.adamw(1e-3)})  # noqa: S307 - the message's own code
        _, state = _train(tx, 4)
        assert int(jaxmp.scaling_stats(state)["total_skips"]) == 0, fix


@pytest.mark.slow  # two more instrumented programs compile (~15 s on a loaded 2-core CPU)
@pytest.mark.standard_promotion(reason=_ADAMW)
def test_the_largest_scale_that_fits_is_measured_on_the_same_step(diverged):
    params, opt_state = diverged
    found = locate_non_finite(_loss, params, _X, _Y, policy="O1-fp16",
                              loss_scale=jaxmp.get_loss_scale(opt_state).loss_scale)
    assert found.found and found.backward and found.loss_scale == 1e9
    fits = found.fits_scale
    assert 1 <= fits < 1e9 and np.log2(fits) == int(np.log2(fits))
    assert locate_non_finite(_loss, params, _X, _Y, policy="O1-fp16", loss_scale=fits).found is False
    assert locate_non_finite(_loss, params, _X, _Y, policy="O1-fp16", loss_scale=2 * fits).found
    assert "1e+09 overflows float16" in str(found) and f'"static:{int(fits // 8)}"' in str(found).replace("\n", " ")
