"""A100 (Ampere, compute capability 8.0): the mixed-precision study where bf16 exists too.

Same CIFAR-10 Wide-ResNet-28-10 run as ``gpu_t4``, with the larger per-device
batch an A100 affords; the learning rate follows linearly. Ampere has bf16 Tensor
Cores, so the comparison puts bf16 (no loss scaling) next to fp16 (dynamic scaling).

Batch: 1 device x 256 = global 256; learning rate 0.1 per 128 -> 0.2;
warm-up 2 epochs (the larger batch needs a longer ramp).
"""

from experiments.configs import gpu_t4


def get_config():
    config = gpu_t4.get_config()
    config.policy = "O2-bf16"
    config.compare_policies = ("O0", "O1-bf16", "O2-bf16", "O2-fp16", "O3-bf16")
    config.per_device_batch_size = 256      # -> global_batch_size 256, learning_rate 0.2
    config.warmup_epochs = 2.0
    config.eval_every_steps = 195           # once per epoch (50000 / 256)
    config.checkpoint_every_steps = 195
    return config
