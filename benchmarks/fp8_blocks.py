"""Block-scaled fp8 and fp4 on the experiments' MNIST-1D CNN: does it train like bf16? 3 seeds each.

    python -m benchmarks.fp8_blocks                    # the study (CPU: every format emulated)
    python -m benchmarks.fp8_blocks --dry-run --out -  # seconds: a tiny CNN, 2 seeds

The experiments' default CPU job (``experiments/configs/cpu.py``: MNIST-1D, the 1-D CNN, AdamW,
cosine decay), trained by ``experiments.train.train_and_evaluate`` under each policy: ``O2-bf16``
(the reference), ``O2-fp8-current`` (per-tensor fp8), ``O2-fp8-rowwise``, ``O2-fp8-block128``,
``O2-mxfp8`` and ``O2-nvfp4``. The CNN's convolutions run per-tensor fp8 under every fp8 policy
(a convolution has no contraction axis to block along); its Dense head is block-scaled.

Verdict per policy: *within* when ``|mean - mean_bf16| <= max(spread_bf16, 1% of |mean_bf16|)``
(eval accuracy; spread = max - min over bf16's seeds). ``time_vs_bf16``: median over seeds of
the policy's train time over bf16's; on a CPU every format is emulated (quantize-dequantize
around a bf16 matmul), so this is the simulator's cost, not a speed. Writes
``benchmarks/results/fp8_blocks/fp8_blocks_cpu.json``.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time

import numpy as np

from benchmarks._common import REPO_ROOT, emit, jax_env, log, make_result, script_parser

POLICIES = ("O2-bf16", "O2-fp8-current", "O2-fp8-rowwise", "O2-fp8-block128", "O2-mxfp8", "O2-nvfp4")
REFERENCE = "O2-bf16"
DEFAULT_OUT = str(REPO_ROOT / "benchmarks" / "results" / "fp8_blocks" / "fp8_blocks_cpu.json")
DRY = {"num_train_steps": 8, "mnist1d_num_samples": 400, "model_kwargs.features": (8,),
       "model_kwargs.kernel_sizes": (3,), "eval_batch_size": 100}


def _config(dry: bool):
    from experiments import configs

    c = configs.get_config("cpu")
    c.progress_bar = False
    if dry:
        for k, v in DRY.items():
            if k.startswith("model_kwargs."):
                c.model_kwargs[k.split(".", 1)[1]] = v
            else:
                c[k] = v
    return c


def _summary(rows: list) -> dict:
    by = {}
    for r in rows:
        by.setdefault(r["policy"], []).append(r)
    ref = by[REFERENCE]
    ref_acc = np.array([r["eval_accuracy"] for r in ref])
    spread = float(ref_acc.max() - ref_acc.min())
    tolerance = max(spread, 0.01 * abs(float(ref_acc.mean())))
    ref_time = {r["seed"]: r["train_time_s"] for r in ref}
    out = {}
    for policy, runs in by.items():
        acc = np.array([r["eval_accuracy"] for r in runs])
        loss = np.array([r["eval_loss"] for r in runs])
        ratios = [r["train_time_s"] / ref_time[r["seed"]] for r in runs if r["seed"] in ref_time]
        out[policy] = {"eval_accuracy_mean": float(acc.mean()), "eval_accuracy_min": float(acc.min()),
                       "eval_accuracy_max": float(acc.max()), "eval_loss_mean": float(loss.mean()),
                       "within_bf16_spread": bool(abs(acc.mean() - ref_acc.mean()) <= tolerance),
                       "time_vs_bf16": float(np.median(ratios)) if ratios else None}
    out["bf16_accuracy_spread"] = spread
    return out


def main(argv=None) -> dict:
    parser = script_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2; dry run 0 1)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES, help="what to train")
    args = parser.parse_args(argv)
    from experiments import train

    seeds = args.seeds or ([0, 1] if args.dry_run else [0, 1, 2])
    policies = [REFERENCE] + [p for p in args.policies if p != REFERENCE]
    config = _config(args.dry_run)
    root = tempfile.mkdtemp(prefix="jaxmp_fp8_blocks_")
    rows = []
    try:
        for policy in policies:
            for seed in seeds:
                t = time.perf_counter()
                r = train.train_and_evaluate(copy.deepcopy(config), os.path.join(root, f"{policy}_{seed}"),
                                             policy=policy, seed=seed)
                rows.append({"policy": policy, "seed": seed, "eval_loss": r["val_loss"],
                             "eval_accuracy": r["val_accuracy"], "train_loss": r["train_loss"], "steps": r["steps"],
                             "train_time_s": r["train_time_s"], "compile_time_s": r["compile_time_s"]})
                log(f"{policy} seed {seed}: eval acc {r['val_accuracy']:.4f}, loss {r['val_loss']:.4f} "
                    f"({time.perf_counter() - t:.1f} s)", args.quiet)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    setup = {"config": "experiments/configs/cpu.py", "model": config.model,
             "model_kwargs": config.model_kwargs.to_dict(), "num_train_steps": rows[0]["steps"],
             "global_batch_size": config.global_batch_size, "seeds": seeds,
             "emulated": "every fp8/fp4 format is emulated on CPU: times are the simulator's cost"}
    result = make_result("fp8_blocks", jax_env(), setup, {"rows": rows, "summary": _summary(rows)}, args.dry_run)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
