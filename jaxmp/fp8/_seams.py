"""The semi-public face of ``jaxmp.fp8``: what the rest of jaxmp uses of its private modules.

The one door through which other jaxmp units (the step builder, the Flax fp8 layers, the engine)
reach fp8's internals, as ``jaxmp.engine._seams`` is the engine's (tests/_support/_import_graph.py
lets other units import ``_seams`` modules and no other private module of a subpackage; every
name here has a user outside ``jaxmp.fp8``). No stability promise: these names change in any
release, without a deprecation period; code outside jaxmp uses ``jaxmp.fp8``'s public names.
"""

from jaxmp.fp8 import _block_watch as block_watch
from jaxmp.fp8 import _hardware as hardware
from jaxmp.fp8 import _recipes as recipes
from jaxmp.fp8 import _state as state
from jaxmp.fp8._state import FP8_COLLECTION
# The sharded layouts' matmul-format gathers (jaxmp/parallel/_wire_matmul.py): a kernel gathered
# as the codes and scale its per-tensor fp8 matmul makes of it.
from jaxmp.fp8._scaling import amax, compute_scale, dequantize, quantize

__all__ = [
    "FP8_COLLECTION",
    "amax",
    "compute_scale",
    "dequantize",
    "quantize",
    "block_watch",
    "hardware",
    "recipes",
    "state",
]
