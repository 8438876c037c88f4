"""H100 (Hopper, compute capability 9.0): as ``gpu_a100`` with twice the per-device batch.

Batch: 1 device x 512 = global 512; learning rate 0.1 per 128 -> 0.4;
warm-up 2 epochs. bf16 is the recommended half format (no loss scaling).
"""

from experiments.configs import gpu_a100


def get_config():
    config = gpu_a100.get_config()
    config.per_device_batch_size = 512      # -> global_batch_size 512, learning_rate 0.4
    config.eval_every_steps = 97            # once per epoch (50000 / 512)
    config.checkpoint_every_steps = 97
    return config
