"""Data-parallel and multi-host training with loss scaling that every replica agrees on.

Two paths, same semantics and results:

* [`make_sharded_train_step`][jaxmp.parallel.make_sharded_train_step] -- plain ``jax.jit`` over a mesh with a data axis (JAX's
  recommended path; runs unchanged on several hosts), with the state replicated or sharded
  over the data axis (``layout="zero"`` / ``"fsdp"``; [`shard_state`][jaxmp.parallel.shard_state]);
* [`make_pmap_train_step`][jaxmp.parallel.make_pmap_train_step] -- ``jax.pmap`` with an explicit gradient all-reduce whose
  dtype you choose (float32 by default).

Plus `Checkpointer` (orbax, with a checksum of every saved piece checked on restore),
replication helpers, batch splitting (per device and per process), prefetching and
`initialize_distributed` for multi-host runs. Lower-level helpers (``leaf_spec``,
``batch_sharding``, ...) live in this package's modules and are not public API. See the README
section "Data-parallel and multi-host training".
"""

from jaxmp.parallel._batching import prefetch_to_device
from jaxmp.parallel._batching import process_batch_slice
from jaxmp.parallel._batching import process_dataset_range
from jaxmp.parallel._batching import shard_batch
from jaxmp.parallel._checkpoint import Checkpointer
from jaxmp.parallel._distributed import DistributedInfo
from jaxmp.parallel._distributed import distributed_info
from jaxmp.parallel._distributed import initialize_distributed
from jaxmp.parallel._layouts import abstract_state
from jaxmp.parallel._layouts import shard_state
from jaxmp.parallel._layouts import state_bytes_per_device
from jaxmp.parallel._layouts import state_shardings
from jaxmp.parallel._per_layer import gather_params
from jaxmp.parallel._per_layer import remat_policy as remat_policy  # its docstring example imports it here
from jaxmp.parallel._per_layer import scan_layers
from jaxmp._scaling._collectives import all_reduce_gradients
from jaxmp.parallel._pmap import make_pmap_train_step
from jaxmp.parallel._replication import check_replicated
from jaxmp.parallel._replication import replicate
from jaxmp.parallel._replication import unreplicate
from jaxmp.parallel._sharding import make_data_mesh
from jaxmp.parallel._sharding import make_global_batch
from jaxmp.parallel._sharding import make_sharded_train_step
from jaxmp.parallel._sharding import replicate_on_mesh
from jaxmp.parallel._sharding import replicated_sharding

__all__ = [
    "Checkpointer",
    "DistributedInfo",
    "abstract_state",
    "all_reduce_gradients",
    "check_replicated",
    "distributed_info",
    "gather_params",
    "initialize_distributed",
    "make_data_mesh",
    "make_global_batch",
    "make_pmap_train_step",
    "make_sharded_train_step",
    "prefetch_to_device",
    "process_batch_slice",
    "process_dataset_range",
    "replicate",
    "replicate_on_mesh",
    "replicated_sharding",
    "scan_layers",
    "shard_batch",
    "shard_state",
    "state_bytes_per_device",
    "state_shardings",
    "unreplicate",
]
