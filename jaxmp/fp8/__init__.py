"""fp8 scaling: recipes, scale and amax-history updates, and a scaled fp8 ``dot_general``.

Two recipes, as in Transformer Engine: [`CurrentScaling`][jaxmp.fp8.CurrentScaling] (the scale from
the tensor's own amax, no state) and [`DelayedScaling`][jaxmp.fp8.DelayedScaling] (from a history of
past amaxes, [`Fp8Meta`][jaxmp.fp8.Fp8Meta]). Forward operands are E4M3, gradients E5M2.
[`fp8_dot_general`][jaxmp.fp8.fp8_dot_general] quantizes around a ``lax.dot_general``, which XLA
rewrites to an fp8 GEMM on GPUs of compute capability >= 8.9 (emulated elsewhere).
See docs/fp8.md.

Example:
  >>> from jaxmp import fp8
  >>> fp8.DelayedScaling().history_length
  1024
"""

from jaxmp.fp8 import _scaling, _state  # noqa: F401  (loaded with the package)
from jaxmp.fp8._hardware import check_hardware
from jaxmp.fp8._ops import fp8_conv_general_dilated, fp8_dot_general, gradient_loss_scale
from jaxmp.fp8._recipes import CurrentScaling, DelayedScaling, Fp8Meta, Fp8Recipe
from jaxmp.fp8._state import update_state

__all__ = [
    # recipes
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Recipe",
    "Fp8Meta",
    "check_hardware",
    # ops
    "fp8_dot_general",
    "fp8_conv_general_dilated",
    "gradient_loss_scale",
    # the delayed-scaling state's step update
    "update_state",
]
