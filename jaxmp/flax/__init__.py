"""Flax integration: run Linen and NNX models under a precision policy.

* [`mixed_precision`][jaxmp.flax.mixed_precision] wraps a Linen module (init/apply) or an NNX module (a module)
  so that matmuls and convolutions run in the compute dtype while normalisation,
  softmax and the loss stay float32 (its [`jaxmp.AutocastRules`][jaxmp.AutocastRules] say which:
  [`default_rules`][jaxmp.flax.default_rules]).
* [`TrainState`][jaxmp.flax.TrainState], [`make_train_step`][jaxmp.flax.make_train_step],
  [`make_eval_step`][jaxmp.flax.make_eval_step]: Linen training with loss scaling, applied-steps
  counting and exact skipped steps (batch_stats too).
* [`jaxmp.flax.nnx.train_step`][jaxmp.flax.nnx.train_step]: the same for NNX with ``nnx.Optimizer``.

See the README section "Flax: Linen and NNX models under a policy".
"""

from __future__ import annotations

import flax.linen as _nn
from flax import nnx as _nnx

from jaxmp.flax import fp8, linen, nnx
from jaxmp.flax._attention import float32_softmax_attention, fused_attention
from jaxmp.flax._losses import accuracy, softmax_cross_entropy
from jaxmp._typing import PolicyLike
from jaxmp.engine._seams import AutocastRules as _AutocastRules
from jaxmp.flax._overrides import default_rules, resolve_rules
from jaxmp.flax._steps import make_eval_step, make_train_step
from jaxmp.flax._train_state import TrainState
from jaxmp._scaling._loss_scale import register_flax_serialization as _register_flax_serialization

# Importing jaxmp.flax is asking for Flax support: the one effect of an import (effect 3 of
# jaxmp._effects, an entry in Flax's serialization registry; Flax's code is not patched).
_register_flax_serialization(force=True)


def mixed_precision(model: _nn.Module | _nnx.Module, policy: PolicyLike, rules: _AutocastRules | None = None
                    ) -> linen.MixedPrecision | nnx.MixedPrecision:
    """Runs an unmodified Linen or NNX model under a precision policy.

    Params are cast per module for the forward pass, inputs to the compute dtype, outputs to the
    output dtype; the rules keep normalisation, attention softmax and the loss in float32.

    Args:
      model: a ``flax.linen.Module`` or ``flax.nnx.Module`` instance.
      policy: a [`jaxmp.Policy`][jaxmp.Policy], a preset name (``"O1-bf16"``, ``"O2-fp16"`` ...), a jmp
        policy string (``"p=f32,c=bf16,o=f32"``), a [`jaxmp.Recipe`][jaxmp.Recipe] or a ``jmp.Policy``.
      rules: a [`jaxmp.AutocastRules`][jaxmp.AutocastRules], or None for the preset's defaults.
        [`default_rules`][jaxmp.flax.default_rules]``(preset)`` edited with ``with_*`` is used as
        given; a rules object built from ``jaxmp.AutocastRules()`` is merged onto the preset's
        rules (its entries win), so the preset's class rules and op lists stay.

    Returns:
      For Linen, a [`jaxmp.flax.linen.MixedPrecision`][jaxmp.flax.linen.MixedPrecision] with the module's
      ``init`` / ``apply``; for NNX, a [`jaxmp.flax.nnx.MixedPrecision`][jaxmp.flax.nnx.MixedPrecision]
      module wrapping the model.

    Raises:
      TypeError: not a Linen/NNX module instance, a policy whose dtypes are not floating, or bad rules.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxmp.flax
      >>> net = nn.Sequential([nn.Dense(4), nn.LayerNorm()])
      >>> model = jaxmp.flax.mixed_precision(net, "O1-bf16")
      >>> x = jnp.ones((2, 3))
      >>> model.apply(model.init(jax.random.key(0), x), x).dtype   # the output dtype: float32
      dtype('float32')
    """
    if isinstance(model, (_nn.Module, _nnx.Module)):
        policy, rules = resolve_rules(policy, rules)
        return (linen.MixedPrecision if isinstance(model, _nn.Module) else nnx.MixedPrecision)(model, policy, rules)
    if isinstance(model, type) and issubclass(model, (_nn.Module, _nnx.Module)):
        raise TypeError(f"mixed_precision expects a module instance, got the class {model.__name__}; instantiate it first")
    raise TypeError(
        f"mixed_precision expects a flax.linen.Module or flax.nnx.Module instance, got {type(model).__name__}; "
        "for a plain function use jaxmp.Policy.cast_to_compute on its params and inputs"
    )


__all__ = [
    "TrainState",
    "accuracy",
    "default_rules",
    "float32_softmax_attention",
    "fp8",
    "fused_attention",
    "linen",
    "make_eval_step",
    "make_train_step",
    "mixed_precision",
    "nnx",
    "softmax_cross_entropy",
]
