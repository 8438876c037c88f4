"""The all-gathers of a ZeRO step, counted per dtype from the program XLA partitions.

Shared by tests/parallel/test_gather_dtypes.py (jaxmp gathers half params as half) and
benchmarks/_o2_prediction.py (the wire bytes a bf16 gather saves). The count is read by
``benchmarks/_wire_bytes.py`` before XLA:CPU widens bf16 collectives to float32 (its
``all-reduce-promotion`` and ``float-normalization-bf16`` passes; the final CPU HLO shows float32
gathers for both).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np

import jaxmp
# The one reader of the partitioned program's collectives (every kind, per step); kept importable
# from here for this module's callers.
from benchmarks._wire_bytes import gathers  # noqa: F401

BF16 = jnp.bfloat16
WIDTH = 128   # 128 x 128 weights: sharded over 8 devices (min_shard_size 1024)
LAYERS = 2


def loss(p, b):
    x = b["x"]
    for i in range(LAYERS):
        x = jnp.tanh((x.astype(BF16) @ p[f"w{i}"]).astype(jnp.float32))
    return jnp.mean(x ** 2)


def setup():
    mesh = jaxmp.parallel.make_data_mesh()
    params = {f"w{i}": jnp.zeros((WIDTH, WIDTH), BF16) for i in range(LAYERS)}
    batch = jaxmp.parallel.make_global_batch({"x": np.ones((16, WIDTH), np.float32)}, mesh)
    return mesh, params, batch



def hand_written_zero_gathers() -> collections.Counter:
    """The gathers of a hand-written ZeRO step on `setup`'s model.

    What a user writes: bf16 params replicated, float32 masters and AdamW state on slices, the
    new params cast from the updated masters and replicated (XLA gathers the float32 master)."""
    from benchmarks import _gpt2

    mesh, params, batch = setup()
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    jitted, (p, m, o) = _gpt2.hand_written_step(loss, abstract, mesh, "zero", None)
    return gathers(jitted.lower(p, m, o, batch))
