"""The kernel profile of a benchmark run: trace a few steps with ``jax.profiler``, sum the XLA
events per name, render the top ones as markdown. The library half of ``kernel_profile.py``
(its CLI), so that ``_runs.py`` can profile a run without importing a CLI module.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
from pathlib import Path
from typing import Callable

from benchmarks import _common as common


def trace_steps(run_steps: Callable[[], None], log_dir: str | Path) -> Path:
    """Runs ``run_steps()`` (which must synchronise) under ``jax.profiler.trace``.

    Args:
      run_steps: the work to profile.
      log_dir: where the profiler writes (a fresh directory).

    Returns:
      The path of the Chrome/Perfetto ``*.trace.json.gz`` it wrote.
    """
    import jax

    with jax.profiler.trace(str(log_dir)):
        run_steps()
    found = sorted(glob.glob(str(Path(log_dir) / "**" / "*.trace.json.gz"), recursive=True))
    if not found:
        raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {log_dir}")
    return Path(found[-1])


def top_kernels(trace_path: str | Path, top: int = 20) -> dict:
    """Sums the XLA events of a trace per name.

    Events that carry an ``hlo_op`` argument are XLA's: kernels on a device timeline (GPU, TPU)
    or thunks on the host (CPU). When the trace has device timelines only those count, so a GPU
    kernel is not counted twice with its host-side launch.

    Args:
      trace_path: a ``*.trace.json.gz`` from :func:`trace_steps`.
      top: rows to keep.

    Returns:
      ``{"timeline": "device" | "host", "total_us": float, "rows": [{"name", "hlo_op", "count",
      "total_us", "share"}]}`` with rows sorted by total time.
    """
    with gzip.open(trace_path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e.get("pid"): (e.get("args") or {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {pid for pid, name in procs.items() if name.startswith("/device:")}
    totals: dict = collections.defaultdict(lambda: [0, 0.0, ""])
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or e["name"].startswith("end: "):
            continue
        if device_pids and e.get("pid") not in device_pids:
            continue
        row = totals[e["name"]]
        row[0] += 1
        row[1] += float(e.get("dur", 0.0))
        row[2] = args["hlo_op"]
    total = sum(r[1] for r in totals.values())
    rows = [{"name": n, "hlo_op": op, "count": c, "total_us": us, "share": us / total if total else 0.0}
            for n, (c, us, op) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]]
    return {"timeline": "device" if device_pids else "host", "total_us": total, "rows": rows}


def kernel_time_by_thread(trace_path: str | Path) -> dict:
    """Sums the host-side XLA events of a trace per thread pool.

    On CPU the thunks of one program run on whichever threads XLA's runtime hands them to: the
    PjRt client thread that starts the program (``tf_XLAPjRtCpuClient``), the intra-op pool
    (``tf_XLAEigen``) or the Python thread. Two programs with the same kernels can differ in wall
    time only through this placement; this table shows it.

    Args:
      trace_path: a ``*.trace.json.gz`` from :func:`trace_steps`.

    Returns:
      ``{pool: total_us}`` where ``pool`` is the thread name up to its first ``/`` (thread names
      carry an id after it), for events that carry an ``hlo_op`` argument.

    Example::

        path = trace_steps(lambda: run(10), "/tmp/prof")
        kernel_time_by_thread(path)  # {'tf_XLAEigen': 2950.1, 'tf_XLAPjRtCpuClient': 41.3, ...}
    """
    with gzip.open(trace_path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {(e.get("pid"), e.get("tid")): (e.get("args") or {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    totals: dict = collections.defaultdict(float)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "hlo_op" not in args or e["name"].startswith("end: "):
            continue
        pool = names.get((e.get("pid"), e.get("tid")), "") or f"tid {e.get('tid')}"
        totals[pool.split("/", 1)[0]] += float(e.get("dur", 0.0))
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def markdown(profile: dict, title: str, meta: dict) -> str:
    """The profile as a markdown page (title, how it was taken, the table)."""
    lines = [f"# {title}", "",
             *[f"- {k}: {v}" for k, v in meta.items()],
             f"- timeline: {profile['timeline']} (XLA events carrying an `hlo_op`), "
             f"total {profile['total_us'] / 1e3:.3f} ms over the profiled steps", "",
             "| # | kernel / thunk | HLO op | calls | total (ms) | share |", "|---:|---|---|---:|---:|---:|"]
    for i, r in enumerate(profile["rows"], 1):
        name = r["name"] if len(r["name"]) <= 80 else r["name"][:77] + "..."
        lines.append(f"| {i} | `{name}` | `{r['hlo_op']}` | {r['count']} | {r['total_us'] / 1e3:.3f} | "
                     f"{100 * r['share']:.1f}% |")
    return "\n".join(lines) + "\n"


def profile_path(device: str, model: str, batch: int, policy: str, dry_run: bool) -> Path:
    sub = "dry_run/profiles" if dry_run else "profiles"
    return common.RESULTS_DIR / sub / f"{common.device_slug(device)}_{model}_b{batch}_{policy}.md"
