"""8x V100 (Volta, compute capability 7.0): the large-batch ImageNet ResNet-50, data parallel.

The reference run: Apex O2 + DDP, per-GPU batch 208 (the largest that fits in 16 GB with
O2), SGD momentum 0.9, weight decay 1e-4, 90 epochs, linear learning-rate
scaling with gradual warm-up, 76% top-1 at every scale. Volta has fp16 Tensor
Cores only: O2-fp16 with dynamic loss scaling is the recipe.

Batch: 8 devices x 208 = global 1664; learning rate 0.1 per 256 -> 0.65;
warm-up 5 epochs (Goyal et al.).
"""

import ml_collections

from experiments.configs import default


def get_config():
    config = default.get_config()
    config.model = "resnet50"
    config.model_kwargs = ml_collections.ConfigDict(dict(stage_sizes=(3, 4, 6, 3), width=64))
    config.dataset = "imagenet2012"
    config.image_size = 224
    config.cache_data = False               # 140 GB: read from disk every epoch
    config.fake_input_shape = (224, 224, 3)
    config.num_classes = 1000
    config.policy = "O2-fp16"
    config.compare_policies = ("O0", "O1-fp16", "O2-fp16")
    config.num_seeds = 1
    config.num_devices = 8
    config.per_device_batch_size = 208      # -> global_batch_size 1664
    config.eval_batch_size = 1600           # 200 per device
    config.optimizer = "sgd"
    config.nesterov = False
    config.base_learning_rate = 0.1         # at base_batch_size 256 -> learning_rate 0.65
    config.base_batch_size = 256
    config.weight_decay = 1e-4
    config.warmup_epochs = 5.0
    config.num_epochs = 90.0
    config.lr_schedule = "cosine"
    config.log_every_steps = 100
    config.eval_every_steps = 770           # ~once per epoch (1281167 / 1664)
    config.checkpoint_every_steps = 770
    return config
