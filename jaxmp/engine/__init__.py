"""The precision engine behind ``jaxmp.autocast``: op-level mixed precision for any JAX function.

Layers (imports flow downwards, no cycle; tests/test_architecture.py checks it): ``entry``
(the public ``autocast`` and ``engine_function``, which start the canary) -> ``contract`` (the
contract as checks, the canary) -> ``api`` (tracing and caching an engine function) ->
``interpreter`` -> ``control_flow`` (the engine) -> ``values``; ``unscaled`` (the warning for a
float16 program differentiated with no loss scale, used by ``api``) -> ``values``; ``regions``, ``modules``,
``attention`` (marking regions while tracing) -> ``config`` (policy -> settings, tracing
context) -> ``rules`` (the op lists as data).
"""

# The JAX versions CI tests are listed in jaxmp/engine/tested.py; on a newer JAX the first
# autocast function built runs a small canary (jaxmp/engine/contract.py) and warns if a rule is
# not honoured.
from jaxmp.engine.tested import TESTED_JAX
from jaxmp.engine.api import explain_enabled
from jaxmp.engine.entry import autocast, engine_function
from jaxmp.engine.attention import routed_attention
from jaxmp.engine.config import AutocastConfig, flax_config, resolve_config
from jaxmp.engine.regions import accumulate, float32_region, half_inputs, region
from jaxmp.engine.rules import FLOAT32_OPS, HALF_OPS, PURE_HALF_RULES, AutocastRules

__all__ = [
    "FLOAT32_OPS",
    "HALF_OPS",
    "PURE_HALF_RULES",
    "TESTED_JAX",
    "AutocastConfig",
    "AutocastRules",
    "accumulate",
    "autocast",
    "engine_function",
    "explain_enabled",
    "flax_config",
    "float32_region",
    "half_inputs",
    "region",
    "resolve_config",
    "routed_attention",
]
