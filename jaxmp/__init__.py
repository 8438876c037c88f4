"""jaxmp: mixed-precision training for JAX and Flax.

The core API is re-exported here; each area lives in its own module:
``dtypes`` (dtype names, casting floating leaves), ``policy`` (the ``Policy`` record),
``presets`` (O0-O3 / Keras recipes, the policy-string parser), ``engine`` (the op-level precision
engine behind ``autocast``, which the Flax integration runs through too), ``platform`` (per-device
recommendation), ``loss_scale`` (loss-scale pytrees), ``skip`` (the skip-on-non-finite
select), ``transform`` (the optax loss-scaling and master-weights transforms), ``grad``
(scaled ``value_and_grad``), ``flax`` (Linen/NNX integration), ``parallel``
(pmap / sharded jit / multi-host), ``lean`` (memory-lean optimizer recipes: stochastic rounding,
param remainders) and ``diagnostics``.
"""

import importlib as _importlib
import warnings as _warnings

from jaxmp import fp8
from jaxmp import lean
from jaxmp import parallel
from jaxmp.diagnostics import GradientStats
from jaxmp.diagnostics import GroupStats
from jaxmp.diagnostics import MatmulOp
from jaxmp.diagnostics import PipelineOverhead
from jaxmp.diagnostics import PrecisionReport
from jaxmp.diagnostics import RiskyOp
from jaxmp.diagnostics import gradient_stats
from jaxmp.diagnostics import input_pipeline_overhead
from jaxmp.diagnostics import precision_report
from jaxmp.dtypes import cast_floating
from jaxmp.dtypes import cast_to_full
from jaxmp.dtypes import cast_to_half
from jaxmp.dtypes import half_dtype
from jaxmp.dtypes import parse_dtype
from jaxmp.grad import value_and_grad
from jaxmp.loss_scale import DynamicLossScale
from jaxmp.loss_scale import LossScale
from jaxmp.loss_scale import NoOpLossScale
from jaxmp.loss_scale import StaticLossScale
from jaxmp.loss_scale import make_loss_scale
from jaxmp.platform import Recommendation
from jaxmp.platform import recommended_policy
from jaxmp.policy import Policy
from jaxmp.presets import FP32_CATEGORIES
from jaxmp.presets import Recipe
from jaxmp.presets import as_policy
from jaxmp.presets import get_policy
from jaxmp.presets import get_recipe
from jaxmp.presets import resolve_policy
from jaxmp.skip import all_finite
from jaxmp.skip import keep_if_finite
from jaxmp.skip import select_tree
from jaxmp.opt_state import TrainingDivergedError
from jaxmp.opt_state import apply_updates
from jaxmp.opt_state import check_health
from jaxmp.opt_state import find_loss_scaling_state
from jaxmp.opt_state import first_non_finite
from jaxmp.opt_state import get_loss_scale
from jaxmp.opt_state import last_step_finite
from jaxmp.opt_state import master_params
from jaxmp.opt_state import scaling_stats
from jaxmp.opt_state import skipped_steps
from jaxmp.transform import LossScalingState
from jaxmp.transform import MasterWeightsState
from jaxmp.transform import loss_scaling
from jaxmp.transform import master_weights
from jaxmp.transform import unscale_and_skip
from jaxmp.traps import MixedPrecisionWarning

from jaxmp.engine import AutocastRules
from jaxmp.engine import autocast
from jaxmp.engine import accumulate
from jaxmp.engine import float32_region
from jaxmp.engine import half_inputs
from jaxmp.engine import region as autocast_region

__version__ = "0.1.0"

# Imported on first use (see __getattr__ below): flax.nnx pulls in IPython and costs ~2 s.
_LAZY_FLAX = ("PrecisionOverrides", "TrainState", "mixed_precision")

__all__ = [
    # policies
    "FP32_CATEGORIES",
    "Policy",
    "Recipe",
    "Recommendation",
    "as_policy",
    "cast_floating",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "get_recipe",
    "half_dtype",
    "parse_dtype",
    "recommended_policy",
    "resolve_policy",
    # loss scales and the optax transforms
    "DynamicLossScale",
    "LossScale",
    "LossScalingState",
    "MasterWeightsState",
    "MixedPrecisionWarning",
    "NoOpLossScale",
    "StaticLossScale",
    "TrainingDivergedError",
    "all_finite",
    "apply_updates",
    "check_health",
    "find_loss_scaling_state",
    "first_non_finite",
    "get_loss_scale",
    "last_step_finite",
    "loss_scaling",
    "keep_if_finite",
    "make_loss_scale",
    "master_params",
    "master_weights",
    "scaling_stats",
    "select_tree",
    "skipped_steps",
    "unscale_and_skip",
    "value_and_grad",
    # op-level autocast (the precision engine)
    "AutocastRules",
    "autocast",
    "accumulate",
    "autocast_region",
    "float32_region",
    "half_inputs",
    # diagnostics
    "GradientStats",
    "GroupStats",
    "MatmulOp",
    "PipelineOverhead",
    "PrecisionReport",
    "RiskyOp",
    "gradient_stats",
    "input_pipeline_overhead",
    "precision_report",
    # subpackages and lazily imported Flax names
    "flax",
    "fp8",
    "lean",
    "parallel",
    *_LAZY_FLAX,
]


# The names that were top level before jaxmp.parallel existed (newer ones, e.g. the state
# layouts, were never top level and get no forwarding).
_MOVED_TO_PARALLEL = frozenset({
    "DistributedInfo", "all_reduce_gradients", "batch_sharding", "check_replicated", "distributed_info",
    "initialize_distributed", "is_replicated", "make_data_mesh", "make_global_batch", "make_pmap_train_step",
    "make_sharded_train_step", "per_device_batch_size", "prefetch_to_device", "prefetch_to_mesh",
    "process_batch_slice", "process_dataset_range", "replicate", "replicate_on_mesh", "replicated_sharding",
    "shard_batch", "unreplicate", "unshard_batch",
})


def __getattr__(name):
    if name == "flax" or name in _LAZY_FLAX:
        module = _importlib.import_module("jaxmp.flax")
        return module if name == "flax" else getattr(module, name)
    if name in _MOVED_TO_PARALLEL:
        # Data-parallel plumbing lives under jaxmp.parallel; the top-level names stay one release.
        _warnings.warn(f"jaxmp.{name} moved to jaxmp.parallel.{name}; the top-level name will be removed "
                       "in the next release", DeprecationWarning, stacklevel=2)
        return getattr(parallel, name)
    raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | set(globals()))
