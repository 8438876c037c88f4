"""The precision engine behind ``jaxmp.autocast``: op-level mixed precision for any JAX function.

Layers (imports flow downwards): ``api`` (the public function, tracing and caching) ->
``interpreter`` + ``control_flow`` (the engine) -> ``regions``, ``modules``, ``attention``
(marking regions while tracing) -> ``config`` (policy -> settings, tracing context) ->
``rules`` (the op lists as data).
"""

from jaxmp.engine.api import autocast
from jaxmp.engine.attention import routed_attention
from jaxmp.engine.config import AutocastConfig, resolve_config
from jaxmp.engine.regions import float32_region, half_inputs, region
from jaxmp.engine.rules import FLOAT32_OPS, HALF_OPS, PURE_HALF_RULES, AutocastRules

__all__ = [
    "FLOAT32_OPS",
    "HALF_OPS",
    "PURE_HALF_RULES",
    "AutocastConfig",
    "AutocastRules",
    "autocast",
    "float32_region",
    "half_inputs",
    "region",
    "resolve_config",
    "routed_attention",
]
