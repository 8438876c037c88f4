"""One command that compares precision policies: seed 000's table for any config.

  python -m experiments.compare --config=experiments/configs/cpu.py --workdir=/tmp/jaxmp_compare

Trains the same config under every policy of ``config.compare_policies`` (or
``--policies=O0,O2-fp16``) and ``config.num_seeds`` seeds (or ``--seeds=N``), then
prints the table (policy, wall time, steps/s, examples/s, peak memory, validation
accuracy mean +- std over seeds, skipped steps, final loss scale) and writes
``results.{json,csv,md}`` and ``accuracy_loss.png`` / ``loss_scale.png`` to the
workdir. Each (policy, seed) run lives in ``<workdir>/runs/<policy>_seed<k>`` and
resumes like ``main.py``; a finished run is read back, not retrained.

On backends that report allocator statistics (GPU, TPU) every run gets its own
process (``--isolate``, the default there): a peak-memory counter cannot be reset
inside one process, so in-process runs would report the largest peak so far.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time

from absl import flags, logging

from experiments import cli

cli.define_flags()
flags.DEFINE_list("policies", None, "Policies to compare (default: config.compare_policies), e.g. O0,O2-bf16.")
flags.DEFINE_integer("seeds", None, "Seeds per policy (default: config.num_seeds); accuracy is mean +- std.")
flags.DEFINE_enum("isolate", "auto", ["auto", "true", "false"],
                  "Run each training in its own process (auto: where device memory statistics exist).")
flags.DEFINE_bool("plots", True, "Write the PNG plots.")
FLAGS = flags.FLAGS


def _run_isolated(config, workdir: str, policy: str, seed: int, desc: str, report: bool) -> dict:
    """Runs one training in a fresh Python process and reads its results.json."""
    import json

    os.makedirs(workdir, exist_ok=True)
    job = os.path.join(workdir, "job.pkl")
    with open(job, "wb") as f:
        pickle.dump({"config": config, "workdir": workdir, "policy": policy, "seed": seed, "desc": desc,
                     "report": report}, f)
    proc = subprocess.run([sys.executable, "-m", "experiments.train", job], cwd=os.getcwd())
    if proc.returncode:
        raise cli.UserError(f"the {policy} seed {seed} run failed (exit {proc.returncode}); see its output above")
    with open(os.path.join(workdir, "results.json")) as f:
        return json.load(f)


def compare(config, workdir: str, *, policies=None, num_seeds: int | None = None, isolate: str = "auto",
            plots: bool = True, report: bool = False, config_name: str = "") -> dict:
    """Trains every (policy, seed) and writes the table and plots; returns ``{"rows", "runs", "paths"}``."""
    from experiments import results as results_lib
    from experiments import train

    policies = list(policies or config.compare_policies)
    num_seeds = int(config.num_seeds if num_seeds is None else num_seeds)
    if num_seeds < 1:
        raise cli.UserError(f"need at least one seed, got {num_seeds}")
    for p in policies:
        train.validate_config(config, policy=p)
    isolated = (train.device_peak_memory() is not None) if isolate == "auto" else isolate == "true"
    seeds = [int(config.seed) + k for k in range(num_seeds)]

    t0 = time.perf_counter()
    runs = []
    for i, policy in enumerate(policies):
        for seed in seeds:
            run_dir = os.path.join(workdir, "runs", f"{policy}_seed{seed}")
            desc = f"[{i + 1}/{len(policies)}] {policy} seed {seed}"
            if isolated:
                r = _run_isolated(config, run_dir, policy, seed, desc, report)
            else:
                r = train.train_and_evaluate(config, run_dir, policy=policy, seed=seed, report=report, desc=desc)
            print(train.summary_line(r), flush=True)
            runs.append(r)
    total = time.perf_counter() - t0

    rows = results_lib.aggregate(runs, chance_accuracy=1.0 / runs[0].get("num_classes", 10))
    first = runs[0]
    title = (f"{config_name or 'config'}: {config.model} on {config.dataset}, {first['steps']} steps, "
             f"global batch {first['config']['global_batch_size']}, {first['device']}")
    meta = {"title": title, "config_name": config_name, "config": config.to_dict(), "seeds": seeds,
            "policies": policies, "total_time_s": total, "isolated": isolated}
    paths = results_lib.write_tables(rows, runs, workdir, meta)
    if plots:
        paths["plots"] = results_lib.write_plots(runs, workdir, title)
    print()
    print(results_lib.format_table(rows, title))
    print(f"\nTotal {total:.1f} s. Wrote {', '.join(sorted(v if isinstance(v, str) else ', '.join(v) for v in paths.values()))}")
    return {"rows": rows, "runs": runs, "paths": paths}


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)  # the progress bars and the table say enough
    from ml_collections import config_flags

    name = os.path.basename(config_flags.get_config_filename(flags.FLAGS["config"])).removesuffix(".py")
    compare(FLAGS.config, FLAGS.workdir, policies=FLAGS.policies, num_seeds=FLAGS.seeds, isolate=FLAGS.isolate,
            plots=FLAGS.plots, report=FLAGS.report, config_name=name)


if __name__ == "__main__":
    cli.run(main)
