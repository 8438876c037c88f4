"""The GPU suite in one command: throughput per policy + the PyTorch AMP peer + wrapper overhead.

    bash benchmarks/run_gpu.sh                      # everything -> benchmarks/results/gpu_<device>.json
    bash benchmarks/run_gpu.sh --models resnet50    # a part; add --merge to keep the file's other runs
    python -m benchmarks.run_gpu --dry-run          # tiny, on CPU (the tests use it)

Runs ``throughput.py`` (jaxmp policies and the native Flax bf16 baselines, one fresh process
per model/batch/policy), ``torch_amp.py`` (eager autocast and ``torch.compile``, one fresh
process per run, never sharing the GPU with JAX) and ``overhead.py``, one after the other on
the same GPU, and writes one JSON holding the three results plus the jaxmp / PyTorch ratios.
The JSON is rewritten after every throughput run and after each part (the PyTorch part's own
file, ``results/parts/``, after each of its runs), so a time-out loses one run, not the table.
``--profile`` adds a top-kernel table per jaxmp run under ``results/profiles/``.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from benchmarks import _common as common
from benchmarks import report
from benchmarks import throughput


#: Issue 50's prediction for the GPU (benchmarks/README.md#gpu-prediction-for-issue-50-items-2-and-3-to-be-checked-by-the-gpu-issue):
#: bytes per param measured on the CPU programs (``python -m benchmarks._o2_prediction``), what
#: the GPU's own figures should show. Recorded in the suite's JSON (``config.predictions``) beside
#: the overhead part's ``o2_vs_hand_masters``, which checks the ratios on the GPU's programs.
PREDICTIONS = (
    {"what": "O2-bf16 optimizer step bytes per param (fused, AdamW, half gradients in)", "predicted": 46.0,
     "before": 88.0, "check": "python -m benchmarks._o2_prediction (bf16.jaxmp_bytes_per_param)"},
    {"what": "O2-fp16 optimizer step bytes per param (fused, AdamW, dynamic loss scale)", "predicted": 62.0,
     "before": 88.0, "check": "python -m benchmarks._o2_prediction (fp16.jaxmp_bytes_per_param)"},
    {"what": "jaxmp-o2 / hand-masters bytes accessed, overhead.py train step", "predicted": "<= 1.05",
     "check": "overhead part: o2_vs_hand_masters['jaxmp-o2'].bytes_accessed"},
    {"what": "jaxmp-o2-fp16 / hand-masters-fp16 bytes accessed, overhead.py train step", "predicted": "<= 1.3",
     "check": "overhead part: o2_vs_hand_masters['jaxmp-o2-fp16'].bytes_accessed"},
    {"what": "bytes saved per O2-bf16 optimizer step, GPT-2 small (124.4M) / 1B params", "predicted": [5.23e9, 42.0e9]},
    {"what": "bytes saved per O2-fp16 optimizer step, GPT-2 small (124.4M) / 1B params", "predicted": [3.24e9, 26.0e9]},
    {"what": "ZeRO all-gather bytes per param (bf16, not the float32 master)", "predicted": 2.0, "before": 4.0,
     "check": "python -m benchmarks._o2_prediction (zero_gather.jaxmp_bytes_per_param), 8 devices"},
    {"what": "ZeRO wire bytes saved per step per device, 8 devices, GPT-2 small / 1B", "predicted": [218e6, 1.75e9]},
)


def _script(name: str, argv: list[str], timeout: float, out: Path) -> dict:
    """Runs ``python -m benchmarks.<name> argv --out out`` in a fresh process and returns its JSON.

    The script rewrites ``out`` after each of its runs, so a time-out keeps what it finished.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *argv, "--out", str(out)]
    print(f"run_gpu: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    try:
        rc = subprocess.run(cmd, cwd=common.REPO_ROOT, timeout=timeout, stdout=sys.stderr).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if out.exists():
        return json.loads(out.read_text())
    return {"error": f"benchmarks.{name} failed (exit {rc}); see the log above"}


def _merge_runs(old: dict | None, new: dict) -> dict:
    """Keeps the old result's runs that the new one did not redo (--merge)."""
    if not old or old.get("benchmark") != new.get("benchmark") or "runs" not in old.get("results", {}):
        return new
    redone = {(e["model"], e["batch_size"], e["policy"]) for e in new["results"]["runs"]}
    kept = [e for e in old["results"]["runs"] if (e["model"], e["batch_size"], e["policy"]) not in redone]
    new["results"]["runs"] = kept + new["results"]["runs"]
    return new


def comparison(tp: dict, tr: dict | None) -> list[dict]:
    rows = []
    if not tr or tr.get("status") != "ok":
        return rows
    truns = [e for e in tr["results"]["runs"] if e.get("status") == "ok"]
    for e in tp["results"]["runs"]:
        if e.get("status") != "ok":
            continue
        pe = report._find(truns, e["model"], e["batch_size"], report.torch_variant(e, report.TORCH_PAIR))
        amps = [t for t in truns if t["model"] == e["model"] and t["batch_size"] == e["batch_size"]
                and t["policy"] in report.AMP_VARIANTS]
        row = {"model": e["model"], "batch_size": e["batch_size"], "policy": e["policy"],
               "jaxmp_items_per_s": e["items_per_s"]}
        if pe:
            row.update(torch_variant=pe["policy"], torch_items_per_s=pe["items_per_s"],
                       speed_ratio=e["items_per_s"] / pe["items_per_s"])
            if e["memory"].get("peak_bytes") and pe.get("memory", {}).get("peak_bytes"):
                row["memory_ratio"] = e["memory"]["peak_bytes"] / pe["memory"]["peak_bytes"]
        ce = report._find(truns, e["model"], e["batch_size"], report.torch_variant(e, report.COMPILE_PAIR))
        if ce:
            row.update(compile_variant=ce["policy"], compile_items_per_s=ce["items_per_s"],
                       speed_ratio_vs_compile=e["items_per_s"] / ce["items_per_s"])
        if amps:
            best = max(amps, key=lambda t: t["items_per_s"])
            row.update(best_amp_variant=best["policy"], speed_ratio_vs_best_amp=e["items_per_s"] / best["items_per_s"])
        rows.append(row)
    return rows


def build_parser():
    parser = common.script_parser(__doc__)
    parser.add_argument("--models", help="comma list of throughput models (default: all)")
    parser.add_argument("--batches", help="comma list of batch sizes overriding each model's")
    parser.add_argument("--policies", help="comma list of jaxmp policies and native baselines (default: all)")
    parser.add_argument("--variants", help="comma list of PyTorch variants (default: all, torch.compile included)")
    parser.add_argument("--rounds", type=int, help="timed blocks per run")
    parser.add_argument("--steps", type=int, help="steps per timed block")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps after compilation")
    parser.add_argument("--skip-torch", action="store_true", help="leave the PyTorch peer out")
    parser.add_argument("--skip-overhead", action="store_true", help="leave the wrapper overhead out")
    parser.add_argument("--profile", action="store_true", help="top-kernel tables per jaxmp run (throughput --profile)")
    parser.add_argument("--merge", action="store_true", help="keep runs of an existing output file not redone now")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child script")
    return parser


def _common_argv(args) -> list[str]:
    out = []
    for k in ("models", "batches", "rounds", "steps", "warmup_steps"):
        v = getattr(args, k)
        if v is not None:
            out += [f"--{k.replace('_', '-')}", str(v)]
    return out + (["--dry-run"] if args.dry_run else []) + (["--quiet"] if args.quiet else [])


def _suite(args, argv, tp, tr, ov, old) -> dict:
    if old:
        tp = _merge_runs(old["results"].get("throughput"), tp)
        tr = _merge_runs(old["results"].get("torch_amp"), tr) if tr is not None else old["results"].get("torch_amp")
        ov = ov or old["results"].get("overhead")
    return common.make_result(
        "gpu_suite", tp["env"],
        {"argv": argv if argv is not None else sys.argv[1:], "parts": ["throughput", "torch_amp", "overhead"],
         "predictions": list(PREDICTIONS)},
        {"throughput": tp, "torch_amp": tr or torch_missing(args), "overhead": ov, "comparison": comparison(tp, tr)},
        args.dry_run)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    common_argv = _common_argv(args)
    state = {"out": args.out, "old": None}

    def write(tp, tr=None, ov=None):
        """Rewrites the suite file: after every throughput run and after each part."""
        if state["out"] is None:
            slug = common.device_slug(tp["env"]["device"])
            state["out"] = str(common.RESULTS_DIR / (f"dry_run/gpu_{slug}.json" if args.dry_run else f"gpu_{slug}.json"))
            if args.merge and Path(state["out"]).exists():
                state["old"] = json.loads(Path(state["out"]).read_text())
        suite = _suite(args, argv, copy.deepcopy(tp), tr, ov, state["old"])
        if state["out"] != "-":
            common.write_json(state["out"], suite)
        return suite

    # 1. jaxmp throughput and the native baselines (one fresh process per run except dry runs).
    tp_argv = common_argv + (["--policies", args.policies] if args.policies else []) + (["--profile"] if args.profile else [])
    tp = throughput.run_suite(throughput.build_parser().parse_args(tp_argv), on_progress=write)
    print(throughput.summary_table(tp), flush=True)
    write(tp)
    parts = common.RESULTS_DIR / ("dry_run/parts" if args.dry_run else "parts")
    slug = common.device_slug(tp["env"]["device"])

    # 2. the PyTorch peer: eager autocast and torch.compile, one process per run on a GPU.
    tr = None
    if not args.skip_torch:
        tr_argv = common_argv + (["--variants", args.variants] if args.variants else [])
        if args.dry_run:
            from benchmarks import torch_amp

            tr = torch_amp.run_suite(torch_amp.build_parser().parse_args(tr_argv))
        else:
            tr = _script("torch_amp", tr_argv, args.timeout, parts / f"gpu_{slug}.torch_amp.json")
            tr = tr if "benchmark" in tr else None
        write(tp, tr)

    # 3. wrapper overhead on the same device.
    ov = None
    if not args.skip_overhead:
        ov_argv = (["--dry-run", "--variants", "bare,jaxmp"] if args.dry_run else []) + (["--quiet"] if args.quiet else [])
        if args.dry_run:
            from benchmarks import overhead

            ov = overhead.main(ov_argv + ["--out", "-"])
        else:
            ov = _script("overhead", ov_argv, args.timeout, parts / f"gpu_{slug}.overhead.json")
            ov = ov if "benchmark" in ov else None
    suite = write(tp, tr, ov)
    if state["out"] == "-":
        common.emit(suite, "-")
    else:
        print(f"wrote {state['out']}", flush=True)
    for row in suite["results"]["comparison"]:
        for key, label in (("speed_ratio", "torch_variant"), ("speed_ratio_vs_compile", "compile_variant")):
            if key in row:
                print(f"  jaxmp {row['model']} b{row['batch_size']} {row['policy']:9s} / torch {row[label]:16s}: "
                      f"{row[key]:.2f}x", flush=True)
    return suite


def torch_missing(args) -> dict:
    from benchmarks import torch_amp

    reason = "skipped by --skip-torch" if args.skip_torch else "the PyTorch peer did not produce a result"
    return torch_amp.skipped_result(reason, args.dry_run, {})


if __name__ == "__main__":
    main()
