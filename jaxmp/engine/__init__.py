"""The precision engine behind ``jaxmp.autocast``: op-level mixed precision for any JAX function.

The public names are top-level (``jaxmp.autocast``, ``jaxmp.AutocastRules``, the regions); this
namespace adds the op lists and the tested JAX versions. Its modules are internal seams that may
change without notice. Layers: see docs/architecture.md#the-path-of-a-call.
"""

# The JAX versions CI tests are listed in jaxmp/engine/_tested.py; on a newer JAX the first
# autocast function built runs a small canary (jaxmp/engine/_contract.py) and warns if a rule is
# not honoured.
from jaxmp.engine._tested import TESTED_JAX
from jaxmp.engine._rules import FLOAT32_OPS, HALF_OPS
# Loaded with the package (the engine's modules register themselves as they import).
from jaxmp.engine import _build, _attention, _config, _autocast_fn, _regions, _rules  # noqa: F401

__all__ = [
    "FLOAT32_OPS",
    "HALF_OPS",
    "TESTED_JAX",
]
