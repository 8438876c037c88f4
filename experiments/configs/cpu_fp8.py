"""CPU, fp8: the main job (MNIST-1D, 1-D CNN) under O2-bf16 and the two fp8 presets.

The same run as ``cpu.py``; only the compared policies differ. On a CPU fp8 is emulated
(operands rounded to E4M3 / gradients to E5M2 with per-tensor scales, matmuls and convolutions
in bf16), so this config measures whether fp8 *trains* to bf16's accuracy, not its speed.
``"O2-fp8"`` is delayed scaling (Transformer Engine's defaults, its state in the ``fp8_meta``
collection, checkpointed with the rest of the train state); ``"O2-fp8-current"`` per-tensor
current scaling (no state).
"""

from experiments.configs import cpu


def get_config():
    config = cpu.get_config()
    config.compare_policies = ("O2-bf16", "O2-fp8", "O2-fp8-current")
    config.policy = "O2-fp8"
    return config
