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
from jaxmp.grad import value_and_grad
from jaxmp.loss_scale import DynamicLossScale
from jaxmp.loss_scale import LossScale
from jaxmp.loss_scale import NoOpLossScale
from jaxmp.loss_scale import StaticLossScale
from jaxmp.loss_scale import all_finite
from jaxmp.loss_scale import make_loss_scale
from jaxmp.loss_scale import select_tree
from jaxmp.policy import cast_to_full
from jaxmp.policy import cast_to_half
from jaxmp.transform import LossScalingState
from jaxmp.transform import TrainingDivergedError
from jaxmp.transform import apply_updates
from jaxmp.transform import check_health
from jaxmp.transform import find_loss_scaling_state
from jaxmp.transform import get_loss_scale
from jaxmp.transform import last_step_finite
from jaxmp.transform import loss_scaling
from jaxmp.transform import master_params
from jaxmp.transform import scaling_stats
from jaxmp.transform import skipped_steps

# --- op-level autocast (the precision engine) ---
from jaxmp.engine import AutocastRules
from jaxmp.engine import autocast
from jaxmp.engine import float32_region
from jaxmp.engine import half_inputs
from jaxmp.engine import region as autocast_region

# --- flax integration (issue 3) ---
# Imported on first use (see __getattr__ below): flax.nnx pulls in IPython and costs ~2 s.
_LAZY_FLAX = ("PrecisionOverrides", "TrainState", "mixed_precision")

# --- data parallel and multi-host (issue 4) ---
from jaxmp.parallel import DistributedInfo
from jaxmp.parallel import all_reduce_gradients
from jaxmp.parallel import batch_sharding
from jaxmp.parallel import check_replicated
from jaxmp.parallel import distributed_info
from jaxmp.parallel import initialize_distributed
from jaxmp.parallel import is_replicated
from jaxmp.parallel import make_data_mesh
from jaxmp.parallel import make_global_batch
from jaxmp.parallel import make_pmap_train_step
from jaxmp.parallel import make_sharded_train_step
from jaxmp.parallel import per_device_batch_size
from jaxmp.parallel import prefetch_to_device
from jaxmp.parallel import prefetch_to_mesh
from jaxmp.parallel import process_batch_slice
from jaxmp.parallel import process_dataset_range
from jaxmp.parallel import replicate
from jaxmp.parallel import replicate_on_mesh
from jaxmp.parallel import replicated_sharding
from jaxmp.parallel import shard_batch
from jaxmp.parallel import unreplicate
from jaxmp.parallel import unshard_batch

# --- diagnostics (issue 6) ---
from jaxmp.diagnostics import GradientStats
from jaxmp.diagnostics import GroupStats
from jaxmp.diagnostics import MatmulOp
from jaxmp.diagnostics import PipelineOverhead
from jaxmp.diagnostics import PrecisionReport
from jaxmp.diagnostics import RiskyOp
from jaxmp.diagnostics import gradient_stats
from jaxmp.diagnostics import input_pipeline_overhead
from jaxmp.diagnostics import precision_report

__version__ = "0.1.0"


def __getattr__(name):
    if name == "flax" or name in _LAZY_FLAX:
        import importlib

        module = importlib.import_module("jaxmp.flax")
        return module if name == "flax" else getattr(module, name)
    raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"flax", *_LAZY_FLAX})
