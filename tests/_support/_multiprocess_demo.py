"""A small data-parallel training run used by the multi-process test and the docs.

Run as one of several processes (settings from the ``JAXMP_*`` environment variables read by
:func:`jaxmp.parallel.initialize_distributed`)::

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    JAXMP_COORDINATOR_ADDRESS=127.0.0.1:12345 JAXMP_NUM_PROCESSES=2 JAXMP_PROCESS_ID=0 \\
        python tests/_support/_multiprocess_demo.py --out /tmp/run   # and PROCESS_ID=1 alongside

Each process builds the same global data set from a seed but keeps only its own rows of each
global batch (:func:`jaxmp.parallel.process_batch_slice`), trains a tiny MLP with the sharded-jit and/or
the pmap step (``--paths``), and writes its final params and loss-scaling counters to
``<out>/process_<i>.npz``. One step has a NaN planted in the last process's rows, so every
process must skip it. :func:`train` is also called in-process by the test to get the
single-process reference on the same number of devices.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

# The demo's problem, shared with the test that compares against it.
IN_DIM, HIDDEN, GLOBAL_BATCH, STEPS, NAN_STEP = 5, 16, 32, 6, 3


def make_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The whole data set (``STEPS`` global batches), identical on every process.

    Returns:
      ``(x, y)`` of shapes ``[STEPS, GLOBAL_BATCH, IN_DIM]`` and ``[STEPS, GLOBAL_BATCH]``,
      float32, with a NaN in the last row of step ``NAN_STEP`` (i.e. in the last process's and
      the last device's shard).
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(STEPS, GLOBAL_BATCH, IN_DIM)).astype(np.float32)
    y = (np.sin(x.sum(-1)) + 0.1 * rng.normal(size=(STEPS, GLOBAL_BATCH))).astype(np.float32)
    x[NAN_STEP, -1, 0] = np.nan
    return x, y


def init_params(seed: int = 0) -> dict:
    """A two-layer MLP's params (float32 host arrays)."""
    rng = np.random.default_rng(seed + 1)
    return {
        "w1": (rng.normal(size=(IN_DIM, HIDDEN)) / np.sqrt(IN_DIM)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def loss_fn(params: Any, batch: Any) -> Any:
    """Mean squared error of the MLP, in float32."""
    import jax.numpy as jnp

    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    pred = (h @ params["w2"] + params["b2"])[..., 0]
    return jnp.mean((pred - batch["y"]) ** 2)


def make_tx(axis_name: Any = None) -> Any:
    """Adam under dynamic loss scaling (float32 here: the scale is a power of two, so exact)."""
    import optax

    import jaxmp

    return jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**15, period=2), axis_name=axis_name)


def train(path: str, devices: Any = None, seed: int = 0) -> dict:
    """Trains ``STEPS`` steps on this process's rows and returns params and counters as numpy.

    Args:
      path: ``"sharded"`` (jit over a mesh of ``devices``) or ``"pmap"`` (over this process's
        devices, or ``devices`` when given in a single-process run).
      devices: the devices to use; default all of them.
      seed: data and init seed.

    Returns:
      ``{"w1": ..., ..., "total_skips": int, "loss_scale": float, "loss": [per step]}``.
    """
    import jax

    import jaxmp

    x, y = make_data(seed)
    params = init_params(seed)
    rows = jaxmp.parallel.process_batch_slice(GLOBAL_BATCH)
    losses = []
    if path == "sharded":
        mesh = jaxmp.parallel.make_data_mesh(devices)
        tx = make_tx(None)
        step = jaxmp.parallel.make_sharded_train_step(loss_fn, tx, mesh)
        p, s = jaxmp.parallel.replicate_on_mesh((params, tx.init(params)), mesh)
        for t in range(STEPS):
            batch = jaxmp.parallel.make_global_batch({"x": x[t, rows], "y": y[t, rows]}, mesh)
            p, s, m = step(p, s, batch)
            losses.append(float(np.asarray(m["loss"].addressable_shards[0].data)))
        out = {k: np.asarray(v.addressable_shards[0].data) for k, v in p.items()}
        stats = jaxmp.scaling_stats(s)
        out["total_skips"] = int(np.asarray(stats["total_skips"].addressable_shards[0].data))
        out["loss_scale"] = float(np.asarray(stats["loss_scale"].addressable_shards[0].data))
    elif path == "pmap":
        local = None if devices is None else list(devices)
        n = jax.local_device_count() if local is None else len(local)
        tx = make_tx("batch")
        step = jaxmp.parallel.make_pmap_train_step(loss_fn, tx, "batch", devices=local)
        p, s = jaxmp.parallel.replicate(params, local), jaxmp.parallel.replicate(tx.init(params), local)
        for t in range(STEPS):
            p, s, m = step(p, s, jaxmp.parallel.shard_batch({"x": x[t, rows], "y": y[t, rows]}, n))
            losses.append(float(jaxmp.parallel.unreplicate(m["loss"])))
        jaxmp.parallel.check_replicated((p, s), num_replicas=n)
        out = {k: np.asarray(v) for k, v in jaxmp.parallel.unreplicate(p).items()}
        stats = jaxmp.parallel.unreplicate(jaxmp.scaling_stats(s))
        out["total_skips"] = int(stats["total_skips"])
        out["loss_scale"] = float(stats["loss_scale"])
    else:
        raise ValueError(f"path must be 'sharded' or 'pmap', got {path!r}")
    out["loss"] = np.asarray(losses)
    return out


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for process_<i>.npz")
    parser.add_argument("--paths", default="sharded,pmap", help="comma-separated: sharded, pmap")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]

    import jax

    import jaxmp

    info = jaxmp.parallel.initialize_distributed(initialization_timeout=60)
    results = {}
    for path in paths:
        for k, v in train(path).items():
            results[f"{path}/{k}"] = v
    results["process_count"] = info.process_count
    results["device_count"] = jax.device_count()
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"process_{info.process_index}.npz"), **results)
    print(f"process {info.process_index}/{info.process_count}: done", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
