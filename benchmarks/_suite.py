"""The throughput suite as data: models, batches and policies, timing settings, and the model
loader; shared by ``throughput.py``, ``flops.py`` and ``torch_amp.py``.

Plain data and one lazily importing loader, so that a CLI module never has to import another
CLI module for its suite (that made ``throughput``, ``flops``, ``_runs`` and ``kernel_profile``
import each other in a cycle).
"""

from __future__ import annotations

POLICIES = ("O0-strict", "O0", "O1", "O2-bf16", "O2-fp16", "native-bf16", "native-bf16-cudnn",
            "autocast-O1", "autocast-O2-bf16")

# name -> spec. "model" is (experiments.models name, overrides); inputs are NHWC images or
# [N, L] sequences (the encoder embeds one scalar per token).
SUITE = {
    "wrn28_10": dict(model=("wrn28_10", {}), input=(32, 32, 3), classes=10, batches=(128, 512),
                     optimizer="sgd", unit="images"),
    "resnet50": dict(model=("resnet50", {}), input=(224, 224, 3), classes=1000, batches=(256,),
                     optimizer="sgd", unit="images"),
    "transformer": dict(model=("transformer", dict(num_layers=12, model_dim=768, num_heads=12, mlp_dim=3072)),
                        input=(512,), classes=10, batches=(32,), optimizer="adamw", unit="tokens"),
}
DRY_SUITE = {
    "wrn28_10": dict(model=("wrn16_4", dict(depth=10, widen_factor=1)), input=(8, 8, 3), classes=10,
                     batches=(2,), optimizer="sgd", unit="images"),
    "resnet50": dict(model=("resnet50", dict(stage_sizes=(1, 1), width=4)), input=(16, 16, 3), classes=10,
                     batches=(2,), optimizer="sgd", unit="images"),
    "transformer": dict(model=("transformer", dict(num_layers=1, model_dim=8, num_heads=2, mlp_dim=16)),
                        input=(8,), classes=10, batches=(2,), optimizer="adamw", unit="tokens"),
}
TIMING = dict(warmup_steps=10, rounds=15, steps=10, n_batches=2)
# fast_compile: XLA backend optimisation level 0 (dry runs check plumbing, not speed).
DRY_TIMING = dict(warmup_steps=1, rounds=2, steps=2, n_batches=2, fast_compile=True)
MATMUL_N, DRY_MATMUL_N = 8192, 128


def load_model(name: str, classes: int, overrides: dict):
    """The Flax model of ``experiments.models`` (imported at run time).

    Args:
      name: a model name of ``experiments.models``.
      classes: the number of output classes.
      overrides: keyword overrides of the model's configuration.

    Returns:
      The Flax module.
    """
    try:
        from experiments.models import get_model
    except ImportError as e:  # pragma: no cover - depends on the checkout
        raise RuntimeError(f"experiments.models is needed for the throughput benchmark: {e}") from e
    return get_model(name, classes, **overrides)
