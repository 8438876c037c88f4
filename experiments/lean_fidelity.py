"""Fidelity of the memory-lean recipes against float32 masters, 3 seeds, on two jobs (CPU, offline).

    python -m experiments.lean_fidelity                         # both jobs, 3 seeds (minutes on CPU)
    python -m experiments.lean_fidelity --dry-run --out -       # a few steps (the tests use it)

Jobs:

* ``mnist1d`` -- the main job: the 1-D CNN with BatchNorm of ``experiments/configs/cpu.py`` on
  its embedded MNIST-1D (20000 examples, 80/20 split), batch 128, AdamW 1e-2 with weight decay
  1e-4 on kernels, 62 warm-up steps then cosine to 0 over 1000 steps, run under
  ``jaxmp.autocast(..., "O2-bf16")`` (the experiments' ``AutocastModel``). Metric: test accuracy.
* ``lm`` -- a small causal Transformer LM (2 pre-LN blocks, d=64, 4 heads, context 64, bytes as
  tokens) trained on the docstrings of the installed ``optax``, ``flax`` and ``numpy`` packages
  (read from their source files with ``ast.get_docstring``, files in sorted order; the last 10%
  held out), batch 32, AdamW 3e-3, 50 warm-up steps then cosine to 0 over 1500 steps, the same
  O2-bf16 autocast. Metric: held-out loss in bits per byte.

Recipes (``jaxmp.lean.preset``, bf16 params, ``loss_scale="none"``): ``fp32-masters`` (the
reference), ``remainders``, ``sr-params``, ``bf16-sr``, and ``plain-bf16`` (bf16 params updated by
round to nearest, no master: the failure mode). A recipe passes when its seed mean is within the
float32-master seed spread (max - min) or 1% of the reference mean, whichever is larger. For the
reference run the median over the largest kernel of |master step| / (ulp of its bf16 param) is
reported for the last fifth of training (the decayed-learning-rate tail): below 0.5, round to
nearest drops the update, stochastic rounding keeps it in expectation.

Seeds vary the init, the data order and the SR key; the three seeds of a recipe share one
compilation (the whole run is one jitted ``lax.scan``). Writes ``experiments/recorded/lean_fidelity_<device>.json`` (or ``--out``) with
the device, the JAX version and the git commit.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

RECIPES = ("fp32-masters", "remainders", "sr-params", "bf16-sr", "plain-bf16")
JOBS = ("mnist1d", "lm")
SEEDS = (0, 1, 2)
FULL = {"mnist1d": dict(steps=1000, warmup=62, lr=1e-2, batch=128),
        "lm": dict(steps=1500, warmup=50, lr=3e-3, batch=32)}
DRY = {"mnist1d": dict(steps=4, warmup=1, lr=1e-2, batch=16), "lm": dict(steps=4, warmup=1, lr=3e-3, batch=4)}
CONTEXT = 64
TEXT_PACKAGES = ("optax", "flax", "numpy")


# --------------------------------------------------------------------------- data


def docstring_text(packages=TEXT_PACKAGES, limit_bytes: int = 2_000_000) -> bytes:
    """The docstrings of the installed ``packages``' source files, in sorted file order (offline)."""
    import importlib.util

    parts, size = [], 0
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(list(spec.submodule_search_locations)[0])
        for path in sorted(root.rglob("*.py")):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
            except (SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        parts.append(doc)
                        size += len(doc) + 2
            if size >= limit_bytes:   # enough text: stop reading sources
                return "\n\n".join(parts).encode("utf-8", errors="replace")[:limit_bytes]
    text = "\n\n".join(parts).encode("utf-8", errors="replace")
    return text[:limit_bytes]


def _mnist1d():
    from experiments.data import embedded

    train = embedded.mnist1d("train", num_samples=20000)
    test = embedded.mnist1d("test", num_samples=20000)
    return (train.inputs, train.labels), (test.inputs, test.labels)


# --------------------------------------------------------------------------- models


def _lm_module(vocab=256, d=64, heads=4, layers=2, mlp=256):
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            x = x + nn.SelfAttention(num_heads=heads, qkv_features=d)(nn.LayerNorm()(x), mask=mask)
            h = nn.Dense(mlp)(nn.LayerNorm()(x))
            return x + nn.Dense(d)(nn.gelu(h))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, d)(tokens) + self.param("pos", nn.initializers.normal(0.02), (CONTEXT, d))
            for _ in range(layers):
                x = Block()(x)
            return nn.Dense(vocab)(nn.LayerNorm()(x))

    return LM()


def _recipe_tx(recipe, schedule, seed):
    import jax
    import optax

    import jaxmp
    from jaxmp import lean

    decay_mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)  # noqa: E731
    inner = optax.adamw(schedule, weight_decay=1e-4, mask=decay_mask)
    if recipe == "plain-bf16":
        return jaxmp.loss_scaling(lean.bf16_params(inner, rounding="nearest"), "none")
    return jaxmp.loss_scaling(lean.preset(recipe, inner, key=seed if recipe != "fp32-masters" else None), "none")


def run_job(job: str, recipe: str, size: dict, seeds=SEEDS) -> dict:
    """Trains ``recipe`` on ``job`` for every seed (vmapped). Returns the metric per seed and the tail ratio."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxmp
    from experiments.models import get_model
    from experiments.program import AutocastModel

    steps, batch = size["steps"], size["batch"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, size["lr"], size["warmup"], steps, 0.0)
    txs = [_recipe_tx(recipe, schedule, s) for s in seeds]
    tx = txs[0]   # the update reads each seed's key from its state

    if job == "mnist1d":
        (x_train, y_train), (x_test, y_test) = _mnist1d()
        model = AutocastModel(get_model("cnn1d", 10, features=(32, 32, 32), kernel_sizes=(5, 3, 3),
                                        use_batchnorm=True), "O2-bf16")
        n_train = len(x_train)

        def init(seed):
            v = model.init(jax.random.key(seed), jnp.asarray(x_train[:2]), train=False)
            return v["params"], v.get("batch_stats", {})

        def loss_fn(params, stats, idx):
            x, y = jnp.asarray(x_train)[idx], jnp.asarray(y_train)[idx]
            logits, new = model.apply({"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1)), new["batch_stats"]

        def metric(params, stats):
            logits = model.apply({"params": params, "batch_stats": stats}, jnp.asarray(x_test), train=False)
            return jnp.mean((jnp.argmax(logits, -1) == jnp.asarray(y_test)).astype(jnp.float32))

        def batch_indices(seed):
            rng = np.random.default_rng(1000 + seed)
            order = np.concatenate([rng.permutation(n_train) for _ in range(steps * batch // n_train + 1)])
            return order[: steps * batch].reshape(steps, batch)
        metric_name, higher_is_better = "test_accuracy", True
    else:
        text = np.frombuffer(docstring_text(), np.uint8).astype(np.int32)
        split = int(len(text) * 0.9)
        train_text, test_text = text[:split], text[split:]
        model = AutocastModel(_lm_module(), "O2-bf16")
        starts = np.arange(0, len(test_text) - CONTEXT - 1, CONTEXT)[:256]
        test_x = np.stack([test_text[s:s + CONTEXT] for s in starts])
        test_y = np.stack([test_text[s + 1:s + CONTEXT + 1] for s in starts])

        def init(seed):
            return model.init(jax.random.key(seed), jnp.zeros((1, CONTEXT), jnp.int32))["params"], {}

        def xent(params, x, y):
            logits = model.apply({"params": params}, x).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))

        train_dev = jnp.asarray(train_text)

        def loss_fn(params, stats, starts_b):
            idx = starts_b[:, None] + jnp.arange(CONTEXT + 1)[None, :]
            seq = train_dev[idx]
            return xent(params, seq[:, :-1], seq[:, 1:]), stats

        def metric(params, stats):
            return xent(params, jnp.asarray(test_x), jnp.asarray(test_y)) / np.log(2.0)   # bits per byte

        def batch_indices(seed):
            rng = np.random.default_rng(1000 + seed)
            return rng.integers(0, len(train_text) - CONTEXT - 1, size=(steps, batch))
        metric_name, higher_is_better = "test_bits_per_byte", False

    inits = [init(s) for s in seeds]
    has_master = recipe == "fp32-masters"
    kernel = max(jax.tree_util.tree_leaves_with_path(inits[0][0]), key=lambda kv: kv[1].size)[0]

    def get_kernel(tree):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if path == kernel:
                return leaf
        raise KeyError(kernel)

    def train(params, stats, opt, idx):
        def body(carry, batch_idx):
            p, st, s = carry
            (loss, new_st), grads = jaxmp.value_and_grad(loss_fn, s, has_aux=True)(p, st, batch_idx)
            updates, s_new = tx.update(grads, s, p)
            p_new = jaxmp.apply_updates(p, updates, s_new)
            ratio = jnp.zeros(())
            if has_master:
                step_ = get_kernel(jaxmp.master_params(s_new)) - get_kernel(jaxmp.master_params(s))
                w = get_kernel(p)
                ulp = jnp.nextafter(w, jnp.asarray(jnp.inf, w.dtype)).astype(jnp.float32) - w.astype(jnp.float32)
                ratio = jnp.median(jnp.abs(step_) / ulp)
            return (p_new, new_st, s_new), (loss, ratio)

        (p, st, _), (losses, ratios) = jax.lax.scan(body, (params, stats, opt), idx)
        return metric(p, st), losses, ratios

    t0 = time.time()
    jitted = jax.jit(train)
    results = [jitted(p, st, t.init(p), jnp.asarray(batch_indices(s))) for s, t, (p, st) in zip(seeds, txs, inits)]
    values = np.asarray([r[0] for r in results], np.float64)
    losses = np.stack([np.asarray(r[1]) for r in results])
    ratios = np.stack([np.asarray(r[2]) for r in results])
    out = {"job": job, "recipe": recipe, "metric": metric_name, "higher_is_better": higher_is_better,
           "values": values.tolist(), "mean": float(values.mean()), "final_train_loss": np.asarray(losses)[:, -1].tolist(),
           "seconds": round(time.time() - t0, 1), "steps": steps, "batch": batch}
    if has_master:
        tail = np.asarray(ratios)[:, -max(steps // 5, 1):]
        out["tail_update_over_ulp_median"] = float(np.median(tail))
        out["tail_kernel"] = jax.tree_util.keystr(kernel)
    return out


def verdicts(rows: list[dict]) -> dict:
    """Per job: the tolerance (max(seed spread, 1% of the mean) of fp32-masters) and each recipe's pass/fail."""
    out = {}
    for job in {r["job"] for r in rows}:
        ref = next(r for r in rows if r["job"] == job and r["recipe"] == "fp32-masters")
        tol = max(max(ref["values"]) - min(ref["values"]), 0.01 * abs(ref["mean"]))
        out[job] = {"tolerance": tol, "reference_mean": ref["mean"],
                    "recipes": {r["recipe"]: {"mean": r["mean"], "diff": r["mean"] - ref["mean"],
                                              "within": abs(r["mean"] - ref["mean"]) <= tol}
                                for r in rows if r["job"] == job}}
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="4 steps per run (the tests use it)")
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma list of {', '.join(JOBS)}")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"comma list of {', '.join(RECIPES)}")
    parser.add_argument("--out", help="JSON path ('-': print only); default experiments/recorded/lean_fidelity_<device>.json")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    jobs, recipes = args.jobs.split(","), args.recipes.split(",")
    for j in jobs:
        if j not in JOBS:
            raise SystemExit(f"unknown job {j!r}: choose from {', '.join(JOBS)}")
    for r in recipes:
        if r not in RECIPES:
            raise SystemExit(f"unknown recipe {r!r}: choose from {', '.join(RECIPES)}")
    if "fp32-masters" not in recipes:
        raise SystemExit("the fp32-masters recipe is the reference: include it in --recipes")
    import jax

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import _common as common

    rows = []
    for job in jobs:
        size = (DRY if args.dry_run else FULL)[job]
        for recipe in recipes:
            rows.append(run_job(job, recipe, size))
            r = rows[-1]
            print(f"{job:8s} {recipe:13s} {r['metric']} per seed {[round(v, 4) for v in r['values']]} "
                  f"mean {r['mean']:.4f} ({r['seconds']} s)"
                  + (f"  tail update/ulp {r['tail_update_over_ulp_median']:.3f}" if "tail_update_over_ulp_median" in r
                     else ""), flush=True)
    result = {"created_utc": common.utc_now(), "dry_run": args.dry_run, "env": common.jax_env(),
              "command": "python -m experiments.lean_fidelity " + " ".join(argv if argv is not None else sys.argv[1:]),
              "text": {"packages": list(TEXT_PACKAGES), "bytes": len(docstring_text()) if "lm" in jobs else None},
              "rows": rows, "verdicts": verdicts(rows), "device_count": jax.device_count()}
    for job, v in result["verdicts"].items():
        print(f"{job}: tolerance {v['tolerance']:.4f} around {v['reference_mean']:.4f}: "
              + ", ".join(f"{k} {'ok' if x['within'] else 'OUT'} ({x['diff']:+.4f})" for k, x in v["recipes"].items()))
    out = args.out
    if out is None:
        out = str(Path(__file__).resolve().parent / "recorded" /
                  f"lean_fidelity_{common.device_slug(result['env']['device'])}{'_dry' if args.dry_run else ''}.json")
    if out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
