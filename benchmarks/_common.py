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

# The results schemas are data in _schemas.py; their checker is re-exported here for the scripts.
from benchmarks._schemas import validate_result  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1



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
