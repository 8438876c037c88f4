"""The checks of ``python -m experiments.fault_drill``; each returns table rows
``{"drill", "check", "result", "ok"}`` (see that module for what each proves)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from experiments import checkpoint as ckpt_lib
from experiments import configs as configs_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Leaves of the loss-scaling state that a skipped step is meant to change.
_SKIP_BOOKKEEPING = ("loss_scale", "last_step_finite", "consecutive_skips", "total_skips", "skip_reason")


def _row(drill: str, check: str, result: str, ok: bool) -> dict:
    return {"drill": drill, "check": check, "result": result, "ok": bool(ok)}


def states_equal(a, b) -> bool:
    """Whether two state pytrees have the same paths, dtypes and bytes."""
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    if [p for p, _ in la] != [p for p, _ in lb]:
        return False
    return all(np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
               for (_, x), (_, y) in zip(la, lb))


# ---- overflow: no loss scale can die ----


def overflow_drill(mode: str, overflows: int, recover_within: int = 10) -> dict:
    """``overflows`` steps with infinite gradients, then finite ones, under loss scale ``mode``."""
    import optax

    import jaxmp

    params = {"w": jnp.ones((4,), jnp.float32)}
    tx = jaxmp.loss_scaling(optax.sgd(0.1), mode)

    @jax.jit
    def step(params, opt_state, blowup):
        loss_fn = lambda p: jnp.sum(p["w"] * blowup)  # noqa: E731 - d/dw = blowup (inf: overflow)
        _, grads = jaxmp.value_and_grad(loss_fn, opt_state)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jaxmp.apply_updates(params, updates, opt_state), opt_state

    state, lowest = tx.init(params), float("inf")
    for _ in range(overflows):
        params, state = step(params, state, jnp.float32(jnp.inf))
        lowest = min(lowest, float(jaxmp.scaling_stats(state)["loss_scale"]))
    before, applied_after = jax.device_get(params), None
    for i in range(recover_within):
        params, state = step(params, state, jnp.float32(1.0))
        if bool(jaxmp.scaling_stats(state)["last_step_finite"]):
            applied_after = i + 1
            break
    scale = float(jaxmp.scaling_stats(state)["loss_scale"])
    healthy = np.isfinite(lowest) and lowest >= np.finfo(np.float32).tiny and np.isfinite(scale) and scale > 0
    moved = not states_equal(before, jax.device_get(params))
    ok = healthy and applied_after is not None and moved and bool(jnp.all(jnp.isfinite(params["w"])))
    result = (f"lowest scale {lowest:g}; " + (f"updates applied again after {applied_after} finite step(s)"
                                             if applied_after else f"no update applied in {recover_within} finite steps"))
    return _row("overflow", f"{mode}: {overflows} consecutive overflows", result, ok)


# ---- nan: injected faults are skipped without a trace ----


def _fault_config(policy: str, devices: int, steps: int):
    c = configs_lib.get_config("cpu")
    c.policy, c.num_devices, c.per_device_batch_size, c.num_train_steps = policy, devices, 32, steps
    c.progress_bar = False
    return c


def _changed_leaves(before, after) -> list[str]:
    out = []
    for (path, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(before),
                                 jax.tree_util.tree_leaves_with_path(after)):
        name = jax.tree_util.keystr(path)
        if not any(k in name for k in _SKIP_BOOKKEEPING) and np.asarray(x).tobytes() != np.asarray(y).tobytes():
            out.append(name)
    return out


def _replicas_equal(state) -> bool:
    for leaf in jax.tree_util.tree_leaves(state):
        shards = [np.asarray(s.data).tobytes() for s in leaf.addressable_shards]
        if any(s != shards[0] for s in shards):
            return False
    return True


def nan_drill(policy: str, steps: int, rate: float, devices: int, seed: int) -> dict:
    """NaN/Inf in one example of the first replica's rows in ``rate`` of ``steps`` steps."""
    import jaxmp.parallel as mpp
    from experiments import train
    from experiments.input_pipeline import to_device

    run = train.setup_run(_fault_config(policy, devices, steps))
    key, mesh = run.train_src.input_key, run.prog.mesh
    state = mpp.replicate_on_mesh(run.prog.init(jax.random.key(0), np.zeros((1, *run.train_src.input_shape),
                                                                            np.float32)), mesh)
    faulty = set(np.random.default_rng(seed).choice(steps, max(1, round(rate * steps)), replace=False).tolist())
    batches, rng = run.train_src.train_batches(run.plan.global_batch_size, seed=0), jax.random.key(1)
    skipped, changed, other_skips = 0, [], 0
    for i in range(steps):
        batch = next(batches)
        if i in faulty:
            x = batch[key].copy()
            x[0] = np.nan if i % 2 else np.inf
            batch, before = {**batch, key: x}, jax.device_get(state)
        state, m = run.prog.train_step(state, to_device(batch, mesh), rng)
        was_skipped = int(m["consecutive_skips"]) > 0
        if i in faulty:
            skipped += was_skipped
            changed += _changed_leaves(before, jax.device_get(state))
        else:
            other_skips += was_skipped
    bad = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(state))
           if np.issubdtype(np.asarray(x).dtype, np.inexact) and not np.all(np.isfinite(np.asarray(x)))]
    equal = _replicas_equal(state)
    result = (f"{skipped}/{len(faulty)} faulty steps skipped, {len(changed)} leaves changed by them, "
              f"{len(bad)} corrupted leaves, replicas bitwise equal: {'yes' if equal else 'NO'}"
              f" ({other_skips} other skips)")
    return _row("nan", f"{policy}, {devices} devices, {steps} steps, NaN/Inf in {len(faulty)}", result,
                skipped == len(faulty) and not changed and not bad and equal)


# ---- damage: a damaged checkpoint is named, skipped and never loaded ----


def _damage_config(**over):
    c = configs_lib.get_config("cpu")
    c.policy, c.num_train_steps, c.checkpoint_every_steps, c.eval_every_steps = "O2-fp16", 30, 10, 30
    c.log_every_steps, c.keep_checkpoints, c.progress_bar = 10, 5, False
    for k, v in over.items():
        c[k] = v
    return c


def _array_files(step_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True), key=os.path.getsize)


def _garble(step_dir, rs):
    f = _array_files(step_dir)[-1]
    data = bytearray(open(f, "rb").read())
    at = len(data) // 3
    data[at:at + 4096] = rs.bytes(len(data[at:at + 4096]))
    open(f, "wb").write(bytes(data))


def _truncate(step_dir, rs):
    f = _array_files(step_dir)[-1]
    os.truncate(f, os.path.getsize(f) // 2)


def _edit_meta(step_dir, rs):
    path = os.path.join(step_dir, "meta", "metadata")
    meta = json.load(open(path))
    meta["data_position"] = 999
    json.dump(meta, open(path, "w"))


DAMAGE = {
    "garble 4 KiB of the largest array file": _garble,
    "truncate the largest array file to half": _truncate,
    "delete an array file": lambda d, rs: os.remove(_array_files(d)[-1]),
    "empty the OCDBT manifest (state/manifest.ocdbt)": lambda d, rs: open(os.path.join(d, "state", "manifest.ocdbt"), "w").close(),
    "delete orbax's state/_METADATA": lambda d, rs: os.remove(os.path.join(d, "state", "_METADATA")),
    "delete the step's state/ directory": lambda d, rs: shutil.rmtree(os.path.join(d, "state")),
    "delete the checksum manifest": lambda d, rs: shutil.rmtree(os.path.join(d, "manifest")),
    "delete the metadata (meta/)": lambda d, rs: shutil.rmtree(os.path.join(d, "meta")),
    "edit metadata: data_position 30 -> 999": _edit_meta,
}


def _resume_damaged(ref: str, workdir: str, damage, rs, config) -> tuple[dict | None, list[str], str]:
    """Copies the reference run, damages its step 30, resumes; returns (results, warnings, error)."""
    from experiments import train

    shutil.copytree(ref, workdir)
    damage(os.path.join(workdir, "checkpoints", "30"), rs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result, error = train.train_and_evaluate(config, workdir), ""
        except ckpt_lib.UserError as e:
            result, error = None, f"{type(e).__name__}: {e}"
    msgs = [str(w.message) for w in caught if issubclass(w.category, ckpt_lib.CheckpointDamageWarning)]
    return result, msgs, error


def _one_damage(name, damage, ref, ref_state, workdir, rs, config) -> dict:
    result, msgs, error = _resume_damaged(ref, workdir, damage, rs, config)
    if result is None:
        return _row("damage", name, f"stopped: {error[:120]}", False)
    what = re.search(r"DAMAGED \((.*?)\); moved", msgs[0]).group(1) if msgs else "not detected"
    what = re.sub(r"/d/[0-9a-f]{32}", "/d/<hash>", what)
    equal = states_equal(ckpt_lib.load_state(workdir, 30)[1], ref_state)
    ok = bool(msgs) and "step 30" in msgs[0] and result["resumed_from"] == 20 and equal
    return _row("damage", name, f"step 30: {what[:64]}; resumed from {result['resumed_from']}; final state bitwise equal: "
                f"{'yes' if equal else 'NO'}", ok)


def _bitflips(n, ref, ref_state, workdir, rs, config) -> dict:
    detected = harmless = wrong = 0
    for k in range(n):
        def flip(step_dir, rs):
            files = _array_files(step_dir)
            sizes = np.array([os.path.getsize(f) for f in files], np.float64)
            f = files[rs.choice(len(files), p=sizes / sizes.sum())]
            data = bytearray(open(f, "rb").read())
            at = int(rs.integers(len(data)))
            data[at] ^= 1 << int(rs.integers(8))
            open(f, "wb").write(bytes(data))

        result, msgs, _ = _resume_damaged(ref, f"{workdir}_{k}", flip, rs, config)
        equal = result is not None and states_equal(ckpt_lib.load_state(f"{workdir}_{k}", 30)[1], ref_state)
        if msgs and equal:
            detected += 1
        elif equal:
            harmless += 1  # the flip hit bytes that do not change any value
        else:
            wrong += 1
    return _row("damage", f"1-bit flips in array files x {n}", f"{detected} detected and recovered, {harmless} "
                f"changed no value (state intact), {wrong} wrong", wrong == 0 and detected > 0)


def _refusals(ref: str, workdir: str) -> list[dict]:
    """Resumes that must stop with a clear error instead of loading anything."""
    from experiments import train

    rows = []
    cases = (("resume under another policy (O2-bf16)", _damage_config(policy="O2-bf16"), "policy", None),
             ("resume under another loss-scale mode (torch)", _damage_config(loss_scale="torch"), "loss_scale", None),
             ("every step damaged (manifests deleted)", _damage_config(), "no intact checkpoint", "all"))
    for i, (name, config, expect, damage) in enumerate(cases):
        wd = f"{workdir}_{i}"
        shutil.copytree(ref, wd)
        if damage == "all":
            for d in glob.glob(os.path.join(wd, "checkpoints", "*", "manifest")):
                shutil.rmtree(d)
        before = sorted(os.listdir(os.path.join(wd, "checkpoints")))
        try:
            train.train_and_evaluate(config, wd)
            rows.append(_row("damage", name, "accepted silently", False))
            continue
        except ckpt_lib.UserError as e:
            msg = str(e).replace(os.path.join(wd, "checkpoints"), "<workdir>/checkpoints")
        kept = sorted(os.listdir(os.path.join(wd, "checkpoints"))) == before
        rows.append(_row("damage", name, f"clear error: {msg[:100]}...; checkpoints untouched: "
                         f"{'yes' if kept else 'NO'}", expect in msg and kept))
    return rows


def damage_drill(workdir: str, bitflips: int, seed: int) -> list[dict]:
    """Every kind of damage to the newest step of a finished 30-step run, then a resume."""
    from experiments import train

    rs = np.random.default_rng(seed)
    ref = os.path.join(workdir, "reference")
    shutil.rmtree(workdir, ignore_errors=True)
    train.train_and_evaluate(_damage_config(), ref)
    ref_state = ckpt_lib.load_state(ref, 30)[1]
    rows = [_one_damage(name, fn, ref, ref_state, os.path.join(workdir, f"d{i}"), rs, _damage_config())
            for i, (name, fn) in enumerate(DAMAGE.items())]
    rows.append(_bitflips(bitflips, ref, ref_state, os.path.join(workdir, "flip"), rs, _damage_config()))
    return rows + _refusals(ref, os.path.join(workdir, "refuse"))


# ---- kill: SIGKILL at random points, mid-save included ----

KILL_ARGS = ("--config=cpu", "--config.policy=O2-fp16", "--config.checkpoint_every_steps=10",
             "--config.eval_every_steps=100", "--config.log_every_steps=10",
             "--config.keep_checkpoints=1000", "--config.progress_bar=false")


def _start(workdir: str, log: str, steps: int) -> subprocess.Popen:
    out = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "experiments.main", *KILL_ARGS, f"--config.num_train_steps={steps}",
                             f"--workdir={workdir}"],
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def _finalized(ckdir: str) -> list[int]:
    return sorted(int(e) for e in (os.listdir(ckdir) if os.path.isdir(ckdir) else []) if e.isdigit())


def _kill_once(workdir: str, log: str, mid_save: bool, target: int, rs, steps: int) -> str:
    """Starts the run and SIGKILLs it once a checkpoint >= ``target`` is written (mid-save: while
    one is being written) plus a random delay; returns where the kill landed."""
    ckdir, proc = os.path.join(workdir, "checkpoints"), _start(workdir, log, steps)
    listing = lambda: set(os.listdir(ckdir)) if os.path.isdir(ckdir) else set()  # noqa: E731
    before = listing()  # leftovers of earlier kills are not this run's saves
    while proc.poll() is None:
        new = listing() - before
        if mid_save and any(".orbax-checkpoint-tmp" in e and int(e.split(".")[0]) >= target for e in new):
            proc.send_signal(signal.SIGKILL)
        elif not mid_save and any(e.isdigit() and int(e) >= target for e in new):
            time.sleep(float(rs.uniform(0, 0.1)))  # somewhere in the steps after that checkpoint
            proc.send_signal(signal.SIGKILL)
        time.sleep(0.0005)
    if proc.wait() != -signal.SIGKILL:
        return "finished before the kill"
    return "mid-save" if any(".orbax-checkpoint-tmp" in e for e in listing() - before) else "between saves"


def _resume_steps(logs: list[str]) -> list[int]:
    out = []
    for log in logs:
        m = re.search(r"resumed from .* at step (\d+)", open(log).read())
        out.append(int(m.group(1)) if m else 0)
    return out


def kill_drill(workdir: str, kills: int, seed: int, steps: int = 300) -> dict:
    """``kills`` SIGKILLs of one ``steps``-step run (a checkpoint every 10 steps; ``steps`` a
    multiple of 10, at least 40); every checkpoint left compared with an uninterrupted run."""
    if steps % 10 or steps < 40:
        raise ValueError(f"kill_drill: steps={steps}: use a multiple of 10 (a checkpoint every 10 steps), at least 40")
    rs = np.random.default_rng(seed)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    ref, cut = os.path.join(workdir, "uninterrupted"), os.path.join(workdir, "killed")
    if _start(ref, os.path.join(workdir, "ref.log"), steps).wait() != 0:
        return _row("kill", "uninterrupted reference run", open(os.path.join(workdir, "ref.log")).read()[-300:], False)
    plan = sorted(rs.choice(np.arange(20, steps - 10, 10), kills, replace=False).tolist()) if kills else []
    kinds = []
    for k, planned in enumerate(plan):
        newest = (_finalized(os.path.join(cut, "checkpoints")) or [0])[-1]
        target = min(max(planned, newest + 10), steps - 10)
        kinds.append(_kill_once(cut, os.path.join(workdir, f"kill{k}.log"), k % 3 == 0, target, rs, steps))
    last = _start(cut, os.path.join(workdir, "final.log"), steps).wait()
    resumes = _resume_steps([os.path.join(workdir, f"kill{k}.log") for k in range(1, kills)]
                            + [os.path.join(workdir, "final.log")])
    steps_saved = _finalized(os.path.join(cut, "checkpoints"))
    equal = sum(states_equal(ckpt_lib.load_state(cut, s)[1], ckpt_lib.load_state(ref, s)[1]) for s in steps_saved)
    ok = (last == 0 and equal == len(steps_saved) and steps_saved and steps_saved[-1] == steps
          and "finished before the kill" not in kinds and all(r > 0 for r in resumes))
    return _row("kill", f"SIGKILL x {kills} ({kinds.count('mid-save')} mid-save) of a {steps}-step run",
                f"resumed at steps {resumes}; {equal}/{len(steps_saved)} checkpoints bitwise equal to the "
                "uninterrupted run", ok)
