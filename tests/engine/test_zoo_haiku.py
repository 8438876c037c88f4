"""The zoo's Haiku models, trained under ``jaxmp.autocast`` (see ``test_zoo.py``
for the trainer, the checks and the tolerances); skipped without the ``haiku`` extra."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.engine.test_zoo import (  # the zoo's trainer and checks
    RNG, assert_float32_tree, bf16_rounded, ce, check_program, check_training, classification_batch, train)

# -- Haiku ------------------------------------------------------------------------------------

hk = pytest.importorskip("haiku")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["O2-bf16"])      # O1-fp16 passes too (0.04%): left out for CI time
@pytest.mark.standard_promotion(reason="optax.adam(w)'s bias correction: Python float ** int32 count")
def test_haiku_mlp(preset):
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([32, 32, 4])(x)))
    batch = classification_batch()
    params = bf16_rounded(jax.jit(net.init)(jax.random.key(0), batch[0]))

    def loss_fn(params, state, batch, key):
        logits = net.apply(params, batch[0])
        return ce(logits, batch[1]), (state, logits)

    check_program(loss_fn, preset, params, (), batch, min_matmuls=3)
    control = train(loss_fn, params, (), batch, "f32")
    check_training(train(loss_fn, params, (), batch, preset), control, rtol=0.05)


@pytest.mark.slow
@pytest.mark.standard_promotion(reason="haiku's moving averages: int32 counter ** float32 decay")
def test_haiku_resnet_tiny_channels():
    def forward(x, is_training):
        return hk.nets.ResNet(blocks_per_group=(1, 1, 1, 1), num_classes=4, bottleneck=False,
                              channels_per_group=(4, 4, 8, 8), resnet_v2=False,
                              initial_conv_config={"output_channels": 4, "kernel_shape": 3, "stride": 1})(x, is_training)

    net = hk.transform_with_state(forward)
    x = jnp.asarray(1.0 + RNG(1).normal(size=(16, 8, 8, 3)), jnp.float32)
    batch = (x, jnp.argmax(x[:, :4, 0, :].mean(-1), -1))
    params, state = jax.jit(net.init, static_argnums=2)(jax.random.key(0), x, True)
    params = bf16_rounded(params)

    def loss_fn(params, state, batch, key):
        logits, state = net.apply(params, state, None, batch[0], True)
        return ce(logits, batch[1]), (state, logits)

    check_program(loss_fn, "O2-bf16", params, state, batch, min_matmuls=10)
    control = train(loss_fn, params, state, batch, "f32")
    run = train(loss_fn, params, state, batch, "O2-bf16")
    check_training(run, control, rtol=0.1)
    assert_float32_tree(run.state)                                # BatchNorm EMA state stays float32
