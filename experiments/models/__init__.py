"""Models as plain Flax Linen modules: ``get_model(config)``.

Every model is called as ``model.apply(variables, inputs, train=...)`` and returns
logits; none takes a dtype, because the jaxmp Flax integration runs plain modules
under a precision policy (half compute, fp32 norms and loss).
"""

from __future__ import annotations

from experiments.models.cnn import CNN, CNN1D
from experiments.models.resnet import ResNet, ResNet9
from experiments.models.transformer import TransformerEncoder
from experiments.models.wide_resnet import WideResNet

# name -> (class, fixed keyword arguments); config.model_kwargs adds or overrides.
MODELS = {
    "cnn": (CNN, {}),
    "cnn1d": (CNN1D, {}),
    "wrn28_10": (WideResNet, dict(depth=28, widen_factor=10)),
    "wrn16_4": (WideResNet, dict(depth=16, widen_factor=4)),
    "resnet50": (ResNet, dict(stage_sizes=(3, 4, 6, 3))),
    "resnet9": (ResNet9, {}),
    "transformer": (TransformerEncoder, {}),
}


def get_model(name: str, num_classes: int, **overrides):
    """Builds a model by name.

    Args:
      name: one of `MODELS`.
      num_classes: logits the model returns.
      **overrides: module attributes (e.g. ``widen_factor=1`` for a tiny WRN).

    Raises:
      ValueError: unknown name or attribute (the message lists the choices).
    """
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}: choose one of {', '.join(MODELS)} (--config.model=...).")
    cls, fixed = MODELS[name]
    kwargs = {**fixed, **overrides, "num_classes": num_classes}
    fields = set(cls.__dataclass_fields__) - {"parent", "name"}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"Model {name!r} ({cls.__name__}) has no attribute(s) {unknown}; "
                         f"it takes {sorted(fields)} (--config.model_kwargs.<field>=...).")
    return cls(**kwargs)


__all__ = ["CNN", "CNN1D", "MODELS", "ResNet", "ResNet9", "TransformerEncoder", "WideResNet", "get_model"]
