"""Number formats: the element table (E4M3, E5M2, E2M1, E8M0) and the two quantizers that store values in formats.

One room that the fp8 recipes, the lean recipes and the sharded layouts all read:

- ``_elements``: the one table of element formats (`FORMATS`: dtype, largest value, exponents,
  mantissa bits, roles) and the checks and messages built from it (`fp8_dtype`, `element_format`).
- ``_code_maps``: lean's 8-bit and 4-bit moments: the code maps (`CODE_MAPS`, bit for bit
  bitsandbytes' and torchao's) and `Grid` (bits, block), whose methods quantize and dequantize.
- ``_block_scaled``: the block-scaled quantizer of the MX and NVFP4 recipes (E8M0, E4M3 and
  float32 scales, stochastic rounding, the random Hadamard transform), exact on every backend.

Private: the public faces are ``jaxmp.fp8`` and ``jaxmp.lean``.
"""

from jaxmp._formats import _block_scaled, _code_maps, _elements  # noqa: F401  (modules other units reach)
from jaxmp._formats._code_maps import CODE_BITS, CODE_MAPS, MAP_REVISION, Grid, code_map
from jaxmp._formats._elements import (BLOCK_ELEMENT, BLOCK_SCALE, E2M1, E4M3, E5M2, E8M0, ELEMENTS, FORMATS, FP8_DTYPES,
                                      FP8_TENSOR, ElementFormat, element_format, fp8_dtype, fp8_max, spelled, with_role)

__all__ = [
    "BLOCK_ELEMENT", "BLOCK_SCALE", "CODE_BITS", "CODE_MAPS", "E2M1", "E4M3", "E5M2", "E8M0", "ELEMENTS", "FORMATS",
    "FP8_DTYPES", "FP8_TENSOR", "ElementFormat", "Grid", "MAP_REVISION", "code_map", "element_format", "fp8_dtype",
    "fp8_max", "spelled", "with_role",
]
