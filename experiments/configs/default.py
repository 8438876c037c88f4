"""Default hyper-parameters: the embedded MNIST-1D run, which needs no network.

Every hardware file starts from this and overrides only what differs. The
batch and learning-rate fields follow the large-batch recipe: the *per-device* batch and the
number of devices are explicit, the global batch is their product, and the
learning rate scales linearly with the global batch from a reference
(``base_learning_rate`` at ``base_batch_size``), with a linear warm-up. The
derived fields are ``FieldReference`` expressions, so overriding
``--config.per_device_batch_size`` rescales the global batch and the learning
rate consistently.
"""

import ml_collections


def get_config():
    """The default (CPU, MNIST-1D, 1-D CNN) config."""
    config = ml_collections.ConfigDict()
    _model_and_data(config)
    _precision(config)
    _optimization(config)
    _run(config)
    return config


def _model_and_data(config):
    config.model = "cnn1d"              # experiments.models.MODELS
    # Module attributes (experiments.models); declared here so --config.model_kwargs.<x> works.
    config.model_kwargs = ml_collections.ConfigDict(dict(features=(32, 32, 32), kernel_sizes=(5, 3, 3),
                                                         use_batchnorm=True))
    config.dataset = "mnist1d"          # mnist1d | digits | fake | cifar10 | mnist | imagenet2012
    config.data_dir = ""                # TFDS data_dir ("" = TFDS's default)
    config.image_size = 224             # ImageNet crop side
    config.cache_data = True            # cache decoded TFDS examples in memory
    # MNIST-1D examples generated (80% train / 20% test). The paper's set has 5000 (a 1000-example
    # test set, where one point of accuracy is 10 examples and seeds differ by +-0.5); 20000
    # makes the policy comparison measure precision, not noise.
    config.mnist1d_num_samples = 20000
    config.fake_input_shape = (40,)     # dataset="fake": shape of one example
    config.fake_num_examples = 1024
    config.num_classes = 10             # dataset="fake" only; real sets know theirs


def _precision(config):
    config.policy = "O0"                # the policy of a single run (main.py)
    # The policies `python -m experiments.compare` trains, in table order.
    config.compare_policies = ("O0", "O1", "O2-bf16", "O2-fp16", "O3")
    config.loss_scale = ""              # "" = the recipe's; or "dynamic", "torch", "none", "static:<scale>"
    config.dynamic_scale_init = 0.0     # > 0: initial dynamic loss scale (0 = jaxmp's default, 2**15)
    config.dynamic_scale_period = 0     # > 0: finite steps between growths (0 = jaxmp's default, 2000)
    # The precision engine that runs the model under the policy: "flax" (jaxmp.flax.mixed_precision,
    # per-module rules on a Linen module) or "autocast" (jaxmp.autocast around module.apply: op
    # lists only). experiments.program.make_model_apply is where it is used.
    config.engine = "flax"
    # The optimizer state of a bf16-param policy (O2-bf16, O3-bf16): "" = the policy's own (float32
    # masters under O2-bf16), a jaxmp.lean preset ("remainders", "sr-params", "bf16-sr", ...; see
    # jaxmp.lean.PRESETS), or "bf16-nearest": plain bf16 params rounded to nearest, no master (the
    # failure mode the stochastic-rounding presets fix). Stochastic presets draw from key = seed.
    config.lean_recipe = ""


def _optimization(config):
    """Batch, learning rate, schedule: the per-device batch is explicit, the global batch derived."""
    config.num_devices = 1
    config.per_device_batch_size = 128
    config.global_batch_size = config.get_ref("per_device_batch_size") * config.get_ref("num_devices")
    config.eval_batch_size = 1000       # global; padded, so any split size works
    config.base_learning_rate = 1e-2    # learning rate at base_batch_size ...
    config.base_batch_size = 128
    # ... scaled linearly in the global batch (Goyal et al.).
    config.learning_rate = (config.get_ref("base_learning_rate") * config.get_ref("global_batch_size")
                            / config.get_ref("base_batch_size"))
    config.warmup_epochs = 0.5
    config.num_epochs = 8.0             # 16000 examples / 128 = 125 steps per epoch -> 1000 steps
    config.num_train_steps = -1         # > 0 overrides num_epochs
    config.lr_schedule = "cosine"       # cosine | linear | constant (after the warm-up)
    config.optimizer = "adamw"          # adamw | sgd
    config.momentum = 0.9               # sgd only
    config.nesterov = True              # sgd only
    config.weight_decay = 1e-4
    config.grad_clip_norm = 0.0         # > 0: clip by global norm (after unscaling)
    config.label_smoothing = 0.0


def _run(config):
    config.seed = 0
    config.num_seeds = 3                # compare.py: seeds seed .. seed+num_seeds-1
    config.log_every_steps = 50
    config.eval_every_steps = 100       # also the points of the accuracy/loss curves
    config.checkpoint_every_steps = 250
    config.keep_checkpoints = 2
    config.progress_bar = True
    config.max_consecutive_skips = 200  # stop loudly if the loss scale cannot recover
