"""The precision engine behind ``jaxmp.autocast``: op-level mixed precision for any JAX function.

Layers (imports flow downwards, no cycle; tests/test_architecture.py checks it): ``entry``
(the public ``autocast`` and ``engine_function``, which start the canary) -> ``contract`` (the
contract as checks, the canary) -> ``api`` (tracing and caching an engine function) ->
``interpreter`` -> ``control_flow`` (the engine) -> ``values``; ``unscaled`` (the warning for a
float16 program differentiated with no loss scale, used by ``api``) -> ``values``; ``regions``, ``modules``,
``attention`` (marking regions while tracing) -> ``config`` (policy -> settings, tracing
context) -> ``rules`` (the op lists as data).

The public names of the engine are top-level (``jaxmp.autocast``, ``jaxmp.AutocastRules``, the
regions); this namespace adds only the op lists and the tested JAX versions. The seams the Flax
integration and the diagnostics use are internal: import them from their modules
(``jaxmp.engine.entry``, ``jaxmp.engine.config``, ...), which may change without notice.
"""

from jaxmp import _deprecations

# The JAX versions CI tests are listed in jaxmp/engine/tested.py; on a newer JAX the first
# autocast function built runs a small canary (jaxmp/engine/contract.py) and warns if a rule is
# not honoured.
from jaxmp.engine.tested import TESTED_JAX
from jaxmp.engine.rules import FLOAT32_OPS, HALF_OPS
# Loaded with the package (the engine's modules register themselves as they import).
from jaxmp.engine import api, attention, config, entry, regions, rules  # noqa: F401

__all__ = [
    "FLOAT32_OPS",
    "HALF_OPS",
    "TESTED_JAX",
]

__getattr__ = _deprecations.module_getattr(__name__)
