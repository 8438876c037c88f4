"""fp8 scaling: recipes, scale and amax-history updates, and a scaled fp8 ``dot_general``.

fp8 has so little range (E4M3: +-448, E5M2: +-57344) that every tensor is multiplied by a
per-tensor *scale* before the cast and divided by it after, the scale chosen so the tensor's
absolute maximum (amax) lands near the format's largest value. Two recipes, as in NVIDIA's
Transformer Engine:

* [`CurrentScaling`][jaxmp.fp8.CurrentScaling]: the scale comes from the tensor's own amax in the same step. No
  state; invariant to a loss scale (a scaled gradient gets a proportionally smaller scale).
* [`DelayedScaling`][jaxmp.fp8.DelayedScaling]: the scale comes from a history of past amaxes ([`Fp8Meta`][jaxmp.fp8.Fp8Meta],
  updated by [`update_meta`][jaxmp.fp8.update_meta]), so the cast needs no reduction over the tensor first.

Forward operands use E4M3 and gradients E5M2 (the "hybrid" format). [`fp8_dot_general`][jaxmp.fp8.fp8_dot_general]
quantizes and dequantizes its operands around a ``lax.dot_general`` (and the cotangent in its
backward pass). On CPU that is the emulation (fp8 rounding, matmul in the operands' dtype); on
GPUs with fp8 Tensor Cores (compute capability >= 8.9) XLA rewrites this pattern into an fp8
GEMM, which is how ``flax.linen.fp8_ops`` reaches them too. Under [`jaxmp.autocast`][jaxmp.autocast],
``AutocastRules(fp8_matmuls=CurrentScaling())`` makes every half-list ``dot_general`` one.

One module per concern, every public name re-exported here (``from jaxmp import fp8;
fp8.CurrentScaling``): ``formats`` (E4M3 / E5M2 and their ranges), ``recipes`` (the two
recipes, [`Fp8Recipe`][jaxmp.fp8.Fp8Recipe], [`Fp8Meta`][jaxmp.fp8.Fp8Meta]), ``scaling`` (amax, scale, quantize, the
history update), ``state`` (the per-layer delayed-scaling variables and their step update),
``ops`` (the scaled ``dot_general`` and convolution) and ``hardware`` (native or emulated).

Example:
  >>> import jax.numpy as jnp
  >>> from jaxmp import fp8
  >>> float(fp8.compute_scale(jnp.float32(4.0), jnp.float32(1.0), fp8.E4M3))
  112.0
"""

from jaxmp.fp8.formats import E4M3, E5M2, FP8_DTYPES, fp8_max
from jaxmp.fp8.hardware import check_hardware, native_fp8
from jaxmp.fp8.ops import fp8_conv_general_dilated, fp8_dot_general, gradient_loss_scale
from jaxmp.fp8.recipes import REDUCTIONS, CurrentScaling, DelayedScaling, Fp8Meta, Fp8Recipe, describe
from jaxmp.fp8.scaling import amax, compute_scale, dequantize, qdq, quantize, update_meta
from jaxmp.fp8.state import FP8_COLLECTION, LAYER_TENSORS, Fp8Scales, init_layer_state, layer_scales, update_state

__all__ = [
    # formats
    "E4M3",
    "E5M2",
    "FP8_DTYPES",
    "fp8_max",
    # recipes
    "CurrentScaling",
    "DelayedScaling",
    "Fp8Recipe",
    "Fp8Meta",
    "REDUCTIONS",
    "describe",
    # scaling
    "amax",
    "compute_scale",
    "dequantize",
    "qdq",
    "quantize",
    "update_meta",
    # per-layer state
    "FP8_COLLECTION",
    "LAYER_TENSORS",
    "Fp8Scales",
    "init_layer_state",
    "layer_scales",
    "update_state",
    # ops
    "fp8_conv_general_dilated",
    "fp8_dot_general",
    "gradient_loss_scale",
    # hardware
    "check_hardware",
    "native_fp8",
]
