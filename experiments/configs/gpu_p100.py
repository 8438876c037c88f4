"""Tesla P100 (Pascal, compute capability 6.0): the Kaggle mixed-precision table.

Same run as ``gpu_t4``. Pascal has fast fp16 arithmetic but no Tensor Cores;
that study measured no speed-up from O1/O2 on it (and odd memory numbers), so this
config is the control for the T4 result. O3 is left out, as in the seed.

Batch: 1 device x 128 = global 128; learning rate 0.1; warm-up 1 epoch.
"""

from experiments.configs import gpu_t4


def get_config():
    config = gpu_t4.get_config()
    config.policy = "O0"                     # no Tensor Cores: fp32 is as fast 
    config.compare_policies = ("O0", "O1-fp16", "O2-fp16")
    return config
