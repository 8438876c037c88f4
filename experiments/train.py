"""Training and evaluation loop: `train_and_evaluate` trains one config under one policy.

The config is read once, into a `experiments.validation.Plan` and the compiled
`experiments.program.Program`; everything after that sees only those. A run in a
workdir that holds a checkpoint resumes from its newest intact step exactly (same batches,
same dropout keys, same loss-scale counters). Metrics go to TensorBoard and ``history.jsonl``
(`experiments.metrics`), results to ``<workdir>/results.json``.

Run by ``compare.py --isolate`` as ``python -m experiments.train --job=<workdir>/job.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging

import jaxmp
import jaxmp.parallel as mpp
from experiments import checkpoint as ckpt_lib
from experiments import metrics as metrics_lib
from experiments import models as models_lib
from experiments import program as program_lib
from experiments import workdir_lock
from experiments.input_pipeline import device_batches, get_datasets, to_device
from experiments.progress import Progress
from experiments.validation import NOT_RESULT_FIELDS, Plan, UserError, flat_fields, validate_config


def say(message: str) -> None:
    """Progress messages on stderr (absl's INFO level would also show orbax's chatter)."""
    print(message, file=sys.stderr, flush=True)


class Run(NamedTuple):
    """What a run is made of, derived from the config once."""

    plan: Plan
    train_src: Any
    eval_src: Any
    prog: program_lib.Program
    meta: dict          # the settings a checkpoint must share (checkpoint.MUST_MATCH and SETTINGS)


def run_settings(config, plan: Plan) -> dict:
    """Every config value that changes what the run computes, by ``--config.<field>`` name (nested
    fields flattened, ``model_kwargs.features``), as JSON values, plus the plan's derived
    ``warmup_steps``, ``steps_per_epoch`` and ``learning_rate``. An unset ``lean_recipe`` ("") is
    left out, so a checkpoint written before that field existed still matches.

    Example:
      >>> from experiments import configs
      >>> c = configs.get_config("cpu")
      >>> s = run_settings(c, validate_config(c, num_train_examples=16000))
      >>> s["base_learning_rate"], s["model_kwargs.features"], "log_every_steps" in s
      (0.01, [32, 32, 32], False)
    """
    values = flat_fields(json.loads(config.to_json()))
    settings = {k: v for k, v in values.items() if k not in NOT_RESULT_FIELDS}
    if not settings.get("lean_recipe"):  # unset: not recorded, so checkpoints from before the field resume
        settings.pop("lean_recipe", None)
    settings.update(learning_rate=plan.learning_rate, warmup_steps=plan.warmup_steps,
                    steps_per_epoch=plan.steps_per_epoch)
    return json.loads(json.dumps(settings))  # exactly as a checkpoint's JSON gives it back


def setup_run(config, *, policy: str | None = None, seed: int | None = None) -> Run:
    """Validates ``config``, loads the data and builds (or reuses) the compiled program.

    Args:
      config: the experiment config (the only place a run reads it).
      policy: overrides ``config.policy``.
      seed: overrides ``config.seed``.
    """
    validate_config(config, policy=policy, seed=seed)  # names and devices, before loading data
    train_src, eval_src = get_datasets(config)
    plan = validate_config(config, policy=policy, seed=seed, num_train_examples=train_src.num_examples)
    try:
        module = models_lib.get_model(config.model, train_src.num_classes, **program_lib.model_kwargs(config))
    except ValueError as e:
        raise UserError(str(e)) from None
    hp = {k: config[k] for k in program_lib.OPTIMIZER_FIELDS}
    prog = program_lib.build_program(plan, module, hp, train_src.num_classes, train_src.input_key,
                                     train_src.input_shape)
    meta = {"policy": plan.policy, "loss_scale": plan.loss_scale, "master_weights": plan.master_weights,
            "engine": plan.engine, "seed": plan.seed, "model": config.model, "dataset": config.dataset,
            "global_batch_size": plan.global_batch_size, "num_train_steps": plan.num_train_steps,
            ckpt_lib.SETTINGS: run_settings(config, plan)}
    return Run(plan, train_src, eval_src, prog, meta)


class Start(NamedTuple):
    """Where a run starts: its state, step and history, and how the checkpoint's run ended, if it did."""

    state: Any
    step: int
    history: list
    finished: str | None  # "completed", "diverged" (stopped early), or None: training goes on


def restore_or_init(run: Run, ckpt: ckpt_lib.Checkpointer) -> Start:
    """The initial state, or the newest intact checkpoint's.

    Raises:
      CheckpointDamagedError: the workdir has history but no intact checkpoint.
      CheckpointMismatchError: the checkpoint is of a run with other settings.
    """
    sample = np.zeros((1, *run.train_src.input_shape), np.float32)
    state = run.prog.init(jax.random.key(run.plan.seed), sample)
    restored = ckpt.restore_latest(jax.device_get(state), run.meta)
    if restored is None:
        leftovers = [f for f in ("results.json", "history.jsonl") if os.path.exists(os.path.join(ckpt.workdir, f))]
        if leftovers:
            raise ckpt_lib.CheckpointDamagedError(
                f"{ckpt.workdir} holds {', '.join(leftovers)} of an earlier run but no checkpoint to resume "
                "from; refusing to start over on top of it. Use a new --workdir or move this one away.")
        return Start(mpp.replicate_on_mesh(state, run.prog.mesh), 0, [], None)
    finished = restored.meta.get("finished")
    if finished not in ("completed", "diverged"):
        finished = "completed" if restored.step >= run.plan.num_train_steps else None
    if finished is None:
        saved_n = (restored.meta.get(ckpt_lib.SETTINGS) or {}).get("num_devices")
        moved = (f", from {saved_n} onto {run.plan.num_devices} devices (same global batch "
                 f"{run.plan.global_batch_size})" if saved_n not in (None, run.plan.num_devices) else "")
        say(f"resumed from {ckpt.directory} at step {restored.step}{moved}")
    # The history travels inside the checkpoint, so it is exactly as of the restored step.
    history = [r for r in restored.meta["history"] if r["step"] <= restored.step]
    return Start(mpp.replicate_on_mesh(restored.state, run.prog.mesh), restored.step, history, finished)


def evaluate(run: Run, state) -> dict:
    """Accuracy and mean loss over the whole evaluation split (padding masked out)."""
    totals = {"correct": 0.0, "loss": 0.0, "count": 0.0}
    for batch in run.eval_src.eval_batches(run.plan.eval_batch_size):
        out = jax.device_get(run.prog.eval_step(state, to_device(batch, run.prog.mesh)))
        for k in totals:
            totals[k] += float(out[k])
    n = max(totals["count"], 1.0)
    return {"val_accuracy": totals["correct"] / n, "val_loss": totals["loss"] / n}


def interval_row(plan: Plan, step: int, pending: list, seconds: float) -> dict:
    """One log row from the metrics of the steps since the last one (fetched here, in one transfer).

    Besides the means, it records where the loss scale changed and which steps were skipped,
    for the loss-scale plot.
    """
    ms = jax.device_get(pending)
    first = step - len(ms) + 1
    row = {"step": step, "train_loss": float(np.mean([m["loss"] for m in ms])),
           "train_accuracy": float(np.mean([m["accuracy"] for m in ms])),
           "loss_scale": float(ms[-1]["next_loss_scale"]), "total_skips": int(ms[-1]["total_skips"]),
           "consecutive_skips": int(ms[-1]["consecutive_skips"]),
           "step_time": seconds / len(ms), "throughput": len(ms) * plan.global_batch_size / seconds}
    # A step was skipped iff the run of consecutive skips after it is non-zero.
    skipped = [first + i for i, m in enumerate(ms) if int(m["consecutive_skips"]) > 0]
    scales = [float(m["next_loss_scale"]) for m in ms]
    if skipped:
        row["skipped_at"] = skipped
    if len(set(scales)) > 1:  # (step, scale after it) where it changed, for the loss-scale plot
        row["scale_changes"] = [[first + i, x] for i, x in enumerate(scales) if i == 0 or x != scales[i - 1]]
    return row


class LoopOut(NamedTuple):
    state: Any
    step: int
    train_time: float
    compile_time: float
    compiled: Any
    diverged: bool
    batches: Any
    rng: Any


def _compile(run: Run, state, batch, rng):
    """The AOT-compiled train step (the seeds of a comparison reuse the first one's)."""
    compiled = run.prog.compiled.get("train")
    if compiled is None:
        compiled = run.prog.compiled["train"] = run.prog.train_step.lower(state, batch, rng).compile()
    return compiled


def locate_culprit(run: Run, state, batch, rng) -> str:
    """Names the op that first made inf/NaN in the train step on ``batch`` (one re-run, off the hot path).

    Called only when a run stops for consecutive skips: the step is re-evaluated op by op
    (``jaxmp.diagnostics.locate_non_finite``) so the error names the layer. A failure of the
    diagnosis is reported in the string, never raised over the divergence it explains.
    """
    from jaxmp.diagnostics import locate_non_finite

    try:
        return locate_non_finite(run.prog.train_step, state, batch, rng).summary()
    except Exception as e:  # noqa: BLE001
        return f"locating the culprit failed: {type(e).__name__}: {e}"


def _bookkeeping(run, state, step, pending, seconds, log, ckpt, t_train, locate=None) -> bool:
    """Logs, evaluates and checkpoints at ``step`` as the plan says; returns whether the run diverged.

    ``locate`` (no arguments) names the culprit op when the run diverges (see :func:`locate_culprit`).
    """
    plan = run.plan
    last = step == plan.num_train_steps
    row = interval_row(plan, step, pending, seconds)
    row["wall_time"] = time.perf_counter() - t_train  # since training started (after the compile)
    diverged = row["consecutive_skips"] > plan.max_consecutive_skips
    if diverged:
        culprit = locate() if locate is not None else None
        if culprit:
            row["culprit"] = culprit
        logging.error("%s: %d steps in a row were skipped (non-finite values); stopping (not converged).%s",
                      plan.policy, row["consecutive_skips"], f" Culprit: {culprit}." if culprit else "")
    if diverged or last or step % plan.eval_every_steps == 0:
        row.update(evaluate(run, state))
    log.write(row)
    if diverged or last or step % plan.checkpoint_every_steps == 0:
        # "finished" marks the run's last checkpoint: a rerun reads it back, never trains on from it.
        finished = {"finished": "diverged" if diverged else "completed"} if diverged or last else {}
        ckpt.save(step, state, {**run.meta, "data_position": step, "history": log.history, **finished})
        try:
            log.flush()
        except OSError as e:
            raise ckpt_lib.write_failure(ckpt.workdir, "history.jsonl", e) from e
    return diverged


def train_loop(run: Run, state, start: int, log: metrics_lib.MetricsLog, ckpt, desc: str,
               finished: str | None = None) -> LoopOut:
    """Trains from ``start`` to the plan's last step (or until the loss scale cannot recover).

    A ``finished`` run (see `Start`) is not trained: only its step is compiled, for the results.
    """
    plan, prog = run.plan, run.prog
    rng = jax.random.key(plan.seed + 1)  # dropout keys: a function of (seed, step) only
    batches = device_batches(run.train_src, plan.global_batch_size, seed=plan.seed, start=start, mesh=prog.mesh)
    t0 = time.perf_counter()
    batch = next(batches)
    compiled = _compile(run, state, batch, rng)
    compile_time = time.perf_counter() - t0
    train_time, pending, step, diverged = 0.0, [], start, finished == "diverged"
    points = {plan.log_every_steps, plan.eval_every_steps, plan.checkpoint_every_steps}
    with Progress(plan.num_train_steps, desc, initial=start, enabled=plan.progress_bar) as bar:
        t_loop = t_train = time.perf_counter()
        while step < plan.num_train_steps and not diverged and not finished:
            state, metrics = compiled(state, batch, rng)
            pending.append(metrics)
            step += 1
            last_batch = batch
            if step < plan.num_train_steps:
                batch = next(batches)
            if step < plan.num_train_steps and all(step % p for p in points):
                bar.update(1)
                continue
            jax.block_until_ready(state)  # the bookkeeping below is not training time
            seconds = time.perf_counter() - t_loop
            train_time += seconds
            diverged = _bookkeeping(run, state, step, pending, seconds, log, ckpt, t_train,
                                    locate=lambda: locate_culprit(run, state, last_batch, rng))
            pending = []
            row = log.history[-1]
            bar.update(1, loss=f"{row['train_loss']:.3f}", scale=f"{row['loss_scale']:g}", skips=row["total_skips"])
            t_loop = time.perf_counter()
    return LoopOut(state, step, train_time, compile_time, compiled, diverged, batches, rng)


def compiled_memory(compiled) -> int | None:
    """Bytes the compiled step needs per device: arguments + outputs + temporaries - aliased."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def device_peak_memory() -> int | None:
    """Peak bytes in use on the first device, where the backend reports it (GPU, TPU; not CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def dtypes_label(policy: str) -> str:
    """The table's dtypes entry of a policy: ``p=bf16,c=bf16,o=f32``, plus the fp8 recipe if any.

    The fp8 presets share O2-bf16's dtypes; without the suffix their rows would read the same.

    Args:
      policy: a policy or preset name.

    Returns:
      e.g. ``"p=bf16,c=bf16,o=f32 + fp8 delayed"`` for ``"O2-fp8"``,
      ``"p=bf16,c=bf16,o=f32 + float8_e4m3fn 1x32 blocks"`` for ``"O2-mxfp8"``.
    """
    from jaxmp import fp8

    recipe = jaxmp.get_recipe(policy)
    label = str(recipe.policy)
    if isinstance(recipe.fp8, fp8.CurrentScaling) and recipe.fp8.block is not None:  # the block presets
        block = recipe.fp8.block if recipe.fp8.block == "row" else "x".join(map(str, recipe.fp8.block))
        label += f" + {recipe.fp8.fwd_dtype} {block} blocks"
    elif recipe.fp8 is not None:
        label += " + fp8 " + ("delayed" if isinstance(recipe.fp8, fp8.DelayedScaling) else "current")
    return label


def summarize(run: Run, out: LoopOut, start: int, history: list[dict], t_start: float) -> dict:
    """The results of a run: timings, memory, accuracy, skipped steps, loss scale and the history."""
    plan, steps_run = run.plan, out.step - start
    final = history[-1] if history else {}
    stats = jax.device_get(jaxmp.scaling_stats(out.state.opt_state))
    mem_device, mem_compiled = device_peak_memory(), compiled_memory(out.compiled)
    per_s = (lambda n: n / out.train_time) if out.train_time > 0 else (lambda n: float("nan"))
    return {
        "diverged": out.diverged, "policy": plan.policy, "seed": plan.seed,
        "dtypes": dtypes_label(plan.policy), "num_classes": run.train_src.num_classes,
        "loss_scaling": plan.loss_scale, "master_weights": plan.master_weights,
        "config": {"model": run.meta["model"], "dataset": run.meta["dataset"], **plan._asdict()},
        "device": f"{plan.num_devices} x {jax.devices()[0].device_kind}",
        "steps": int(out.step), "steps_this_run": int(steps_run), "resumed_from": int(start),
        "wall_time_s": time.perf_counter() - t_start, "compile_time_s": out.compile_time,
        "train_time_s": out.train_time, "steps_per_s": per_s(steps_run),
        "examples_per_s": per_s(steps_run * plan.global_batch_size),
        "peak_memory_bytes": mem_device if mem_device is not None else mem_compiled,
        "memory_source": ("device.memory_stats() peak_bytes_in_use" if mem_device is not None
                          else "compiled train step, memory_analysis() (args + outputs + temps)"),
        "compiled_step_memory_bytes": mem_compiled,
        "val_accuracy": final.get("val_accuracy"), "val_loss": final.get("val_loss"),
        "train_loss": final.get("train_loss"), "skipped_steps": int(stats["total_skips"]),
        "final_loss_scale": float(stats["loss_scale"]), "settings": run.meta[ckpt_lib.SETTINGS],
        "history": history,
    }


def train_and_evaluate(config, workdir: str, *, policy: str | None = None, seed: int | None = None,
                       report: bool = False, desc: str | None = None) -> dict:
    """Trains ``config`` under one policy in ``workdir`` (resuming if it holds a checkpoint).

    Args:
      config: the experiment config.
      workdir: checkpoints, metrics (TensorBoard, ``history.jsonl``) and ``results.json`` go here.
      policy: overrides ``config.policy``.
      seed: overrides ``config.seed``.
      report: also run jaxmp's diagnostics and write ``report.txt``.
      desc: progress label.

    The workdir is locked for the run (`experiments.workdir_lock`). A workdir whose newest
    checkpoint ends a run -- completed, or stopped because it diverged -- is read back
    (``results.json``), never trained on; its checkpoint's settings must match ``config`` all
    the same.

    Returns:
      The results dict (also written to ``<workdir>/results.json``); ``"reused": True`` when read back.

    Raises:
      UserError: a bad config (``WorkdirBusyError``: another run holds the workdir;
        ``CheckpointMismatchError``: the checkpoint is of a run with other settings, each named).
      CheckpointWriteError: a checkpoint or results file could not be written (a full disk...).
    """
    t_start = time.perf_counter()
    metrics_lib.preload()
    run = setup_run(config, policy=policy, seed=seed)
    plan = run.plan
    say(f"{plan.policy} (loss scale {plan.loss_scale}, master weights {plan.master_weights}), seed {plan.seed}: "
        f"{plan.num_devices} device(s) x {plan.per_device_batch_size} = global batch {plan.global_batch_size}, "
        f"lr {plan.learning_rate:.4g}, warm-up {plan.warmup_steps} of {plan.num_train_steps} steps")
    os.makedirs(workdir, exist_ok=True)
    with workdir_lock.locked(workdir):
        return _train_locked(run, workdir, report, desc, t_start)


def _read_back(path: str, steps: int) -> dict | None:
    """A finished run's results.json, if it is one (intact, and of the checkpoint's last step)."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and result.get("steps") == steps else None


def _train_locked(run: Run, workdir: str, report: bool, desc: str | None, t_start: float) -> dict:
    """`train_and_evaluate` with the workdir locked."""
    plan = run.plan
    done = os.path.join(workdir, "results.json")
    ckpt = ckpt_lib.Checkpointer(workdir, max_to_keep=plan.keep_checkpoints)
    try:
        start = restore_or_init(run, ckpt)
        if start.finished:
            # Finished before (completed, or stopped because it diverged): report what that run
            # measured -- its checkpoint's settings were just checked against this config.
            result = _read_back(done, start.step)
            if result is not None:
                say(f"{plan.policy} seed {plan.seed}: finished before ({start.finished} at step {start.step}); "
                    f"read back from {done}, not retrained")
                return {**result, "reused": True}
        log = metrics_lib.MetricsLog(workdir, start.history)
        try:
            out = train_loop(run, start.state, start.step, log, ckpt, desc or f"{plan.policy} seed {plan.seed}",
                             finished=start.finished)
        finally:
            log.close()
    finally:
        ckpt.close()
    result = summarize(run, out, start.step, log.history, t_start)
    if report:
        from experiments.report import run_report

        result["report"] = run_report(run.prog, out.compiled, out.state, out.batches, out.rng, plan.policy, workdir)
    try:  # replaced whole: a reader never sees half a file
        with open(done + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(done + ".tmp", done)
    except OSError as e:
        raise ckpt_lib.write_failure(workdir, "results.json", e) from e
    return result


def summary_line(r: dict) -> str:
    """One line per run for the console."""
    acc = "n/a" if r["val_accuracy"] is None else f"{100 * r['val_accuracy']:.2f}%"
    return (f"{r['policy']} seed {r['seed']}: val accuracy {acc}, {r['steps']} steps, "
            f"{r['steps_per_s']:.1f} steps/s, {r['examples_per_s']:.0f} examples/s, wall {r['wall_time_s']:.1f} s, "
            f"skipped {r['skipped_steps']}, loss scale {r['final_loss_scale']:g}"
            + (" (DIVERGED)" if r.get("diverged") else ""))


def _job_main(argv) -> None:
    """``python -m experiments.train --job=job.json``: one run of a comparison, in its own process."""
    from absl import flags

    del argv  # cli.run rejects extra arguments
    from experiments import jobs

    if not flags.FLAGS.job:
        raise UserError("--job=<path> is required: a job file written by python -m experiments.compare "
                        "--isolate=true (to train a config, use python -m experiments.main).")
    job = jobs.read_job(flags.FLAGS.job)
    from experiments import cli

    cli.quiet_tensorflow(job["config"])
    logging.set_verbosity(logging.WARNING)
    res = train_and_evaluate(job["config"], job["workdir"], policy=job["policy"], seed=job["seed"],
                             report=job["report"], desc=job["desc"])
    print(summary_line(res))


if __name__ == "__main__":
    from absl import flags

    from experiments import cli

    flags.DEFINE_string("job", None, "A job file written by `python -m experiments.compare --isolate=true` "
                        "(JSON: config, workdir, policy, seed, desc, report).")
    cli.run(_job_main, parse=False)
