"""Throughput, memory and achieved FLOP/s per precision policy (meant for a GPU).

One command runs every (model, batch, policy) of the suite and writes one JSON::

    python -m benchmarks.throughput                          # the full suite (GPU)
    python -m benchmarks.throughput --models resnet50        # a subset
    python -m benchmarks.throughput --dry-run --out -        # tiny models on CPU, seconds

Suite (synthetic data, on device, a few batches cycled):

* WRN-28-10 on CIFAR shapes (32x32x3, 10 classes), batch 128 and 512, SGD+momentum;
* ResNet-50 at 224x224x3, 1000 classes, batch 256, SGD+momentum;
* a Transformer encoder (12 layers, width 768, 12 heads, MLP 3072, 512 tokens), batch 32, AdamW;

each under ``O0-strict`` (O0 inside ``jax.default_matmul_precision("highest")``: true fp32),
``O0`` (default matmul precision: TF32 on Ampere and later), ``O1``, ``O2-bf16`` and
``O2-fp16`` (jaxmp recipes: policy, master weights and loss scale from ``jaxmp.get_recipe``;
the model runs through ``jaxmp.flax``), and the native baselines ``native-bf16`` (the same
module code with Flax's own ``dtype=bfloat16`` on every layer, plain optax) and, for the
Transformer, ``native-bf16-cudnn`` (the same with ``jax.nn.dot_product_attention``, cuDNN's
fused kernel on a GPU), so jaxmp / native is measured in the same run. ``autocast-O1`` and
``autocast-O2-bf16`` run the float32 module code through ``jaxmp.autocast`` instead of
``jaxmp.flax`` (op lists only), its attention calling ``jax.nn.dot_product_attention``, which
the engine routes to cuDNN's fused kernel on a GPU. Each run records how many cuDNN fused
attention calls its compiled step holds.

Per run: items/s (images or tokens) from the median step time of ``--rounds`` blocks of
``--steps`` steps (warm-up and compilation excluded, ``jax.block_until_ready`` at each block's
end); peak device memory (``device.memory_stats()["peak_bytes_in_use"]`` measured in a fresh
process per run, else the compiled step's ``memory_analysis()``, labelled); analytic FLOPs per
step (``benchmarks/flops.py``: 6 x params x tokens + attention for the Transformer, conv and
matmul FLOPs x 3 for the CNNs), achieved TFLOP/s and MFU against the bf16 matmul peak measured
in the same run and against the datasheet peak. The JSON is rewritten after every run, so a
time-out loses that run only. ``--profile`` adds a top-kernels table per run
(``benchmarks/kernel_profile.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from benchmarks import _common as common
from benchmarks import flops

# The suite itself is data in _suite.py (flops.py and torch_amp.py read it too); re-exported here.
from benchmarks._suite import (
    DRY_MATMUL_N, DRY_SUITE, DRY_TIMING, MATMUL_N, POLICIES, SUITE, TIMING)


# ----------------------------------------------------------------------------------------------
# Orchestration.


def _child(argv_tail: list[str], timeout: float | None) -> dict:
    """Runs this script in a fresh process (fresh device memory statistics) and reads its JSON."""
    return common.run_child("benchmarks.throughput", argv_tail, timeout)


def _child_main(args) -> None:
    """``--single KIND``: one measurement in this process, JSON to --child-out."""
    from benchmarks import _runs

    suite = DRY_SUITE if args.dry_run else SUITE
    timing = _timing(args)
    if args.single == "env":
        out = {"env": common.jax_env(),
               "matmul_peak": _runs.matmul_peak(args.matmul_n or (DRY_MATMUL_N if args.dry_run else MATMUL_N))}
    else:
        model_key, batch, policy = args.single.split(":")
        out = _guarded_run(model_key, int(batch), policy, suite, timing, True, args.quiet)
    Path(args.child_out).write_text(json.dumps(common._finite_json(out)))


def _guarded_run(model_key, batch, policy, suite, timing, fresh_process, quiet) -> dict:
    from benchmarks import _runs

    try:
        return _runs.run_one(model_key, batch, policy, suite, timing, fresh_process=fresh_process, quiet=quiet)
    except Exception as e:  # noqa: BLE001 - recorded in the entry, the suite goes on
        msg = f"{type(e).__name__}: {e}"
        oom = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
        return {"model": model_key, "batch_size": batch, "policy": policy,
                "status": "oom" if oom else "error", "error": msg[:4000]}


def _timing(args) -> dict:
    timing = common.timing_from_args(args, TIMING, DRY_TIMING)
    if getattr(args, "profile", False):
        timing.update(profile=True, profile_steps=args.profile_steps, profile_top=args.profile_top,
                      dry_run=bool(args.dry_run))
    return timing


def plan(args) -> tuple[dict, dict, list[tuple[str, int, str]]]:
    """(suite, timing, [(model, batch, policy)]): ``native-bf16-cudnn`` only for attention models
    unless asked for by name."""
    suite = DRY_SUITE if args.dry_run else SUITE
    timing = _timing(args)
    models = common.parse_choices(args.models, list(suite), "model")
    policies = common.parse_choices(args.policies, list(POLICIES), "policy")
    runs = []
    for m in models:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else list(suite[m]["batches"])
        for b in batches:
            for p in policies:
                if (p == "native-bf16-cudnn" or p.startswith("autocast-")) and not args.policies \
                        and suite[m]["unit"] != "tokens":
                    continue
                runs.append((m, b, p))
    return suite, timing, runs


def _child_tail(args) -> list[str]:
    tail = ["--dry-run"] if args.dry_run else []
    for k in ("rounds", "steps", "warmup_steps"):
        if getattr(args, k) is not None:
            tail += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if getattr(args, "profile", False):
        tail += ["--profile", "--profile-steps", str(args.profile_steps), "--profile-top", str(args.profile_top)]
    return tail + (["--quiet"] if args.quiet else [])


def run_suite(args, on_progress: Callable[[dict], None] | None = None) -> dict:
    """Runs the planned runs; ``on_progress(partial_result)`` after each (``complete`` False)."""
    from benchmarks import _runs

    suite, timing, runs = plan(args)
    isolate = args.isolate if args.isolate is not None else not args.dry_run
    tail = _child_tail(args)
    matmul_n = args.matmul_n or (DRY_MATMUL_N if args.dry_run else MATMUL_N)
    if isolate:
        head = _child(["--single", "env", "--matmul-n", str(matmul_n), *tail], args.timeout)
        if "env" not in head:
            raise SystemExit(f"could not start JAX in a child process: {head.get('error')}")
        env, peak = head["env"], head["matmul_peak"]
    else:
        env, peak = common.jax_env(), _runs.matmul_peak(matmul_n, rounds=3 if args.dry_run else 10,
                                                        steps=2 if args.dry_run else 10)
    peak["datasheet_tflops"] = flops.datasheet_peak_tflops(env["device"])
    common.log(f"throughput: {env['device']}; bf16 matmul peak {peak['tflops']:.1f} TFLOP/s measured "
               f"(n={peak['n']}), datasheet {peak['datasheet_tflops']}; {len(runs)} runs, "
               f"{'one process each' if isolate else 'in process'}", args.quiet)
    config = {"suite": {k: {**v, "model": list(v["model"])} for k, v in suite.items() if k in {r[0] for r in runs}},
              "timing": timing, "policies": sorted({r[2] for r in runs}, key=POLICIES.index),
              "isolated_processes": isolate, "matmul_n": matmul_n,
              "data": "synthetic, on device, n_batches cycled", "donated_state": True,
              "flops": "analytic (benchmarks/flops.py); MFU against the measured bf16 matmul peak and the datasheet"}
    entries = []
    for m, b, p in runs:
        if isolate:
            e = _child(["--single", f"{m}:{b}:{p}", *tail], args.timeout)
            e.setdefault("model", m), e.setdefault("batch_size", b), e.setdefault("policy", p)
        else:
            e = _guarded_run(m, b, p, suite, timing, False, args.quiet)
        if e.get("status") == "ok":
            e["mfu"] = flops.mfu(e["flops"]["per_step"], e["step_time_s"]["median"], peak["tflops"], env["device"])
            e["fraction_of_matmul_peak"] = e["mfu"]["mfu_measured_peak"]
        else:
            common.log(f"  {m} b{b} {p}: {e.get('status')}: {str(e.get('error'))[:300]}", args.quiet)
        entries.append(e)
        if on_progress is not None:
            on_progress(common.make_result("throughput", env, config, {"runs": list(entries), "matmul_peak": peak},
                                           args.dry_run, complete=False))
    return common.make_result("throughput", env, config, {"runs": entries, "matmul_peak": peak}, args.dry_run,
                              complete=True)


def summary_table(result: dict) -> str:
    rows = ["model        batch policy              items/s        step ms (IQR)          peak MiB (source)"
            "      TFLOP/s  MFU%(probe) MFU%(sheet)"]
    for e in result["results"]["runs"]:
        if e.get("status") != "ok":
            rows.append(f"{e['model']:12s} {e['batch_size']:5d} {e['policy']:18s} {e.get('status')}: "
                        f"{str(e.get('error'))[:80]}")
            continue
        st, mem, mfu = e["step_time_s"], e["memory"], e.get("mfu", {})
        mib = f"{mem['peak_bytes'] / 2**20:.0f}" if mem.get("peak_bytes") else "-"
        pct = lambda x: f"{100 * x:11.1f}" if x else "          -"  # noqa: E731
        rows.append(f"{e['model']:12s} {e['batch_size']:5d} {e['policy']:18s} {e['items_per_s']:10.1f} {e['unit'][:3]}  "
                    f"{st['median'] * 1e3:8.2f} ({st['q25'] * 1e3:.2f}-{st['q75'] * 1e3:.2f})  "
                    f"{mib:>8s} ({mem['source'].split(' ')[0]})  {e['tflops_per_s']:7.3f}  "
                    f"{pct(mfu.get('mfu_measured_peak'))} {pct(mfu.get('mfu_datasheet'))}")
    return "\n".join(rows)


def build_parser():
    parser = common.script_parser(__doc__)
    parser.add_argument("--models", help=f"comma list of {', '.join(SUITE)} (default: all)")
    parser.add_argument("--batches", help="comma list of batch sizes overriding each model's")
    parser.add_argument("--policies", help=f"comma list of {', '.join(POLICIES)} (default: all; "
                                           "native-bf16-cudnn only for the Transformer)")
    parser.add_argument("--rounds", type=int, help="timed blocks per run")
    parser.add_argument("--steps", type=int, help="steps per timed block")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps after compilation")
    parser.add_argument("--matmul-n", type=int, help=f"side of the bf16 matmul peak probe (default {MATMUL_N})")
    iso = parser.add_mutually_exclusive_group()
    iso.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                     help="one fresh process per run (default except --dry-run): per-run peak memory")
    iso.add_argument("--no-isolate", dest="isolate", action="store_false", help="all runs in this process")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per isolated run")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, trace --profile-steps steps with jax.profiler and write the top "
                             "kernels to benchmarks/results/profiles/ (dry_run/profiles/ with --dry-run)")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps traced by --profile (default 3)")
    parser.add_argument("--profile-top", type=int, default=20, help="kernels listed by --profile (default 20)")
    parser.add_argument("--single", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    return parser


def run_main(args) -> dict | None:
    """Runs the suite from parsed arguments, writing the JSON after every run."""
    return common.run_suite_main("throughput", args, run_suite, _child_main,
                                 lambda result: print(summary_table(result), flush=True))


def main(argv=None) -> dict | None:
    return run_main(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
