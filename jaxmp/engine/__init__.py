"""The precision engine behind ``jaxmp.autocast``: op-level mixed precision for any JAX function.

Layers (imports flow downwards): ``api`` (the public function, tracing and caching) ->
``interpreter`` + ``control_flow`` (the engine) -> ``regions``, ``modules``, ``attention``
(marking regions while tracing) -> ``config`` (policy -> settings, tracing context) ->
``rules`` (the op lists as data).
"""

import warnings as _warnings

import jax as _jax

# The engine reads jaxprs and a few internals whose form changes between JAX releases: CI runs
# jax 0.10; the suite (all but the experiments and docs tests) passed on jax 0.11.2 on the GPU machine
# (benchmarks/results/jax_0.11.2_tests_h100.txt).
TESTED_JAX = ((0, 10), (0, 12))
if not TESTED_JAX[0] <= tuple(int(p) for p in _jax.__version__.split(".")[:2]) < TESTED_JAX[1]:
    _warnings.warn(f"jaxmp.autocast is tested with jax>={'.'.join(map(str, TESTED_JAX[0]))},<"
                   f"{'.'.join(map(str, TESTED_JAX[1]))}; this is jax {_jax.__version__}", RuntimeWarning, stacklevel=2)

from jaxmp.engine.api import autocast  # noqa: E402
from jaxmp.engine.attention import routed_attention  # noqa: E402
from jaxmp.engine.config import AutocastConfig, flax_config, resolve_config  # noqa: E402
from jaxmp.engine.regions import float32_region, half_inputs, region  # noqa: E402
from jaxmp.engine.rules import FLOAT32_OPS, HALF_OPS, PURE_HALF_RULES, AutocastRules  # noqa: E402

__all__ = [
    "FLOAT32_OPS",
    "HALF_OPS",
    "PURE_HALF_RULES",
    "AutocastConfig",
    "AutocastRules",
    "autocast",
    "flax_config",
    "float32_region",
    "half_inputs",
    "region",
    "resolve_config",
    "routed_attention",
]
