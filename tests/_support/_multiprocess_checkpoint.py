"""Verified checkpoints of a sharded state across processes, used by the multi-process test.

Run as one of 2 processes with 2 CPU devices each (settings from the ``JAXMP_*`` environment
variables read by :func:`jaxmp.parallel.initialize_distributed`)::

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    JAXMP_COORDINATOR_ADDRESS=127.0.0.1:12345 JAXMP_NUM_PROCESSES=2 JAXMP_PROCESS_ID=0 \\
        python tests/_support/_multiprocess_checkpoint.py --workdir /tmp/run   # and PROCESS_ID=1 alongside

The state (:func:`values`) is sharded over a 2x2 mesh of the 4 global devices, one mesh row per
process, so each process writes its own shards and its own ``shards/process_<i>.json``. Both
processes, in step:

1. save steps 1 and 2 and restore the newest, verified;
2. process 1 flips one bit in a file of step 2 it wrote; both restore again: step 2 is
   rejected on both (process 1 found it), moved aside once, and step 1 restored;
3. save step 3 through a fault on process 1's write path (its pieces hashed from the intact
   state, one bit of ``w`` flipped in what reaches orbax, so its file checksums agree with the
   bad bytes); both restore: step 3 is rejected, its shard named, and step 1 restored.

Each process writes what it saw to ``<workdir>/report_<i>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any

import numpy as np

# w[FLIP] lies in the shard rows 4:8, columns 3:6 of w: process 1's (mesh row 1, column 1).
FLIP = (5, 4)
SPECS = {"w": ("a", "b"), "u": ("a",), "b": ()}  # PartitionSpecs: 4 pieces; 2 pieces x 2 copies; replicated
META = {"policy": "O2-bf16", "loss_scale": "none", "master_weights": True, "engine": "flax", "seed": 0,
        "model": "mlp", "dataset": "digits", "global_batch_size": 8, "num_train_steps": 10, "history": []}


def values(k: int) -> dict:
    """The global arrays of the state saved at step ``k``, identical on every process."""
    rng = np.random.default_rng(k)
    return {"w": rng.normal(size=(8, 6)).astype(np.float32), "u": rng.normal(size=(8, 3)).astype(np.float16),
            "b": rng.normal(size=(5,)).astype(np.float32), "step": np.int32(k)}


def flipped_w(k: int) -> np.ndarray:
    """``values(k)["w"]`` with one bit flipped at :data:`FLIP`."""
    w = values(k)["w"].copy()
    w.view(np.uint32)[FLIP] ^= 1 << 9
    return w


def _mesh():
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))  # row i: process i's devices


def state(k: int, w: np.ndarray | None = None) -> dict:
    """Step ``k``'s state as global arrays; each process supplies only its own shards."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    v = values(k)
    if w is not None:
        v["w"] = w
    out = {"step": v["step"]}
    for name, spec in SPECS.items():
        sharding = NamedSharding(_mesh(), PartitionSpec(*spec))
        out[name] = jax.make_array_from_callback(v[name].shape, sharding, lambda idx, a=v[name]: a[idx])
    return out


def template() -> dict:
    """Where to restore: the shardings the state was saved with."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    v = values(0)
    return {"step": v["step"], **{name: jax.ShapeDtypeStruct(v[name].shape, v[name].dtype,
                                                            sharding=NamedSharding(_mesh(), PartitionSpec(*spec)))
                                  for name, spec in SPECS.items()}}


def matches(restored: dict, k: int) -> bool:
    """Whether every shard this process holds equals step ``k``'s values."""
    v = values(k)
    for name, want in v.items():
        x = restored[name]
        pieces = [(s.index, s.data) for s in x.addressable_shards] if name in SPECS else [((), x)]
        if not all(np.array_equal(np.asarray(d), want[i]) for i, d in pieces):
            return False
    return True


def _restore(ckpt: Any, ckpt_lib: Any) -> tuple[int, bool, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = ckpt.restore_latest(template(), {k: META[k] for k in ckpt_lib.MUST_MATCH})
    msgs = [str(w.message) for w in caught if issubclass(w.category, ckpt_lib.CheckpointDamageWarning)]
    return r.step, matches(r.state, r.step), msgs


def _flip_one_bit_in_my_largest_file(step_dir: str, me: int) -> str:
    files = [os.path.join(root, n) for root, _, names in os.walk(os.path.join(step_dir, "state", f"ocdbt.process_{me}"))
             for n in names]
    path = max(files, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1 << 3
    with open(path, "wb") as f:
        f.write(bytes(data))
    return os.path.relpath(path, os.path.join(step_dir, "state"))


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)

    import jax
    from jax.experimental import multihost_utils

    import jaxmp

    info = jaxmp.parallel.initialize_distributed(initialization_timeout=60)
    me = info.process_index

    from experiments import checkpoint as ckpt_lib

    report: dict = {"process": me, "restores": []}
    ckpt = ckpt_lib.Checkpointer(args.workdir, max_to_keep=5)
    for k in (1, 2):
        ckpt.save(k, state(k), {**META, "data_position": k})
    report["restores"].append(_restore(ckpt, ckpt_lib))

    # 2. One bit flipped at rest in a file process 1 wrote.
    if me == 1:
        report["flipped_file"] = _flip_one_bit_in_my_largest_file(os.path.join(ckpt.directory, "2"), me)
    multihost_utils.sync_global_devices("bit flipped")
    report["restores"].append(_restore(ckpt, ckpt_lib))

    # 3. A bit flipped on process 1's write path, after its pieces were hashed.
    real = ckpt_lib.shard_records
    intact = state(3)
    # Checkpointer.save looks shard_records up in its own module (experiments/checkpoint/_checkpointer.py).
    ckpt_lib._checkpointer.shard_records = lambda s: real(ckpt_lib.saveable(intact))
    ckpt.save(3, state(3, w=flipped_w(3)), {**META, "data_position": 3})
    ckpt_lib._checkpointer.shard_records = real
    report["restores"].append(_restore(ckpt, ckpt_lib))

    multihost_utils.sync_global_devices("done")
    ckpt.close()
    with open(os.path.join(args.workdir, f"report_{me}.json"), "w") as f:
        json.dump(report, f)
    print(f"process {me}/{info.process_count}: done", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
