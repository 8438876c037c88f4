"""TPU v3-8: the ResNet-9 (DavidNet) on CIFAR-10 over 8 cores.

A TPU v3-8 is eight cores that each see 1/8 of the batch: global 512 is a
per-core batch of 64. The TPU study found DavidNet's weight decay 5e-4 (tuned for one
GPU at batch 512) too large there and 1.25e-4 right -- the per-device batch, not
the global one, is what the weight decay interacts with. TPUs compute in bf16
natively, so no loss scaling anywhere.

Batch: 8 devices x 64 = global 512; learning rate 0.4 (0.1 per 128, linear);
warm-up 5 epochs, then linear decay to 0 (DavidNet's one-cycle), 24 epochs.
"""

import ml_collections

from experiments.configs import default


def get_config():
    config = default.get_config()
    config.model = "resnet9"
    config.model_kwargs = ml_collections.ConfigDict(dict(width=64))
    config.dataset = "cifar10"
    config.fake_input_shape = (32, 32, 3)
    config.policy = "O2-bf16"
    config.compare_policies = ("O0", "O1-bf16", "O2-bf16", "O3-bf16")
    config.num_seeds = 1
    config.num_devices = 8
    config.per_device_batch_size = 64       # -> global_batch_size 512
    config.eval_batch_size = 1000           # 125 per core
    config.optimizer = "sgd"
    config.base_learning_rate = 0.1         # at base_batch_size 128 -> learning_rate 0.4
    config.base_batch_size = 128
    config.weight_decay = 1.25e-4           # the TPU study's value (GPU: 5e-4)
    config.label_smoothing = 0.2
    config.warmup_epochs = 5.0
    config.num_epochs = 24.0
    config.lr_schedule = "linear"
    config.eval_every_steps = 97            # once per epoch (50000 / 512)
    config.checkpoint_every_steps = 97
    return config
