"""ZeRO-sharded training across processes, checkpointed, killed and resumed (the multi-process test).

Run as one of 2 processes with 2 CPU devices each (the ``JAXMP_*`` environment variables of
:func:`jaxmp.parallel.initialize_distributed`)::

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
    JAXMP_COORDINATOR_ADDRESS=127.0.0.1:12345 JAXMP_NUM_PROCESSES=2 JAXMP_PROCESS_ID=0 \\
        python tests/_support/_multiprocess_zero.py --workdir /tmp/run --out /tmp/run/final.npz   # and PROCESS_ID=1

An O2-bf16 MLP with AdamW and float32 masters trains ``STEPS`` steps with ``layout="zero"`` over
the 4 global devices: every process holds its devices' slices of the masters and moments. A NaN
in process 1's rows at ``NAN_STEP`` makes every device skip that step. The state is saved at
``SAVE_AT`` through the experiments' ``Checkpointer`` (each process writes and checksums its
own shards). ``--kill-after K`` has both processes SIGKILL themselves after step K (after the
save, before the end); ``--resume`` restores the latest step and trains to the end. With
``--out``, process 0 writes the final state (gathered to the host) as ``.npz``.

:func:`resume_here` resumes the same checkpoint in *one* process onto any number of local
devices: it restores straight into the layout on the new mesh (orbax reads each device's
block; a saved piece that lies across several of this process's blocks is joined and
verified), so no whole copy of the state is made on the way.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import numpy as np

IN_DIM, HIDDEN, OUT_DIM, GLOBAL_BATCH, STEPS, SAVE_AT, NAN_STEP = 8, 32, 4, 8, 6, 3, 1
META = {"policy": "O2-bf16", "loss_scale": "dynamic", "master_weights": True, "engine": "sharded-zero", "seed": 0,
        "model": "mlp", "dataset": "synthetic", "global_batch_size": GLOBAL_BATCH, "num_train_steps": STEPS,
        "history": []}


def init_params() -> dict:
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    return {"w1": jnp.asarray(rng.normal(size=(IN_DIM, HIDDEN)) / 3, jnp.bfloat16),
            "b1": jnp.zeros(HIDDEN, jnp.bfloat16),
            "w2": jnp.asarray(rng.normal(size=(HIDDEN, OUT_DIM)) / 6, jnp.bfloat16)}


def loss_fn(p: Any, b: Any) -> Any:
    import jax.numpy as jnp

    h = jnp.tanh(b["x"].astype(jnp.bfloat16) @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)


def make_tx() -> Any:
    import optax

    import jaxmp

    return jaxmp.loss_scaling(optax.adamw(1e-2), jaxmp.DynamicLossScale(2.0**15, period=2), master_weights=True)


def global_batch(t: int) -> dict:
    """Step ``t``'s global batch, the same on every process; a NaN in the last row at ``NAN_STEP``."""
    rng = np.random.default_rng(100 + t)
    x = rng.normal(size=(GLOBAL_BATCH, IN_DIM)).astype(np.float32)
    y = rng.normal(size=(GLOBAL_BATCH, OUT_DIM)).astype(np.float32)
    if t == NAN_STEP:
        x[-1, 0] = np.nan   # the last process's, the last device's rows
    return {"x": x, "y": y}


def _step(mesh):
    import jaxmp

    return jaxmp.parallel.make_sharded_train_step(loss_fn, make_tx(), mesh, layout="zero", min_shard_size=0)


def _flat(state: Any) -> dict:
    import jax

    return {f"l{i:03d}": x for i, x in enumerate(jax.tree_util.tree_leaves(state))}


def _unflat(flat: dict, like: Any) -> Any:
    import jax

    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), [flat[k] for k in sorted(flat)])


def template(mesh, layout: str) -> dict:
    """The restore target: the state's leaves as ``ShapeDtypeStruct`` with the layout's shardings on ``mesh``."""
    import jaxmp

    params = init_params()
    return _flat(jaxmp.parallel.abstract_state((params, make_tx().init(params)), mesh, layout, min_shard_size=0))


def train(state: Any, mesh, start: int, stop: int, ckpt: Any = None, kill_after: int | None = None) -> tuple:
    """Steps ``start .. stop - 1`` on this process's rows; saves after step ``SAVE_AT - 1``."""
    import jaxmp

    step = _step(mesh)
    p, s = state
    rows = jaxmp.parallel.process_batch_slice(GLOBAL_BATCH)
    finite = []
    for t in range(start, stop):
        local = {k: v[rows] for k, v in global_batch(t).items()}
        p, s, m = step(p, s, jaxmp.parallel.make_global_batch(local, mesh))
        finite.append(bool(m["last_step_finite"]))
        if ckpt is not None and t + 1 == SAVE_AT:
            ckpt.save(SAVE_AT, _flat((p, s)), {**META, "data_position": SAVE_AT})
        if kill_after is not None and t + 1 == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)   # no clean-up, no flush: a crash
    return (p, s), finite


def host_state(state: Any) -> dict:
    """The whole state as host arrays on every process (sharded leaves gathered)."""
    import jax
    from jax.experimental import multihost_utils

    return {k: np.asarray(multihost_utils.process_allgather(x, tiled=True)) if isinstance(x, jax.Array)
            and not x.is_fully_addressable else np.asarray(jax.device_get(x)) for k, x in _flat(state).items()}


def resume_here(workdir: str, devices: Any, layout: str = "zero") -> tuple[dict, int]:
    """Resumes ``workdir``'s checkpoint in this (single) process on ``devices`` and trains to the end.

    Returns:
      ``(final host state, resumed step)``.
    """
    import jaxmp
    from experiments import checkpoint as ckpt_lib

    mesh = jaxmp.parallel.make_data_mesh(devices)
    ckpt = ckpt_lib.Checkpointer(workdir, max_to_keep=3)
    try:
        restored = ckpt.restore_latest(template(mesh, layout), {k: META[k] for k in ckpt_lib.MUST_MATCH})
    finally:
        ckpt.close()
    params = init_params()
    state = _unflat(restored.state, (params, make_tx().init(params)))
    # Already in the layout on this mesh: shard_state checks it and moves nothing.
    state = jaxmp.parallel.shard_state(state, mesh, layout, min_shard_size=0)
    state, _ = train(state, mesh, restored.step, STEPS)
    return host_state(state), restored.step


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out")
    parser.add_argument("--kill-after", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    import jax
    from jax.experimental import multihost_utils

    import jaxmp

    info = jaxmp.parallel.initialize_distributed(initialization_timeout=60)
    from experiments import checkpoint as ckpt_lib

    mesh = jaxmp.parallel.make_data_mesh()
    ckpt = ckpt_lib.Checkpointer(args.workdir, max_to_keep=3)
    start = 0
    if args.resume:
        restored = ckpt.restore_latest(template(mesh, "zero"), {k: META[k] for k in ckpt_lib.MUST_MATCH})
        params = init_params()
        state = _unflat(restored.state, (params, make_tx().init(params)))
        start = restored.step
        master = jaxmp.master_params(state[1])["w1"]
        # Restored straight into the ZeRO layout: this process holds its 2 devices' quarters.
        assert [sh.data.shape for sh in master.addressable_shards] == [(IN_DIM, HIDDEN // 4)] * 2
    else:
        params = init_params()
        state = jaxmp.parallel.shard_state((params, make_tx().init(params)), mesh, "zero", min_shard_size=0)
    state, finite = train(state, mesh, start, STEPS, ckpt=None if args.resume else ckpt, kill_after=args.kill_after)
    final = host_state(state)
    multihost_utils.sync_global_devices("done")
    ckpt.close()
    if args.out and info.process_index == 0:
        # bfloat16 as float32 (exact): .npz has no bfloat16.
        wide = {k: v.astype(np.float32) if v.dtype.name == "bfloat16" else v for k, v in final.items()}
        np.savez(args.out, **wide, finite=np.asarray(finite), start=start)
    print(f"process {info.process_index}/{info.process_count}: done from step {start}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
