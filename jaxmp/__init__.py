"""jaxmp: mixed-precision training for JAX and Flax.

The public API is re-exported here; each area lives in its own module:
``policy`` (dtypes and presets), ``loss_scale`` (loss-scale pytrees),
``transform`` (the optax loss-scaling / master-weights transform), ``grad``
(scaled ``value_and_grad``), ``flax`` (Linen/NNX integration), ``parallel``
(pmap / sharded jit / multi-host) and ``diagnostics``.
"""

# --- policies (core) ---
from jaxmp.policy import FP32_CATEGORIES
from jaxmp.policy import Policy
from jaxmp.policy import Recipe
from jaxmp.policy import Recommendation
from jaxmp.policy import as_policy
from jaxmp.policy import cast_floating
from jaxmp.policy import get_policy
from jaxmp.policy import get_recipe
from jaxmp.policy import half_dtype
from jaxmp.policy import parse_dtype
from jaxmp.policy import recommended_policy

# --- loss scaling and the optax transform (core) ---

# --- flax integration (issue 3) ---

# --- data parallel and multi-host (issue 4) ---

# --- diagnostics (issue 6) ---

__version__ = "0.1.0"
