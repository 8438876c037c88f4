"""Fault drill of the quantized collectives (issue 63): poisoned gradients and a kill mid-save.

  python -m experiments.wire_drill                          # 1000 steps, 5% poisoned, every option (minutes)
  python -m experiments.wire_drill --steps 50 --kills 0     # the version the tests run

Under ZeRO and FSDP (8 simulated CPU devices), for each option of
``make_sharded_train_step`` (none; ``gather_bits=8``; ``reduce_bits=8``; ``reduce_bits=4``;
``gather_bits=8, reduce_bits=4``), a small MLP whose leaves cover every way a gradient is reduced
(split and reduce-scattered, replicated and quantized-all-reduced, replicated and all-reduced in
float32) trains with AdamW, float32 masters and a dynamic loss scale:

* **nan**: in ``--rate`` of the steps one example of one device's shard (device ``step % 8``) is
  NaN or inf (alternately). Every poisoned step must be skipped on every device, leave every
  state leaf bitwise unchanged except the loss-scaling counters, and the copies of every leaf
  (one a device for a replicated leaf, one per slice for a split one) stay bitwise equal; no leaf
  ends non-finite.
* **kill** (under ``gather_bits=8, reduce_bits=4``: both quantizers): a child process trains
  ``--kill-steps`` steps with an orbax checkpoint every 5 steps (asynchronous saves); it is
  SIGKILLed while a save is in flight (orbax's temporary directory exists), started again,
  resumes from the newest finished checkpoint and finishes; its final state must be bitwise the
  state of an uninterrupted run.

Prints one row per check (PASS/FAIL) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

OPTIONS = ((None, None), (8, None), (None, 8), (None, 4), (8, 4))
LAYOUTS = ("zero", "fsdp")
N = 8
BATCH = 32
#: Leaves a skipped step is meant to change: the loss-scaling state's bookkeeping.
BOOKKEEPING = ("loss_scale", "last_step_finite", "consecutive_skips", "total_skips", "skip_reason")


def _env() -> None:
    if "jax" not in sys.modules:  # the simulated devices, before JAX starts its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N}").strip()


def params():
    """The MLP: ``w1``/``w2`` split, ``e`` replicated and large enough for a quantized all-reduce, ``b1`` small."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    bf16 = jnp.bfloat16
    return {"w1": jnp.asarray(rng.normal(size=(16, 512)) / 4, bf16), "b1": jnp.zeros(512, bf16),
            "w2": jnp.asarray(rng.normal(size=(512, 8)) / 8, bf16), "e": jnp.asarray(rng.normal(size=(7, 300)) / 4, bf16)}


def loss(p, b):
    import jax.numpy as jnp

    x = b["x"].astype(p["w1"].dtype)
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    side = jnp.tanh(x[:, :7] @ p["e"]).astype(jnp.float32)
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2) + 0.1 * jnp.mean(side ** 2)


def tx():
    import optax

    import jaxmp

    return jaxmp.loss_scaling(optax.adamw(1e-3), jaxmp.DynamicLossScale(2.0 ** 15, period=50), master_weights=True)


def batch(t: int, poison: float | None = None) -> dict:
    """Step ``t``'s batch (a pure function of ``t``); ``poison`` puts that value in one example of device ``t % 8``'s rows."""
    import numpy as np

    rng = np.random.default_rng([1, t])
    x = rng.normal(size=(BATCH, 16)).astype(np.float32)
    if poison is not None:
        x[(t % N) * (BATCH // N) + 1, 2] = poison
    with np.errstate(invalid="ignore"):  # sin(inf): that target is NaN too, the same fault
        return {"x": x, "y": np.sin(x[:, :8] * 2).astype(np.float32)}


def make_step(layout: str, gather_bits, reduce_bits):
    import jax

    import jaxmp

    return jaxmp.parallel.make_sharded_train_step(loss, tx(), jaxmp.parallel.make_data_mesh(jax.devices()[:N]),
                                                  layout=layout, gather_bits=gather_bits, reduce_bits=reduce_bits)


def _named_bytes(state) -> dict:
    import jax
    import numpy as np

    return {jax.tree_util.keystr(p): np.asarray(x).tobytes()
            for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(state))}


def _copies_equal(state) -> bool:
    """Every leaf's copies of the same slice (``shard.index``) are bitwise equal across devices."""
    import jax
    import numpy as np

    for leaf in jax.tree_util.tree_leaves(state):
        seen: dict = {}
        for s in leaf.addressable_shards:
            if seen.setdefault(str(s.index), np.asarray(s.data).tobytes()) != np.asarray(s.data).tobytes():
                return False
    return True


def nan_drill(layout: str, gather_bits, reduce_bits, steps: int, rate: float, seed: int) -> dict:
    """Poisoned gradients in ``rate`` of ``steps`` steps under one option; the table row."""
    import jax
    import numpy as np

    import jaxmp

    step = make_step(layout, gather_bits, reduce_bits)
    t_ = tx()
    p, s = jaxmp.parallel.shard_state((params(), t_.init(params())), step.layout)
    faulty = set(np.random.default_rng(seed).choice(steps, max(1, round(rate * steps)), replace=False).tolist())
    skipped = other_skips = 0
    changed: list[str] = []
    split_verdicts = 0
    for t in range(steps):
        poison = (np.nan if t % 2 else np.inf) if t in faulty else None
        before = _named_bytes((p, s)) if poison is not None else None
        p, s, m = step(p, s, jaxmp.parallel.make_global_batch(batch(t, poison), step.mesh))
        verdicts = {bool(sh.data) for sh in m["last_step_finite"].addressable_shards}
        split_verdicts += len(verdicts) > 1
        finite = verdicts.pop()
        if before is not None:
            skipped += not finite
            after = _named_bytes((p, s))
            changed += [k for k in before if before[k] != after[k] and not any(b in k for b in BOOKKEEPING)]
        else:
            other_skips += not finite
    bad = [jax.tree_util.keystr(q) for q, x in jax.tree_util.tree_leaves_with_path(jax.device_get((p, s)))
           if np.issubdtype(np.asarray(x).dtype, np.inexact) and not np.all(np.isfinite(np.asarray(x)))]
    equal = _copies_equal((p, s))
    result = (f"{skipped}/{len(faulty)} poisoned steps skipped, {len(changed)} leaves changed by them, {len(bad)} "
              f"non-finite leaves, copies bitwise equal: {'yes' if equal else 'NO'}, {split_verdicts} split verdicts "
              f"({other_skips} other skips)")
    ok = skipped == len(faulty) and not changed and not bad and equal and not split_verdicts
    return {"drill": "nan", "check": f"{layout} gather_bits={gather_bits} reduce_bits={reduce_bits}, {steps} steps, "
            f"{len(faulty)} poisoned", "result": result, "ok": ok}


# ---- kill: a child trains with orbax checkpoints, the parent kills it mid-save ----


def _child(args) -> int:
    """Trains ``args.kill_steps`` steps from the newest checkpoint in ``args.workdir`` (or from the
    start), an asynchronous orbax save every 5 steps, and writes the final state's bytes."""
    import numpy as np
    import orbax.checkpoint as ocp

    import jaxmp

    step = make_step(args.layouts, args.gather_bits, args.reduce_bits)
    t_ = tx()
    p, s = jaxmp.parallel.shard_state((params(), t_.init(params())), step.layout)
    target = jaxmp.parallel.abstract_state((p, s), step.layout)
    options = ocp.CheckpointManagerOptions(save_interval_steps=5, max_to_keep=None, enable_async_checkpointing=True)
    with ocp.CheckpointManager(os.path.join(args.workdir, "ckpt"), options=options) as mgr:
        start = mgr.latest_step() or 0
        if start:
            restored = mgr.restore(start, args=ocp.args.StandardRestore({"params": target[0], "opt_state": target[1]}))
            p, s = restored["params"], restored["opt_state"]
            print(f"resumed at step {start}", flush=True)
        for t in range(start, args.kill_steps):
            p, s, _ = step(p, s, jaxmp.parallel.make_global_batch(batch(t), step.mesh))
            mgr.save(t + 1, args=ocp.args.StandardSave({"params": p, "opt_state": s}))
        mgr.wait_until_finished()
    leaves = _named_bytes((p, s))
    np.savez(os.path.join(args.workdir, "final.npz"), **{str(i): np.frombuffer(v, np.uint8)
                                                         for i, v in enumerate(leaves.values())})
    return 0


def _start(workdir: str, layout: str, gather_bits, reduce_bits, steps: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "experiments.wire_drill", "--child", f"--workdir={workdir}", f"--layouts={layout}",
           f"--kill-steps={steps}"]
    cmd += [f"--gather-bits={gather_bits}"] if gather_bits else []
    cmd += [f"--reduce-bits={reduce_bits}"] if reduce_bits else []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log = open(os.path.join(workdir, "log.txt"), "a")
    return subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT)


def kill_drill(layout: str, gather_bits, reduce_bits, steps: int, workdir: str) -> dict:
    """An uninterrupted child, then one SIGKILLed mid-save and restarted; the final states compared."""
    import numpy as np

    ref, cut = os.path.join(workdir, "ref"), os.path.join(workdir, "cut")
    os.makedirs(ref)
    os.makedirs(cut)
    check = f"{layout} gather_bits={gather_bits} reduce_bits={reduce_bits}, {steps} steps"
    if _start(ref, layout, gather_bits, reduce_bits, steps).wait() != 0:
        return {"drill": "kill", "check": check, "result": "the uninterrupted run failed (see its log.txt)", "ok": False}
    proc, ckdir, where = _start(cut, layout, gather_bits, reduce_bits, steps), os.path.join(cut, "ckpt"), "none"
    while proc.poll() is None:  # kill while a save past the first is in flight
        entries = os.listdir(ckdir) if os.path.isdir(ckdir) else []
        if any("tmp" in e and e.split(".")[0].isdigit() and int(e.split(".")[0]) >= 10 for e in entries):
            proc.send_signal(signal.SIGKILL)
            where = "mid-save"
        time.sleep(0.0005)
    if proc.wait() != -signal.SIGKILL:
        return {"drill": "kill", "check": check, "result": "the run finished before the kill", "ok": False}
    if _start(cut, layout, gather_bits, reduce_bits, steps).wait() != 0:
        return {"drill": "kill", "check": check, "result": "the resumed run failed (see its log.txt)", "ok": False}
    log = open(os.path.join(cut, "log.txt")).read()
    resumed = [line for line in log.splitlines() if line.startswith("resumed at step")]
    a, b = np.load(os.path.join(ref, "final.npz")), np.load(os.path.join(cut, "final.npz"))
    equal = sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)
    return {"drill": "kill", "check": check + f", SIGKILL {where}",
            "result": f"{resumed[-1] if resumed else 'did not resume'}; final state bitwise equal to the "
                      f"uninterrupted run: {'yes' if equal else 'NO'}", "ok": bool(resumed) and equal}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--steps", type=int, default=1000, help="steps of the poisoned run (default 1000)")
    parser.add_argument("--rate", type=float, default=0.05, help="fraction of poisoned steps (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the poisoned steps' positions")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of zero, fsdp")
    parser.add_argument("--kills", type=int, default=1, help="0: no kill drill; else one kill a layout, under "
                        "gather_bits=8 and reduce_bits=4 together")
    parser.add_argument("--kill-steps", type=int, default=40, help="steps of the killed run (default 40)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a new temporary one)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gather-bits", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reduce-bits", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def run(args) -> list[dict]:
    """Every check the flags ask for; the rows."""
    import jax

    layouts = [x for x in args.layouts.split(",") if x]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        raise SystemExit(f"--layouts: unknown {', '.join(unknown)}: choose from {', '.join(LAYOUTS)}")
    if not 0 < args.rate <= 0.5 or args.steps < 0:
        raise SystemExit(f"--rate must be in (0, 0.5] and --steps >= 0 (0: no poisoned run), got {args.rate}, {args.steps}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxmp_wire_drill_")
    rows = []
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW: Python float ** int32 count
        for layout in layouts if args.steps else ():
            for g, r in OPTIONS:
                rows.append(nan_drill(layout, g, r, args.steps, args.rate, args.seed))
                print(rows[-1], flush=True)
    for layout in layouts if args.kills else ():
        for g, r in OPTIONS[-1:]:  # both quantizers at once: a child start costs a compile
            rows.append(kill_drill(layout, g, r, args.kill_steps, os.path.join(workdir, f"kill_{layout}_{g}_{r}")))
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    """Runs the drill and prints its table.

    Args:
      argv: the command-line arguments (``--help``).

    Returns:
      The exit status: 0 when every check passed.
    """
    args = build_parser().parse_args(argv)
    _env()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if args.child:
        import jax

        with jax.numpy_dtype_promotion("standard"):
            return _child(args)
    from experiments.fault_drill import format_table

    t0 = time.perf_counter()
    rows = run(args)
    print(format_table(rows))
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} checks passed in {time.perf_counter() - t0:.0f} s.")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
