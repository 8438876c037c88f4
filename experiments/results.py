"""The comparison table, its JSON/CSV files and PNG plots.

One row per policy, aggregated over seeds: wall time, steps/s, examples/s, peak
device memory (and where that number comes from), final validation accuracy
(mean +- std over seeds), skipped steps and the final loss scale.
matplotlib is imported only when plots are written.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Sequence

import numpy as np

COLUMNS = ("policy", "dtypes", "loss_scaling", "seeds", "wall_time_s", "compile_time_s", "steps",
           "steps_per_s", "examples_per_s", "peak_memory_mb", "memory_source", "val_accuracy",
           "val_accuracy_std", "val_loss", "skipped_steps", "final_loss_scale", "converged", "diverged_runs")


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None], np.float64)
    if not len(v):
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=0))


def aggregate(runs: list[dict], chance_accuracy: float = 0.1) -> list[dict]:
    """Turns per-(policy, seed) results into one row per policy, in first-seen order.

    Args:
      runs: results of `experiments.train.train_and_evaluate`.
      chance_accuracy: a policy whose mean accuracy is below twice this did not converge.
    """
    order, by_policy = [], {}
    for r in runs:
        if r["policy"] not in by_policy:
            order.append(r["policy"])
            by_policy[r["policy"]] = []
        by_policy[r["policy"]].append(r)
    rows = []
    for p in order:
        rs = by_policy[p]
        acc, acc_std = _mean_std([r["val_accuracy"] for r in rs])
        mem = [r["peak_memory_bytes"] for r in rs if r.get("peak_memory_bytes")]
        rows.append({
            "policy": p,
            "dtypes": rs[0]["dtypes"],
            "loss_scaling": rs[0]["loss_scaling"],
            "seeds": len(rs),
            "wall_time_s": _mean_std([r["wall_time_s"] for r in rs])[0],
            # Seeds of one policy share one compiled step in-process: the compile is paid once.
            "compile_time_s": max(r["compile_time_s"] for r in rs),
            "steps": rs[0]["steps"],
            "steps_per_s": _mean_std([r["steps_per_s"] for r in rs])[0],
            "examples_per_s": _mean_std([r["examples_per_s"] for r in rs])[0],
            "peak_memory_mb": (max(mem) / 2**20) if mem else float("nan"),
            "memory_source": rs[0]["memory_source"],
            "val_accuracy": acc,
            "val_accuracy_std": acc_std,
            "val_loss": _mean_std([r["val_loss"] for r in rs])[0],
            "skipped_steps": int(sum(r["skipped_steps"] for r in rs)),
            "final_loss_scale": rs[0]["final_loss_scale"],
            "converged": bool(acc == acc and acc > 2 * chance_accuracy),
            "diverged_runs": sum(bool(r.get("diverged")) for r in rs),
        })
    return rows


def format_table(rows: list[dict], title: str = "") -> str:
    """A Markdown table (what the README shows)."""
    head = ["policy", "dtypes (p/c/o)", "loss scale", "wall time / run", "compile (once)", "steps/s", "examples/s",
            "peak memory", "val accuracy", "skipped steps", "final loss scale"]
    lines = ([f"**{title}**", ""] if title else []) + [
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        acc = f"{100 * r['val_accuracy']:.2f}%"
        if r["seeds"] > 1:
            acc += f" ± {100 * r['val_accuracy_std']:.2f} ({r['seeds']} seeds)"
        if r["diverged_runs"]:
            acc += f" (diverged, stopped at step {r['steps']})"
        elif not r["converged"]:
            acc += " (not converged)"
        mem = "n/a" if math.isnan(r["peak_memory_mb"]) else f"{r['peak_memory_mb']:.1f} MB"
        scale = r["final_loss_scale"]
        lines.append("| " + " | ".join([
            r["policy"], r["dtypes"], r["loss_scaling"], f"{r['wall_time_s']:.1f} s", f"{r['compile_time_s']:.1f} s",
            f"{r['steps_per_s']:.0f}", f"{r['examples_per_s']:.0f}", mem, acc,
            str(r["skipped_steps"]), "-" if scale is None else f"{scale:g}"]) + " |")
    sources = sorted({r["memory_source"] for r in rows})
    lines += ["", "Peak memory: " + "; ".join(sources) + ". Wall time per run includes data loading, "
              "compilation, evaluation and checkpoints; steps/s and examples/s count training steps only; times "
              "are means over seeds (seeds of one policy share one compiled step). Skipped steps: summed over seeds."]
    return "\n".join(lines)


def write_tables(rows: list[dict], runs: list[dict], outdir: str, meta: dict,
                 scale_demo: dict | None = None) -> dict[str, str]:
    """Writes ``results.json`` (rows, every run with its history, meta, the loss-scale demo run),
    ``results.csv`` and ``results.md``."""
    os.makedirs(outdir, exist_ok=True)
    paths = {k: os.path.join(outdir, f"results.{k}") for k in ("json", "csv", "md")}
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "rows": rows, "runs": runs, "scale_demo": scale_demo}, f, indent=1, default=_json_default)
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in COLUMNS})
    with open(paths["md"], "w") as f:
        f.write(format_table(rows, meta.get("title", "")) + "\n")
    return paths


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


_STYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (1, 3)))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _curves(runs: list[dict], key: str, x: str = "wall_time"):
    """Per policy: (mean over seeds of ``x``, mean over seeds of ``key``) at the points that have ``key``."""
    out = {}
    for p in dict.fromkeys(r["policy"] for r in runs):
        hist = [[h for h in r["history"] if h.get(key) is not None and h.get(x) is not None]
                for r in runs if r["policy"] == p]
        n = min(len(h) for h in hist) if hist else 0
        if n:
            out[p] = (np.mean([[h[x] for h in hs[:n]] for hs in hist], axis=0),
                      np.mean([[h[key] for h in hs[:n]] for hs in hist], axis=0))
    return out


def _zoom(values: list[float], pad: float = 0.15, min_span: float = 0.002) -> tuple[float, float] | None:
    """A y range around ``values`` (finite ones) with ``pad`` of their spread (at least ``min_span``) each side."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], np.float64)
    if not len(v):
        return None
    lo, hi = float(v.min()), float(v.max())
    span = max(hi - lo, min_span)
    return lo - pad * span, hi + pad * span


def plot_accuracy_loss(runs: list[dict], path: str, title: str = "", rows: list[dict] | None = None) -> str:
    """Validation accuracy, validation loss and training loss against wall time, one line per policy,
    and the final validation accuracy per policy (mean +- std over seeds).

    The accuracy axes are zoomed to where the policies differ: the curve panel to the second half
    of training (the early, low points lie below it), the final-accuracy panel to the values.
    """
    plt = _pyplot()
    rows = rows if rows is not None else aggregate(runs)
    # Zoom onto the policies that trained; one that diverged would stretch the axis back to chance.
    trained = {r["policy"] for r in rows if r["converged"] and not r["diverged_runs"]} or {r["policy"] for r in rows}
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4), gridspec_kw={"width_ratios": [1, 1, 1, 0.8]})
    panels = (("val_accuracy", "validation accuracy (zoomed: second half of training)", False),
              ("val_loss", "validation loss", True), ("train_loss", "training loss (mean over log interval)", True))
    late = []
    for ax, (key, label, log) in zip(axes, panels):
        for i, (p, (t, vals)) in enumerate(_curves(runs, key).items()):
            # Policies that train alike overlap: vary the line style so each stays visible.
            ax.plot(t, vals, linestyle=_STYLES[i % len(_STYLES)], marker="o" if key != "train_loss" else None,
                    ms=3, label=p)
            if key == "val_accuracy" and p in trained:
                late += list(vals[len(vals) // 2:])
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    zoom = _zoom(late)
    if zoom:
        axes[0].set_ylim(*zoom)
    axes[0].legend(title="policy")
    ax = axes[3]
    means = [100 * r["val_accuracy"] for r in rows]
    stds = [100 * r["val_accuracy_std"] for r in rows]
    xs = np.arange(len(rows))
    ax.errorbar(xs, means, yerr=stds, fmt="none", ecolor="0.3", capsize=4)
    zoom = _zoom([m + d * s for m, s, r in zip(means, stds, rows) if r["policy"] in trained for d in (-1, 1)],
                 pad=0.3, min_span=0.2)  # percent: at least 0.2 point
    if zoom:
        ax.set_ylim(*zoom)
    ax.ticklabel_format(axis="y", useOffset=False)
    for i, (m, r) in enumerate(zip(means, rows)):
        if zoom and m < zoom[0]:  # off the zoomed axis: marked at its foot, with its value
            at = zoom[0] + 0.04 * (zoom[1] - zoom[0])
            ax.plot([i], [at], "v", color=f"C{i}", ms=7)
            ax.annotate(f"{m:.2f}% (below)", (i, at), textcoords="offset points", xytext=(8, 0), fontsize=8,
                        va="center")
            continue
        ax.plot([i], [m], "o", color=f"C{i}", ms=7)
        ax.annotate(f"{m:.2f}%", (i, m), textcoords="offset points", xytext=(8, 0), fontsize=8, va="center")
    ax.set_xticks(xs, [r["policy"] for r in rows], rotation=20)
    ax.set_xlim(-0.5, len(rows) - 0.3)
    seeds = max((r["seeds"] for r in rows), default=1)
    ax.set_ylabel("final validation accuracy (%)")
    ax.set_title(f"final accuracy, mean ± std over {seeds} seed(s)" if seeds > 1 else "final accuracy", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle((title + "\n" if title else "") + "against training wall time (evaluation and checkpoints "
                 "included, compilation excluded; mean over seeds)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def scale_trace(run: dict) -> tuple[list[int], list[float], list[int]]:
    """(steps, loss scale after each, skipped steps) of a run, from its history rows."""
    steps, scales, skipped, last = [0], [None], [], None
    for h in run["history"]:
        for s, x in h.get("scale_changes", []):
            steps.append(s)
            scales.append(x)
        steps.append(h["step"])
        scales.append(h["loss_scale"])
        skipped += h.get("skipped_at", [])
        last = h["loss_scale"]
    order = np.argsort(steps, kind="stable")
    steps, scales = [steps[i] for i in order], [scales[i] for i in order]
    # Step 0: the configured initial scale where the run set one, else the first one logged.
    scales[0] = run.get("config", {}).get("dynamic_scale_init") or next((x for x in scales if x is not None), last)
    return steps, scales, sorted(set(skipped))


def plot_loss_scale(demo: dict | None, runs: list[dict], path: str) -> str:
    """The loss scale of a run that exercises dynamic scaling (log axis, skipped steps marked),
    with the comparison's policies' final scales as reference lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if demo is not None:
        steps, scales, skipped = scale_trace(demo)
        ax.step(steps, scales, where="post", color="C0", lw=1.5, label=f"{demo['policy']}: {demo['loss_scaling']}")
        at = np.interp(skipped, steps, scales) if skipped else []
        ax.plot(skipped, at, "x", color="C3", ms=6, mew=1.5, label=f"skipped step ({len(skipped)})")
        ax.set_title(f"dynamic loss scale over a {demo['policy']} run: {len(skipped)} overflowing steps skipped, "
                     f"final scale {demo['final_loss_scale']:g}", fontsize=10)
    by_scale: dict = {}  # the comparison's runs, one reference line per final scale
    for r in runs:
        names = by_scale.setdefault(r["final_loss_scale"], [])
        if r["policy"] not in names:
            names.append(r["policy"])
    for i, (s, names) in enumerate(sorted(by_scale.items())):
        ax.axhline(s, color="0.4", ls=":", lw=1)
        ax.annotate(f"final scale of {', '.join(names)} in the comparison: {s:g}", (0.99, s),
                    xycoords=("axes fraction", "data"), fontsize=8, ha="right", va="bottom", color="0.3")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale after the step (log2 axis)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


CPU_NOTE = ("CPU run: these timings are NOT a speed result. XLA on a CPU computes most half-precision ops in "
            "float32 and adds casts,\nso mixed precision looks slower here; its speed shows only on a GPU or TPU. "
            "Memory: the compiled step's estimate, not a measured peak.")


def plot_throughput_memory(rows: list[dict], path: str, title: str = "", device: str = "") -> str:
    """Examples/s and peak memory per policy as bars, labelled with their values.

    On a CPU (``device`` names one) the figure says, on it, that the timings are not a speed result.
    """
    plt = _pyplot()
    cpu = "cpu" in device.lower()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8 if cpu else 4))
    names = [r["policy"] for r in rows]
    for ax, key, label, fmt in ((axes[0], "examples_per_s", "training throughput (examples/s)", "{:.0f}"),
                                (axes[1], "peak_memory_mb", "peak memory (MB)", "{:.2f}")):
        vals = [r[key] for r in rows]
        bars = ax.bar(names, vals, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, [fmt.format(v) for v in vals], fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
        ax.tick_params(axis="x", labelrotation=20)
    axes[1].set_title(rows[0]["memory_source"] if rows else "", fontsize=8)
    fig.suptitle(title or "throughput and memory per policy")
    if cpu:
        fig.tight_layout(rect=(0, 0.13, 1, 1))
        fig.text(0.5, 0.015, CPU_NOTE, ha="center", va="bottom", fontsize=9, color="darkred", weight="bold",
                 bbox={"boxstyle": "round", "facecolor": "mistyrose", "edgecolor": "darkred"})
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(runs: list[dict], rows: list[dict], outdir: str, title: str = "", demo: dict | None = None) -> list[str]:
    """Writes ``accuracy_loss.png``, ``loss_scale.png`` and ``throughput_memory.png``; returns the paths."""
    os.makedirs(outdir, exist_ok=True)
    device = runs[0].get("device", "") if runs else ""
    return [plot_accuracy_loss(runs, os.path.join(outdir, "accuracy_loss.png"), title, rows),
            plot_loss_scale(demo, runs, os.path.join(outdir, "loss_scale.png")),
            plot_throughput_memory(rows, os.path.join(outdir, "throughput_memory.png"), title, device)]
