"""CPU: the embedded default (MNIST-1D, 1-D CNN), no network needed.

On a CPU half precision only saves memory (XLA upcasts most half ops), so the
point of this config is that every policy *trains* to the same accuracy; the
comparison includes both half formats because they behave differently (fp16 needs
loss scaling, bf16 does not).

Batch: 1 device x 128 = global 128; learning rate 1e-2 (AdamW, 1e-2 per 128, linear);
warm-up 0.5 epoch (62 steps) of 8 epochs (1000 steps).
"""

from experiments.configs import default


def get_config():
    config = default.get_config()
    config.num_devices = 1
    config.per_device_batch_size = 128      # -> global_batch_size 128, learning_rate 1e-2
    config.compare_policies = ("O0", "O1", "O2-bf16", "O2-fp16", "O3")
    return config
