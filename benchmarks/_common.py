"""Shared helpers of the benchmark scripts: environment record, timing, statistics, JSON.

Everything here is light (stdlib + numpy); JAX is imported lazily by the functions that
need it, so ``benchmarks/torch_amp.py`` can use this module without JAX on the path and
``benchmarks/report.py`` can read results anywhere.

Method (the same in every script):

* warm-up: each measured function runs (compiles and executes) before any timing;
* synchronisation: a timed block ends with ``jax.block_until_ready`` on everything the
  step returns (``torch.cuda.synchronize`` in the PyTorch peer), so asynchronous
  dispatch cannot hide work;
* repeats: a block of ``steps`` consecutive steps is timed ``rounds`` times and the
  per-step time of each block is a sample; we report the median and the spread
  (interquartile range, min and max);
* interleaving: variants that are compared are timed in alternation (A B C, then B C A, ...)
  so that drift of the machine (clock, other processes, thermal state) hits them alike.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1

#: Keys every result file carries (checked by :func:`validate_result` and the tests).
REQUIRED_KEYS = ("schema_version", "benchmark", "dry_run", "created_utc", "env", "config", "results")
REQUIRED_ENV_KEYS = ("device", "platform", "python", "versions", "git_commit")


# ----------------------------------------------------------------------------------------------
# Environment.


def git_commit() -> dict[str, Any]:
    """The checked-out commit and whether the tree has local changes (read-only git calls)."""
    out: dict[str, Any] = {"sha": "unknown", "dirty": None}
    try:
        out["sha"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                    text=True, timeout=20, check=True).stdout.strip() or "unknown"
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=20, check=True).stdout
        out["dirty"] = bool(status.strip())
    except Exception:  # noqa: BLE001 - no git, not a repo, timeout: record "unknown"
        pass
    return out


def _version(module_name: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version(module_name)
    except Exception:  # noqa: BLE001
        return None


def jax_env() -> dict[str, Any]:
    """Device name and library versions for a JAX benchmark."""
    import jax

    dev = jax.devices()[0]
    info = {
        "device": getattr(dev, "device_kind", str(dev)) or str(dev),
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "compute_capability": getattr(dev, "compute_capability", None),
        "versions": {
            "jax": jax.__version__,
            "jaxlib": _version("jaxlib"),
            "flax": _version("flax"),
            "optax": _version("optax"),
            "jmp": _version("jmp"),
            "numpy": _version("numpy"),
            "jaxmp": _version("jaxmp") or _jaxmp_version(),
        },
    }
    info.update(_host_env())
    return info


def _jaxmp_version() -> str | None:
    try:
        import jaxmp

        return jaxmp.__version__
    except Exception:  # noqa: BLE001
        return None


def _host_env() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "git_commit": git_commit(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # 1, 5 and 15 minute load averages when the run started: timings on a busy machine are noisy.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3' (for file names)."""
    s = "".join(c.lower() if c.isalnum() else "_" for c in name)
    while "__" in s:
        s = s.replace("__", "_")
    return s.strip("_") or "device"


# ----------------------------------------------------------------------------------------------
# Statistics and timing.


def summarize(samples: Sequence[float]) -> dict[str, float | int]:
    """Median, quartiles, IQR, min, max, mean of positive samples (seconds or ratios)."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no samples")
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else [xs[0]] * 3
    return {
        "n": len(xs),
        "median": statistics.median(xs),
        "q25": q[0],
        "q75": q[2],
        "iqr": q[2] - q[0],
        "min": xs[0],
        "max": xs[-1],
        "mean": statistics.fmean(xs),
    }


def rotate(seq: Sequence[Any], k: int) -> list[Any]:
    k %= max(len(seq), 1)
    return list(seq[k:]) + list(seq[:k])


def time_interleaved(blocks: Mapping[str, Callable[[], float]], rounds: int,
                     order_rotation: bool = True, on_round: Callable[[int, dict], None] | None = None
                     ) -> dict[str, list[float]]:
    """Runs each timed block once per round, variants in rotating order (ABC, BCA, CAB, ...).

    Args:
      blocks: name -> a callable that runs one timed block and returns its per-step seconds
        (it must synchronise itself).
      rounds: how many rounds.
      order_rotation: rotate the order each round (cancels "first in the round" effects).

    Returns:
      name -> list of per-step seconds, one per round, in round order (so rounds are paired).
    """
    names = list(blocks)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        this_round = {}
        for name in (rotate(names, r) if order_rotation else names):
            this_round[name] = blocks[name]()
            out[name].append(this_round[name])
        if on_round is not None:
            on_round(r, this_round)
    return out


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios of two interleaved series (cancels drift between rounds)."""
    return [a / b for a, b in zip(num, den)]


class Timer:
    """``with Timer() as t: ...; t.seconds`` using ``time.perf_counter``."""

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self._t0
        return False


# ----------------------------------------------------------------------------------------------
# Result files.


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def make_result(benchmark: str, env: dict, config: dict, results: Any, dry_run: bool, **extra) -> dict:
    out = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": benchmark,
        "dry_run": bool(dry_run),
        "created_utc": utc_now(),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) if sys.argv else "",
        "env": env,
        "config": config,
        "results": results,
    }
    out.update(extra)
    return out


def _finite_json(obj: Any) -> Any:
    """Replaces NaN/inf floats by None so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "shape", None) == ():
        return _finite_json(obj.item())
    return obj


def write_json(path: str | os.PathLike, result: dict) -> Path:
    """Validates ``result`` and writes it (strict JSON, sorted keys, atomic rename)."""
    problems = validate_result(result)
    if problems:
        raise ValueError("refusing to write a malformed result:\n  " + "\n  ".join(problems))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_finite_json(result), indent=2, sort_keys=True, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def emit(result: dict, out: str) -> None:
    """Writes ``result`` to ``out`` (validated), or only validates it when ``out`` is ``-``."""
    if out != "-":
        print(f"wrote {write_json(out, result)}", flush=True)
        return
    problems = validate_result(result)
    if problems:
        raise SystemExit("malformed result: " + "; ".join(problems))


def parse_choices(text: str | None, allowed, what: str) -> list[str]:
    """A comma list from a flag (all of ``allowed`` when empty), rejecting unknown names."""
    chosen = [c.strip() for c in text.split(",")] if text else list(allowed)
    for c in chosen:
        if c not in allowed:
            raise SystemExit(f"unknown {what} {c!r}: choose from {', '.join(allowed)}")
    return chosen


def add_timing_args(parser, warmup_help: str = "untimed steps per variant"):
    """``--rounds``, ``--steps`` and ``--warmup-steps``, read by :func:`timing_from_args`."""
    parser.add_argument("--rounds", type=int, help="interleaved timing rounds (samples per variant)")
    parser.add_argument("--steps", type=int, help="steps per timed block")
    parser.add_argument("--warmup-steps", type=int, help=warmup_help)
    return parser


def emit_to_default(result: dict, out: str | None, name: str) -> None:
    """:func:`emit` to ``out``, or to ``results/<name>_<device>.json`` (``dry_run/<name>.json``)."""
    emit(result, suite_out(name, result, result["dry_run"]) if out is None else out)


def timing_from_args(args, default: Mapping[str, int], dry: Mapping[str, int]) -> dict[str, int]:
    """The timing settings (rounds, steps, warmup_steps): the defaults, then any given flag."""
    timing = dict(dry if args.dry_run else default)
    timing.update({k: getattr(args, k) for k in ("rounds", "steps", "warmup_steps") if getattr(args, k) is not None})
    return timing


def _is_pos(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def validate_result(result: Any) -> list[str]:
    """Schema check shared by every benchmark; returns a list of problems (empty when fine).

    Common part: the keys of :data:`REQUIRED_KEYS`, an ``env`` with device, platform, python,
    versions (jax/jaxlib/flax/optax for JAX benchmarks, torch for the peer) and git commit.
    Per benchmark: see ``_validate_<benchmark>``.
    """
    p: list[str] = []
    if not isinstance(result, dict):
        return [f"result is a {type(result).__name__}, not a dict"]
    for k in REQUIRED_KEYS:
        if k not in result:
            p.append(f"missing key {k!r}")
    if p:
        return p
    if not isinstance(result["dry_run"], bool):
        p.append("dry_run is not a bool")
    env = result["env"]
    if not isinstance(env, dict):
        return p + ["env is not a dict"]
    for k in REQUIRED_ENV_KEYS:
        if k not in env:
            p.append(f"env lacks {k!r}")
    if not isinstance(env.get("device"), str) or not env.get("device"):
        p.append("env.device is not a non-empty string")
    versions = env.get("versions", {})
    if not isinstance(versions, dict):
        p.append("env.versions is not a dict")
        versions = {}
    if result["benchmark"] == "torch_amp":
        needed = ("torch",) if result.get("status") == "ok" else ()
    else:
        needed = ("jax", "jaxlib", "flax", "optax")
    for k in needed:
        if not isinstance(versions.get(k), str):
            p.append(f"env.versions.{k} missing")
    gc = env.get("git_commit")
    if not isinstance(gc, dict) or not isinstance(gc.get("sha"), str):
        p.append("env.git_commit.sha missing")
    if not isinstance(result["config"], dict):
        p.append("config is not a dict")
    check = _VALIDATORS.get(result["benchmark"])
    if check is None:
        p.append(f"unknown benchmark {result['benchmark']!r}")
    else:
        p.extend(check(result))
    return p


def _check_stats(stats: Any, where: str) -> list[str]:
    if not isinstance(stats, dict):
        return [f"{where} is not a stats dict"]
    p = []
    for k in ("median", "q25", "q75", "min", "max"):
        if not _is_pos(stats.get(k)):
            p.append(f"{where}.{k} is not a positive number: {stats.get(k)!r}")
    if not (isinstance(stats.get("n"), int) and stats["n"] >= 1):
        p.append(f"{where}.n is not a positive int")
    if not p and not stats["min"] <= stats["q25"] <= stats["median"] <= stats["q75"] <= stats["max"]:
        p.append(f"{where}: min <= q25 <= median <= q75 <= max does not hold")
    return p


def _validate_overhead(result: dict) -> list[str]:
    r = result["results"]
    p = []
    if not isinstance(r, dict):
        return ["results is not a dict"]
    variants = r.get("step_time_s")
    if not isinstance(variants, dict) or "bare" not in variants or "jaxmp" not in variants:
        return ["results.step_time_s must hold at least 'bare' and 'jaxmp'"]
    for name, stats in variants.items():
        p += _check_stats(stats, f"results.step_time_s.{name}")
    ratios = r.get("ratios")
    if not isinstance(ratios, dict) or "jaxmp/bare" not in ratios:
        return p + ["results.ratios must hold 'jaxmp/bare'"]
    for name, stats in ratios.items():
        p += _check_stats(stats, f"results.ratios.{name}")
    if not isinstance(r.get("target"), dict):
        p.append("results.target missing")
    return p


def _check_run_entry(entry: Any, where: str, unit_key: str) -> list[str]:
    if not isinstance(entry, dict):
        return [f"{where} is not a dict"]
    p = []
    for k in ("model", "policy", "batch_size"):
        if k not in entry:
            p.append(f"{where} lacks {k!r}")
    status = entry.get("status")
    if status != "ok":
        if not isinstance(entry.get("error"), str):
            p.append(f"{where}: status {status!r} without an error message")
        return p
    p += _check_stats(entry.get("step_time_s"), f"{where}.step_time_s")
    if not _is_pos(entry.get(unit_key)):
        p.append(f"{where}.{unit_key} is not a positive number")
    return p + _check_sourced(entry.get("memory"), f"{where}.memory", "peak_bytes")


def _check_sourced(value: Any, where: str, amount: str) -> list[str]:
    """A dict with a ``source`` string and, where not None, a positive ``amount``."""
    if not isinstance(value, dict) or not isinstance(value.get("source"), str):
        return [f"{where} must be a dict with a 'source'"]
    if value.get(amount) is not None and not _is_pos(value[amount]):
        return [f"{where}.{amount} is not positive"]
    return []


def _validate_throughput(result: dict) -> list[str]:
    r = result["results"]
    if not isinstance(r, dict):
        return ["results is not a dict"]
    p = []
    runs = r.get("runs")
    if not isinstance(runs, list) or not runs:
        return ["results.runs must be a non-empty list"]
    for i, e in enumerate(runs):
        p += _check_run_entry(e, f"results.runs[{i}]", "items_per_s")
        if isinstance(e, dict) and e.get("status") == "ok":
            p += _check_sourced(e.get("flops"), f"results.runs[{i}].flops", "per_step")
    peak = r.get("matmul_peak")
    if not isinstance(peak, dict) or not _is_pos(peak.get("tflops")):
        p.append("results.matmul_peak.tflops is not a positive number")
    return p


def _validate_torch(result: dict) -> list[str]:
    status = result.get("status")
    if status == "skipped":
        return [] if isinstance(result.get("reason"), str) and result["reason"] else ["skipped without a reason"]
    if status != "ok":
        return [f"status must be 'ok' or 'skipped', got {status!r}"]
    r = result["results"]
    if not isinstance(r, dict) or not isinstance(r.get("runs"), list) or not r["runs"]:
        return ["results.runs must be a non-empty list"]
    p = []
    for i, e in enumerate(r["runs"]):
        p += _check_run_entry(e, f"results.runs[{i}]", "items_per_s")
    return p


def _validate_gpu_suite(result: dict) -> list[str]:
    r = result["results"]
    if not isinstance(r, dict):
        return ["results is not a dict"]
    p = []
    for part in ("throughput", "torch_amp"):
        sub = r.get(part)
        if not isinstance(sub, dict):
            p.append(f"results.{part} missing")
            continue
        p += [f"{part}: {x}" for x in validate_result(sub)]
    if "overhead" in r and r["overhead"] is not None:
        p += [f"overhead: {x}" for x in validate_result(r["overhead"])]
    return p


def _models(result: dict) -> dict | None:
    models = result["results"].get("models") if isinstance(result["results"], dict) else None
    return models if isinstance(models, dict) and models else None


def _validate_variant_models(result: dict, check_variant, need_one: bool = False) -> list[str]:
    """``results.models.<m>``: ``variants`` (timed, each checked by ``check_variant(name, entry,
    variants, where)``) and ``skipped`` (a reason each); ``need_one``: a model must have either."""
    models = _models(result)
    if models is None:
        return ["results.models must be a non-empty dict"]
    p = []
    for m, r in models.items():
        if not isinstance(r, dict) or not isinstance(r.get("variants"), dict) or not isinstance(r.get("skipped"), dict):
            p.append(f"results.models.{m} needs 'variants' and 'skipped' dicts")
            continue
        if need_one and not r["variants"] and not r["skipped"]:
            p.append(f"results.models.{m} has no variants")
        for v, x in r["variants"].items():
            where = f"results.models.{m}.variants.{v}"
            p += _check_stats(x.get("step_time_s"), f"{where}.step_time_s")
            p += check_variant(v, x, r["variants"], where)
        for v, why in r["skipped"].items():
            if not isinstance(why, str) or not why:
                p.append(f"results.models.{m}.skipped.{v} gives no reason")
    return p


def _check_autocast_variant(v: str, x: dict, variants: dict, where: str) -> list[str]:
    p = [f"{where}.{k} is not a positive number" for k in ("trace_s", "trace_lower_compile_s") if not _is_pos(x.get(k))]
    if not (isinstance(x.get("hlo_converts"), int) and x["hlo_converts"] >= 0):
        p.append(f"{where}.hlo_converts is not a count")
    if not (isinstance(x.get("loss_rel_error"), (int, float)) and x["loss_rel_error"] >= 0):
        p.append(f"{where}.loss_rel_error is not a non-negative number")
    return p


def _check_fp8_variant(v: str, x: dict, variants: dict, where: str) -> list[str]:
    p = []
    curve = x.get("loss_curve")
    if not (isinstance(curve, list) and curve and all(isinstance(c, float) for c in curve)):
        p.append(f"{where}.loss_curve is not a non-empty list of floats")
    if not isinstance(x.get("policy"), str):
        p.append(f"{where}.policy is not a preset name")
    state = x.get("fp8_state")
    if x.get("policy") == "O2-fp8" and not (isinstance(state, dict) and _is_pos(state.get("amaxes_recorded_min"))):
        p.append(f"{where}.fp8_state must show recorded amaxes (delayed scaling)")
    if v != "bf16" and "bf16" in variants and not isinstance(x.get("max_rel_loss_gap_last_half"), float):
        p.append(f"{where}.max_rel_loss_gap_last_half is not a number")
    return p


def _validate_autocast(result: dict) -> list[str]:
    return _validate_variant_models(result, _check_autocast_variant)


def _validate_fp8(result: dict) -> list[str]:
    return _validate_variant_models(result, _check_fp8_variant, need_one=True)


#: The keys every ``results.rows`` entry of a rows schema has.
_ROW_KEYS = {
    "memory": ("recipe", "layout", "devices", "params", "bytes_per_param_measured", "bytes_per_param_analytic"),
    "memory_gpt2": ("who", "layout", "reduce_dtype", "devices", "params", "compiled"),
}


def _validate_rows(result: dict) -> list[str]:
    """``results.rows``: a non-empty list, each row with the schema's `_ROW_KEYS` (memory_gpt2: and
    an integer ``compiled.peak_estimate_bytes``)."""
    rows = result["results"].get("rows") if isinstance(result["results"], dict) else None
    if not isinstance(rows, list) or not rows:
        return ["results.rows is not a non-empty list"]
    p = []
    for i, r in enumerate(rows):
        p += [f"results.rows[{i}] lacks {k!r}" for k in _ROW_KEYS[result["benchmark"]] if k not in r]
        if result["benchmark"] == "memory_gpt2" and not isinstance(r.get("compiled", {}).get("peak_estimate_bytes"), int):
            p.append(f"results.rows[{i}] lacks compiled.peak_estimate_bytes")
    return p


def _validate_efficiency(result: dict) -> list[str]:
    models = _models(result)
    if not models:
        return ["results.models missing or empty"]
    p = []
    for m, r in models.items():
        for prog, ref in (("grad", "native"), ("step", "floor")):
            progs = r.get(prog) if isinstance(r, dict) else None
            if not isinstance(progs, dict) or ref not in progs:
                p.append(f"{m}: {prog} lacks {ref!r}")
                continue
            for v, st in progs.items():
                if not all(isinstance(st.get(k), (int, float)) for k in ("ops", "converts", "bytes")):
                    p.append(f"{m}: {prog} {v} lacks ops/converts/bytes")
    return p


def _validate_fidelity(result: dict) -> list[str]:
    """benchmarks/fidelity.py: per job, runs per recipe with per-seed eval numbers and a summary."""
    p: list[str] = []
    res = result["results"]
    if not isinstance(res, dict) or not res:
        return ["results is not a non-empty dict of jobs"]
    for job, out in res.items():
        if not isinstance(out, dict) or not all(k in out for k in ("setup", "runs", "summary", "tail")):
            p.append(f"results.{job} lacks setup/runs/summary/tail")
            continue
        for recipe, runs in out["runs"].items():
            if not isinstance(runs, list) or not runs:
                p.append(f"results.{job}.runs.{recipe} is not a non-empty list")
                continue
            for r in runs:
                if not all(_is_pos(r.get(k)) or r.get(k) == 0 for k in ("eval_loss", "eval_accuracy")):
                    p.append(f"results.{job}.runs.{recipe}: eval_loss/eval_accuracy missing or negative")
            if recipe not in out["summary"]:
                p.append(f"results.{job}.summary lacks {recipe}")
    return p


_VALIDATORS = {
    "memory": _validate_rows,
    "memory_gpt2": _validate_rows,
    "efficiency": _validate_efficiency,
    "fidelity": _validate_fidelity,
    "fp8": _validate_fp8,
    "autocast": _validate_autocast,
    "overhead": _validate_overhead,
    "throughput": _validate_throughput,
    "torch_amp": _validate_torch,
    "gpu_suite": _validate_gpu_suite,
}


def run_child(module: str, argv_tail: list[str], timeout: float | None) -> dict:
    """Runs ``python -m module argv_tail --child-out FILE`` from the repository root in a fresh
    process and returns FILE's JSON.

    A child that times out, crashes or runs out of memory gives an entry with ``status``
    ``"error"`` / ``"oom"`` and the tail of its output, so the caller records it and goes on.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "one.json"
        cmd = [sys.executable, "-m", module, *argv_tail, "--child-out", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"timed out after {timeout}s"}
        sys.stderr.write(proc.stderr[-4000:] if proc.returncode else "")
        if out.exists():
            return json.loads(out.read_text())
        tail = (proc.stderr or proc.stdout)[-2000:]
        oom = "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower()
        return {"status": "oom" if oom else "error", "error": f"exit {proc.returncode}: {tail.strip()}"}


def add_common_args(parser, default_out: str | None):
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny models, tiny batch, 2-3 iterations: runs on CPU end to end (for tests)")
    parser.add_argument("--out", default=default_out, help="where to write the JSON result ('-' for stdout only)")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser


def script_parser(doc: str, default_out: str | None = None):
    """A script's parser: its docstring's first paragraph as the description, and the common flags."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_common_args(parser, default_out=default_out)


class RunSetup(NamedTuple):
    """What a variants benchmark runs: sizes and timing (dry-run or full, flags applied), the chosen
    models and variants, and the JAX environment."""

    sizes: dict
    timing: dict
    models: list
    variants: list
    env: dict


def run_setup(args, sizes: tuple[Mapping, Mapping], timing: tuple[Mapping, Mapping], models, variants,
              **timing_flags) -> RunSetup:
    """The sizes and timing of ``(full, dry-run)`` for ``args.dry_run`` (``timing_flags``: timing
    keys set from flags when given), ``--models`` and ``--variants`` (all when not given), and the
    JAX environment."""
    timing = timing_from_args(args, *timing)
    timing.update({k: v for k, v in timing_flags.items() if v is not None})
    return RunSetup(sizes[1] if args.dry_run else sizes[0], timing, parse_choices(args.models, list(models), "model"),
                    parse_choices(args.variants, list(variants), "variant"), jax_env())


def suite_out(name: str, result: dict, dry_run: bool) -> str:
    """Where a suite's JSON goes by default: ``results/<name>_<device>.json`` (``dry_run/<name>.json``)."""
    return str(RESULTS_DIR / (f"dry_run/{name}.json" if dry_run else f"{name}_{device_slug(result['env']['device'])}.json"))


def run_and_emit(name: str, args, run) -> dict:
    """``run(args)``, its result written to ``--out`` or the default place (:func:`emit_to_default`)."""
    result = run(args)
    emit_to_default(result, args.out, name)
    return result


def run_suite_main(name: str, args, run_suite, child_main, print_summary) -> dict | None:
    """The driver of a suite whose runs may each be a fresh process: ``--single`` is one run (a
    child, ``child_main(args)``); otherwise ``run_suite(args, on_progress=...)`` runs them all, the
    JSON rewritten after every run, then ``print_summary(result)`` and the JSON written
    (``--out``, or :func:`suite_out`)."""
    if args.single:
        child_main(args)
        return None

    def progress(partial):
        if args.out != "-":
            write_json(args.out or suite_out(name, partial, args.dry_run), partial)

    result = run_suite(args, on_progress=progress)
    print_summary(result)
    emit(result, args.out or suite_out(name, result, args.dry_run))
    return result


def log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)
