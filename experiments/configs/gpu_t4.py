"""Tesla T4 (Turing, compute capability 7.5): the Colab mixed-precision table.

CIFAR-10, Wide-ResNet-28-10, batch 128, 10 epochs, SGD with momentum and a
linear schedule with warm-up. The T4 has float16 Tensor Cores but no bfloat16, so
every half-precision level is float16 (O1/O2 with dynamic loss scaling; O3 pure
fp16, reported there as not converging). Reported there: mixed precision ~1.9x
faster than fp32, and consistently less GPU memory.

Batch: 1 device x 128 = global 128; learning rate 0.1 (0.1 per 128, linear);
warm-up 1 epoch.
"""

import ml_collections

from experiments.configs import default


def get_config():
    config = default.get_config()
    config.model = "wrn28_10"
    config.model_kwargs = ml_collections.ConfigDict(dict(depth=28, widen_factor=10, dropout_rate=0.0))
    config.dataset = "cifar10"
    config.fake_input_shape = (32, 32, 3)
    config.policy = "O2-fp16"                # the recommended level on Turing 
    config.compare_policies = ("O0", "O1-fp16", "O2-fp16", "O3-fp16")
    config.num_seeds = 1
    config.num_devices = 1
    config.per_device_batch_size = 128      # -> global_batch_size 128
    config.eval_batch_size = 500
    config.optimizer = "sgd"
    config.base_learning_rate = 0.1         # at base_batch_size 128 -> learning_rate 0.1
    config.base_batch_size = 128
    config.weight_decay = 5e-4
    config.warmup_epochs = 1.0
    config.num_epochs = 10.0
    config.lr_schedule = "linear"
    config.log_every_steps = 50
    config.eval_every_steps = 391           # once per epoch (50000 / 128)
    config.checkpoint_every_steps = 391
    return config
