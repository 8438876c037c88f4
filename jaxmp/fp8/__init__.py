"""fp8 scaling: recipes, scale and amax-history updates, and a scaled fp8 ``dot_general``.

fp8 has so little range (E4M3: +-448, E5M2: +-57344) that every tensor is multiplied by a
per-tensor *scale* before the cast and divided by it after, the scale chosen so the tensor's
absolute maximum (amax) lands near the format's largest value. Two recipes, as in NVIDIA's
Transformer Engine:

* [`CurrentScaling`][jaxmp.fp8.CurrentScaling]: the scale comes from the tensor's own amax in the same step. No
  state; invariant to a loss scale (a scaled gradient gets a proportionally smaller scale).
* [`DelayedScaling`][jaxmp.fp8.DelayedScaling]: the scale comes from a history of past amaxes ([`Fp8Meta`][jaxmp.fp8.Fp8Meta],
  updated by `jaxmp.fp8.scaling.update_meta`), so the cast needs no reduction over the tensor first.

Forward operands use E4M3 and gradients E5M2 (the "hybrid" format). [`fp8_dot_general`][jaxmp.fp8.fp8_dot_general]
quantizes and dequantizes its operands around a ``lax.dot_general`` (and the cotangent in its
backward pass). On CPU that is the emulation (fp8 rounding, matmul in the operands' dtype); on
GPUs with fp8 Tensor Cores (compute capability >= 8.9) XLA rewrites this pattern into an fp8
GEMM, which is how ``flax.linen.fp8_ops`` reaches them too. Under [`jaxmp.autocast`][jaxmp.autocast],
``AutocastRules(fp8_matmuls=CurrentScaling())`` makes every half-list ``dot_general`` one.

One module per concern, the names a training script uses re-exported here (``from jaxmp import
fp8; fp8.CurrentScaling``); the scaling arithmetic stays in its modules: ``formats`` (E4M3 / E5M2 and their ranges), ``recipes`` (the two
recipes, `Fp8Recipe`, `Fp8Meta`), ``scaling`` (amax, scale, quantize, the
history update), ``state`` (the per-layer delayed-scaling variables and their step update),
``ops`` (the scaled ``dot_general`` and convolution) and ``hardware`` (native or emulated).

Example:
  >>> import jax.numpy as jnp
  >>> from jaxmp import fp8
  >>> fp8.DelayedScaling().history_length
  1024
"""

from jaxmp import _deprecations
from jaxmp.fp8 import formats, scaling, state  # noqa: F401  (loaded with the package)
from jaxmp.fp8.hardware import check_hardware
from jaxmp.fp8.ops import fp8_conv_general_dilated, fp8_dot_general, gradient_loss_scale
from jaxmp.fp8.recipes import CurrentScaling, DelayedScaling, Fp8Meta, Fp8Recipe
from jaxmp.fp8.state import update_state

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

__getattr__ = _deprecations.module_getattr(__name__)
