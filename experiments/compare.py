"""Compares precision policies on one config: a table, plots and TensorBoard runs.

  python -m experiments.compare --config=experiments/configs/cpu.py --workdir=/tmp/jaxmp_compare

Trains the same config under every policy of ``config.compare_policies`` (or
--policies=O0,O2-fp16) and ``config.num_seeds`` seeds (or --seeds=N), then prints the table
(policy, wall time, steps/s, examples/s, peak memory, validation accuracy mean +- std over
seeds, skipped steps, final loss scale) and writes results.{json,csv,md} and the plots
accuracy_loss.png, loss_scale.png and throughput_memory.png to the workdir. With
--scale_demo (default) one more short O2-fp16 run starts from a high loss scale and grows it
often, so loss_scale.png shows dynamic scaling at work. Each run lives in
<workdir>/runs/<name> and resumes like main.py; a finished run -- completed, or stopped because
it diverged -- is read back, never retrained, so running the same command again leaves the
results as they were (a run whose settings differ from the config is refused, naming each field).
The workdir is locked while the command runs (see experiments/workdir_lock.py).
tensorboard --logdir=<workdir>/runs shows every run's curves side by side.

On backends that report allocator statistics (GPU, TPU) every run gets its own process
(--isolate, the default there): a peak-memory counter cannot be reset inside one process.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

from absl import flags, logging

from experiments import cli, workdir_lock

cli.define_flags()
flags.DEFINE_list("policies", None, "Policies to compare (default: config.compare_policies), e.g. O0,O2-bf16.")
flags.DEFINE_integer("seeds", None, "Seeds per policy (default: config.num_seeds); accuracy is mean +- std.",
                     lower_bound=1)
flags.DEFINE_enum("isolate", "auto", ["auto", "true", "false"],
                  "Run each training in its own process (auto: where device memory statistics exist).")
flags.DEFINE_bool("plots", True, "Write the PNG plots.")
flags.DEFINE_bool("scale_demo", True, "Also train a short O2-fp16 run from loss scale 2**24 with growth every "
                  "50 steps, drawn in loss_scale.png (skipped steps marked).")
FLAGS = flags.FLAGS

DEMO = {"policy": "O2-fp16", "loss_scale": "dynamic", "dynamic_scale_init": 2.0**24, "dynamic_scale_period": 50,
        "num_train_steps": 300, "eval_every_steps": 100, "checkpoint_every_steps": 300, "log_every_steps": 25}


def _run_isolated(config, workdir: str, policy: str, seed: int, desc: str, report: bool) -> dict:
    """Runs one training in a fresh Python process and reads its results.json."""
    import json

    from experiments import jobs

    from experiments.validation import RunFailedError

    os.makedirs(workdir, exist_ok=True)
    job = os.path.join(workdir, "job.json")
    jobs.write_job(job, config, workdir=workdir, policy=policy, seed=seed, desc=desc, report=report)
    path = os.path.join(workdir, "results.json")
    before = open(path, "rb").read() if os.path.exists(path) else None
    proc = subprocess.run([sys.executable, "-m", "experiments.train", f"--job={job}"], cwd=os.getcwd())
    if proc.returncode == 2:  # the run refused its input; its message says why
        raise cli.UserError(f"the {policy} seed {seed} run was refused (see its error above)")
    if proc.returncode:
        raise RunFailedError(f"the {policy} seed {seed} run failed (exit {proc.returncode}); see its output above")
    with open(path, "rb") as f:
        after = f.read()
    return {**json.loads(after), "reused": after == before}


def _train(config, workdir, policy, seed, desc, report, isolated) -> dict:
    from experiments import train

    if isolated:
        return _run_isolated(config, workdir, policy, seed, desc, report)
    return train.train_and_evaluate(config, workdir, policy=policy, seed=seed, report=report, desc=desc)


def demo_config(config):
    """``config`` changed into the loss-scale demonstration run (see `DEMO`)."""
    demo = config.copy_and_resolve_references()
    with demo.unlocked():
        for k, v in DEMO.items():
            demo[k] = v
    return demo


def compare(config, workdir: str, *, policies=None, num_seeds: int | None = None, isolate: str = "auto",
            plots: bool = True, report: bool = False, config_name: str = "", scale_demo: bool = False) -> dict:
    """Trains every (policy, seed), writes the table and plots; returns ``{"rows", "runs", "paths"}``.

    Args:
      config: the experiment config.
      workdir: where runs, tables and plots go.
      policies: default ``config.compare_policies``.
      num_seeds: default ``config.num_seeds``.
      isolate: ``"auto"``, ``"true"`` or ``"false"`` (see the module docstring).
      plots: write the PNGs.
      report: run jaxmp's diagnostics for each run.
      config_name: for the title.
      scale_demo: also train the loss-scale demonstration run.
    """
    from experiments import metrics
    from experiments import train
    from experiments.validation import validate_config

    metrics.preload()
    if policies is not None and not list(policies):
        raise cli.UserError("--policies is empty: name the policies to compare, e.g. --policies=O0,O2-bf16 "
                            "(or leave it out for config.compare_policies).")
    policies = list(policies or config.compare_policies)
    num_seeds = int(config.num_seeds if num_seeds is None else num_seeds)
    if num_seeds < 1:
        raise cli.UserError(f"--seeds={num_seeds} is invalid: use an integer >= 1.")
    for p in policies:
        validate_config(config, policy=p)
    isolated = (train.device_peak_memory() is not None) if isolate == "auto" else isolate == "true"
    with workdir_lock.locked(workdir):
        return _compare_locked(config, workdir, policies, num_seeds, isolated, plots, report, config_name, scale_demo)


def _compare_locked(config, workdir, policies, num_seeds, isolated, plots, report, config_name, scale_demo) -> dict:
    from experiments import train
    from experiments.progress import Progress

    seeds = [int(config.seed) + k for k in range(num_seeds)]
    jobs = [(p, s) for p in policies for s in seeds]

    t0 = time.perf_counter()
    runs, demo, reused = [], None, []
    n_runs = len(jobs) + bool(scale_demo)  # one count for both progress lines: the demo is a run too
    with Progress(n_runs, "comparison (runs)", enabled=config.progress_bar,
                  interval_s=0) as bar:
        for i, (policy, seed) in enumerate(jobs):
            r = _train(config, os.path.join(workdir, "runs", f"{policy}_seed{seed}"), policy, seed,
                       f"[{i + 1}/{n_runs}] {policy} seed {seed}", report, isolated)
            reused.append(r.pop("reused", False))  # the results describe the run, not this command
            print(train.summary_line(r), flush=True)
            runs.append(r)
            bar.update(1, last=f"{policy} seed {seed}")
        if scale_demo:
            print(demo_sentence(), flush=True)
            demo = _train(demo_config(config), os.path.join(workdir, "runs", "scale_demo_O2-fp16"), DEMO["policy"],
                          seeds[0], f"[{n_runs}/{n_runs}] loss-scale demo", False, isolated)
            reused.append(demo.pop("reused", False))
            print("loss-scale demo: " + train.summary_line(demo), flush=True)
            bar.update(1, last="loss-scale demo")
    elapsed = total = time.perf_counter() - t0
    if all(reused):  # nothing trained: the tables keep the time the runs took
        total = _previous_total(workdir, total)
    out = _write_outputs(config, workdir, runs, demo, dict(policies=policies, seeds=seeds, total_time_s=total,
                                                          isolated=isolated, config_name=config_name), plots)
    print(total_line(total, elapsed, sum(reused), len(reused)) + " Wrote "
          f"{', '.join(sorted(v if isinstance(v, str) else ', '.join(v) for v in out['paths'].values()))}. "
          f"Metrics: tensorboard --logdir={os.path.join(workdir, 'runs')}", flush=True)
    return out


def demo_sentence() -> str:
    """What the loss-scale demo run is, printed before it (it is not a row of the table)."""
    return (f"loss-scale demo (not in the table): {DEMO['policy']} for {DEMO['num_train_steps']} steps with the "
            f"dynamic loss scale started far too high (2**{int(math.log2(DEMO['dynamic_scale_init']))}) and doubled "
            f"every {DEMO['dynamic_scale_period']} finite steps, so it overflows, backs off and grows again; "
            "loss_scale.png plots it.")


def total_line(total: float, elapsed: float, n_reused: int, n_runs: int) -> str:
    """The closing line's time: this command's, and the training time when runs were read back."""
    if n_reused == n_runs:
        return (f"\nTotal {total:.1f} s when the runs were trained; this command read all {n_runs} back "
                f"in {elapsed:.1f} s.")
    if n_reused:
        return f"\nTotal {elapsed:.1f} s ({n_reused} of {n_runs} runs read back from an earlier command)."
    return f"\nTotal {elapsed:.1f} s."


def _previous_total(workdir: str, default: float) -> float:
    """The total time recorded by the command that trained the runs, if its results.json says."""
    import json

    try:
        with open(os.path.join(workdir, "results.json")) as f:
            return float(json.load(f)["meta"]["total_time_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def _write_outputs(config, workdir: str, runs: list, demo, info: dict, plots: bool) -> dict:
    from experiments import results as results_lib

    rows = results_lib.aggregate(runs, chance_accuracy=1.0 / runs[0].get("num_classes", 10))
    first = runs[0]
    title = (f"{info['config_name'] or 'config'}: {config.model} on {config.dataset}, {first['steps']} steps, "
             f"global batch {first['config']['global_batch_size']}, {first['device']}")
    meta = {"title": title, "config": config.to_dict(), **info}
    paths = results_lib.write_tables(rows, runs, workdir, meta, scale_demo=demo)
    if plots:
        paths["plots"] = results_lib.write_plots(runs, rows, workdir, title, demo=demo)
    print()
    print(results_lib.format_table(rows, title))
    return {"rows": rows, "runs": runs, "demo": demo, "paths": paths}


def main(argv):
    del argv  # cli.run rejects extra arguments
    if any(a.startswith("--config.policy=") for a in sys.argv[1:]):
        # compare trains every policy it is given; config.policy is the single run's (experiments.main)
        raise cli.UserError("experiments.compare trains each policy of --policies (default config.compare_policies), "
                            "so --config.policy has no effect here: pass --policies=<name>[,<name>...] instead.")
    logging.set_verbosity(logging.WARNING)  # the progress lines and the table say enough
    from ml_collections import config_flags

    name = os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"])).removesuffix(".py")
    compare(FLAGS.config, FLAGS.workdir, policies=FLAGS.policies, num_seeds=FLAGS.seeds, isolate=FLAGS.isolate,
            plots=FLAGS.plots, report=FLAGS.report, config_name=name, scale_demo=FLAGS.scale_demo)


if __name__ == "__main__":
    cli.run(main)
