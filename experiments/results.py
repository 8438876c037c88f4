"""The comparison table (seed 000's shape), its JSON/CSV files and PNG plots.

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
      runs: results of :func:`experiments.train.train_and_evaluate`.
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


def write_tables(rows: list[dict], runs: list[dict], outdir: str, meta: dict) -> dict[str, str]:
    """Writes ``results.json`` (rows, every run with its history, meta), ``results.csv`` and ``results.md``."""
    os.makedirs(outdir, exist_ok=True)
    paths = {k: os.path.join(outdir, f"results.{k}") for k in ("json", "csv", "md")}
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "rows": rows, "runs": runs}, f, indent=1, default=_json_default)
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


def _curves(runs: list[dict], key: str):
    """Per policy: (steps, mean over seeds of ``key``) over the eval/log points."""
    out = {}
    for p in dict.fromkeys(r["policy"] for r in runs):
        hist = [[h for h in r["history"] if h.get(key) is not None] for r in runs if r["policy"] == p]
        if not hist or not hist[0]:
            continue
        n = min(len(h) for h in hist)
        steps = [h["step"] for h in hist[0][:n]]
        vals = np.mean([[h[key] for h in hs[:n]] for hs in hist], axis=0)
        out[p] = (steps, vals)
    return out


def write_plots(runs: list[dict], outdir: str, title: str = "") -> list[str]:
    """Writes ``accuracy_loss.png`` (validation accuracy and loss per policy over steps) and
    ``loss_scale.png`` (loss scale per policy over steps); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, label in zip(axes, ("val_accuracy", "val_loss", "train_loss"),
                              ("validation accuracy", "validation loss", "training loss")):
        for i, (p, (steps, vals)) in enumerate(_curves(runs, key).items()):
            # Policies that train alike overlap: vary the line style so each stays visible.
            ax.plot(steps, vals, linestyle=_STYLES[i % len(_STYLES)], marker=None if key == "train_loss" else "o",
                    ms=3, label=p)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if key != "val_accuracy":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title or "accuracy and loss per policy (mean over seeds)")
    fig.tight_layout()
    paths.append(os.path.join(outdir, "accuracy_loss.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (p, (steps, vals)) in enumerate(_curves(runs, "loss_scale").items()):
        ax.step(steps, vals, where="post", linestyle=_STYLES[i % len(_STYLES)], label=p)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title("loss scale per policy (1 = no scaling)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(outdir, "loss_scale.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
