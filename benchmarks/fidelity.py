"""Fidelity of the memory-lean recipes (``jaxmp.lean``) against float32 masters, 3 seeds, two jobs.

    python -m benchmarks.fidelity                 # the study (~10-15 min on 2 busy CPU cores)
    python -m benchmarks.fidelity --dry-run --out /tmp/fid.json   # seconds: tiny models, 2 seeds

Jobs:

* ``main``: the experiments' default CPU job (``experiments/configs/cpu.py``: MNIST-1D, the 1-D
  CNN, AdamW, cosine decay to 0), trained by ``experiments.train.train_and_evaluate`` under
  ``O2-bf16`` with ``--config.lean_recipe`` set per recipe; eval loss/accuracy on the test split.
* ``lm``: a small character-level causal Transformer LM (``benchmarks/_lm.py``: 2 layers, width
  64, context 64) on the docstrings of Python standard-library modules (offline, read with
  ``ast``), O2-bf16 through ``jaxmp.flax``, AdamW with warm-up and cosine decay to 0; eval loss
  and next-character accuracy on the held-out last 10% of the text.

Recipes: ``fp32-masters`` (O2-bf16 + AdamW with float32 masters: the reference), each
``jaxmp.lean`` preset, and ``bf16-nearest`` (plain bf16 params rounded to nearest, no master).

Verdicts: a recipe is *within* when ``|mean - mean_ref| <= max(spread_ref, 1% of |mean_ref|)``,
where ``spread_ref`` is max - min over the float32-master seeds (eval loss; accuracy the same way).

The decayed tail: both jobs end with a cosine decay to 0. Over the last ``--tail-fraction`` of
the steps the float32-master runs record, per step, ``|master_{t+1} - master_t| / ulp_bf16(param_t)``
over every bf16 param element (ulp of the stored bf16 value): the median per step, then the
median over the tail, and the fraction of elements below half an ulp (an update round-to-nearest
bf16 params would drop). For ``main`` that is measured by replaying the reference run with the
experiments' own compiled step (the replay's final eval must equal the recorded one, and the
JSON says whether it does); the LM measures it in its loop, and also the fraction of bf16 params
that change per tail step in every run (plain bf16 stalls where SR keeps moving).
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import REPO_ROOT, add_common_args, emit, jax_env, log, make_result

#: The quantized presets with every leaf quantized (``-all``) and moments rounded stochastically
#: too (``-all-sr``): `experiments.validation.LEAN_QUANTIZED_STUDY`, recorded apart
#: (``--recipes fp32-masters,<these>``: benchmarks/results/fidelity/fidelity_quantized_cpu.json).
QUANTIZED_STUDY = ("bf16-sr-8bit-all", "bf16-sr-8bit-all-sr", "bf16-sr-4bit-all", "bf16-sr-4bit-all-sr")
RECIPES = ("fp32-masters", "remainders", "masters-bf16-moments", "sr-params", "remainders-bf16-moments", "bf16-sr",
           "bf16-nearest", "remainders-8bit", "bf16-sr-8bit", "remainders-4bit", "bf16-sr-4bit") + QUANTIZED_STUDY
"""What is compared: the reference, the ``jaxmp.lean`` presets (bytes/param in ``jaxmp.lean.PRESETS``),
plain bf16 params rounded to nearest, and the quantized presets with every leaf quantized, moments
rounded to nearest or stochastically (``-all``, ``-all-sr``: `experiments.validation.LEAN_QUANTIZED_STUDY`)."""
SR_RECIPES = ("masters-bf16-moments", "sr-params", "remainders-bf16-moments", "bf16-sr", "bf16-sr-8bit",
              "bf16-sr-4bit") + QUANTIZED_STUDY
REFERENCE = "fp32-masters"
NEAREST = "bf16-nearest"
DEFAULT_OUT = str(REPO_ROOT / "benchmarks" / "results" / "fidelity" / "fidelity_cpu.json")

LM_FULL = dict(context=64, width=64, num_layers=2, num_heads=4, mlp_dim=256, batch_size=16, steps=400,
               warmup=40, learning_rate=3e-3, weight_decay=0.01, eval_windows=256, max_chars=None)
LM_DRY = dict(context=16, width=16, num_layers=1, num_heads=2, mlp_dim=32, batch_size=8, steps=12,
              warmup=2, learning_rate=3e-3, weight_decay=0.01, eval_windows=16, max_chars=20000)
MAIN_DRY = {"num_train_steps": 12, "mnist1d_num_samples": 400, "model_kwargs.features": (8,),
            "model_kwargs.kernel_sizes": (3,), "eval_batch_size": 100}


# ------------------------------------------------------------------------------ the ulp ratio


def bf16_ulp(p: np.ndarray) -> np.ndarray:
    """The spacing of bfloat16 values at ``|p|`` (2**(e - 8) for ``|p| = m 2**e``, m in [0.5, 1)); 0 at 0."""
    p = np.abs(np.asarray(p, np.float32))
    _, e = np.frexp(p)
    return np.where(p > 0, np.ldexp(np.float32(1), e - 8), 0).astype(np.float32)


def update_ulp_ratios(before: list, after: list, params: list) -> np.ndarray:
    """``|after - before| / ulp_bf16(param)`` over every element (params equal to 0 left out)."""
    out = []
    for b, a, p in zip(before, after, params):
        ulp = bf16_ulp(p).ravel()
        keep = ulp > 0
        out.append((np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).ravel()[keep] / ulp[keep]))
    return np.concatenate(out) if out else np.zeros(0, np.float32)


class TailStats:
    """Accumulates the per-step ratios of the tail: per-step medians and the below-half-ulp fraction."""

    def __init__(self):
        self.medians, self.below, self.count = [], 0, 0

    def add(self, ratios: np.ndarray) -> None:
        if ratios.size:
            self.medians.append(float(np.median(ratios)))
            self.below += int(np.sum(ratios < 0.5))
            self.count += int(ratios.size)

    def result(self, steps: int, first: int, lr_first: float, lr_last: float) -> dict:
        m = self.medians
        return {"tail_steps": steps, "tail_first_step": first, "lr_at_tail_start": lr_first,
                "lr_at_last_step": lr_last,
                "median_update_over_ulp": float(np.median(m)) if m else None,
                "median_update_over_ulp_first_tail_step": m[0] if m else None,
                "median_update_over_ulp_last_tail_step": m[-1] if m else None,
                "fraction_below_half_ulp": self.below / self.count if self.count else None,
                "elements_per_step": self.count // max(len(m), 1)}


def _bf16_leaves(params) -> list:
    import jax
    import jax.numpy as jnp

    return [i for i, x in enumerate(jax.tree_util.tree_leaves(params)) if x.dtype == jnp.bfloat16]


def _host_leaves(tree, idx) -> list:
    import jax

    leaves = jax.tree_util.tree_leaves(tree)
    return [np.asarray(jax.device_get(leaves[i])).astype(np.float32) for i in idx]


# ------------------------------------------------------------------------------ the main job


def main_config(dry: bool, steps: int | None):
    from experiments import configs

    c = configs.get_config("cpu")
    c.policy = "O2-bf16"
    c.progress_bar = False
    if dry:
        for k, v in MAIN_DRY.items():
            if k.startswith("model_kwargs."):
                c.model_kwargs[k.split(".", 1)[1]] = v
            else:
                c[k] = v
    if steps:
        c.num_train_steps = steps
    return c


def _main_run(config, recipe: str, seed: int, workdir: str) -> dict:
    from experiments import train

    c = copy.deepcopy(config)
    c.lean_recipe = "" if recipe == REFERENCE else recipe
    r = train.train_and_evaluate(c, workdir, policy="O2-bf16", seed=seed)
    return {"seed": seed, "eval_loss": r["val_loss"], "eval_accuracy": r["val_accuracy"],
            "train_loss": r["train_loss"], "steps": r["steps"], "train_time_s": r["train_time_s"],
            "compile_time_s": r["compile_time_s"], "master_weights": r["master_weights"],
            "skipped_steps": r["skipped_steps"]}


def main_tail(config, seed: int, tail_fraction: float) -> dict:
    """Replays the float32-master run of ``seed`` with the experiments' step, measuring the tail's update/ulp."""
    import jax

    import jaxmp
    import jaxmp.parallel as mpp
    from experiments import program as program_lib
    from experiments import train
    from experiments.input_pipeline import device_batches

    c = copy.deepcopy(config)
    c.lean_recipe = ""
    run = train.setup_run(c, policy="O2-bf16", seed=seed)
    plan, prog = run.plan, run.prog
    sample = np.zeros((1, *run.train_src.input_shape), np.float32)
    state = mpp.replicate_on_mesh(prog.init(jax.random.key(plan.seed), sample), prog.mesh)
    rng = jax.random.key(plan.seed + 1)
    batches = device_batches(run.train_src, plan.global_batch_size, seed=plan.seed, start=0, mesh=prog.mesh)
    n = plan.num_train_steps
    first = n - max(1, int(round(tail_fraction * n)))
    idx = _bf16_leaves(state.params)
    stats = TailStats()
    step_fn = prog.compiled.get("train") or prog.train_step  # the run's own AOT-compiled step, when cached
    for step in range(n):
        tail = step >= first
        if tail:
            params = _host_leaves(state.params, idx)
            before = _host_leaves(jaxmp.master_params(state.opt_state), idx)
        state, _ = step_fn(state, next(batches), rng)
        if tail:
            stats.add(update_ulp_ratios(before, _host_leaves(jaxmp.master_params(state.opt_state), idx), params))
    schedule = program_lib.make_schedule(plan, c.lr_schedule)
    out = stats.result(n - first, first + 1, float(schedule(first)), float(schedule(n - 1)))
    ev = train.evaluate(run, state)
    out.update(replay_eval_loss=ev["val_loss"], replay_eval_accuracy=ev["val_accuracy"])
    return out


def _main_tails(config, seeds, refs, tail_fraction, quiet) -> list:
    tails = []
    for seed, ref in zip(seeds, refs):
        tail = main_tail(config, seed, tail_fraction)
        tail["seed"] = seed
        tail["replay_equals_run"] = (tail["replay_eval_loss"] == ref["eval_loss"]
                                     and tail["replay_eval_accuracy"] == ref["eval_accuracy"])
        log(f"main tail seed {seed}: median update/ulp {tail['median_update_over_ulp']:.3g}, "
            f"below half an ulp {tail['fraction_below_half_ulp']:.3f}", quiet)
        tails.append(tail)
    return tails


def run_main(args, seeds, recipes, quiet) -> dict:
    config = main_config(args.dry_run, args.main_steps)
    root = tempfile.mkdtemp(prefix="jaxmp_fidelity_main_")
    runs = {r: [] for r in recipes}
    tails = []
    try:
        for recipe in recipes:
            for seed in seeds:
                t = time.perf_counter()
                res = _main_run(config, recipe, seed, os.path.join(root, f"{recipe}_{seed}"))
                log(f"main {recipe} seed {seed}: eval loss {res['eval_loss']:.4f}, acc {res['eval_accuracy']:.4f} "
                    f"({time.perf_counter() - t:.1f} s)", quiet)
                runs[recipe].append(res)
            if recipe == REFERENCE:  # now, while the run's compiled step is still cached
                tails = _main_tails(config, seeds, runs[REFERENCE], args.tail_fraction, quiet)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    setup = {"config": "experiments/configs/cpu.py", "policy": "O2-bf16", "model": config.model,
             "model_kwargs": config.model_kwargs.to_dict(), "dataset": config.dataset,
             "mnist1d_num_samples": config.mnist1d_num_samples, "num_train_steps": runs[recipes[0]][0]["steps"],
             "global_batch_size": config.global_batch_size, "learning_rate": config.learning_rate,
             "lr_schedule": config.lr_schedule, "optimizer": config.optimizer, "weight_decay": config.weight_decay,
             "eval": "test split (20% of the MNIST-1D examples)"}
    return {"setup": setup, "runs": runs, "tail": tails}


# ------------------------------------------------------------------------------ the LM


def _lm_tx(recipe: str, hp: dict, seed: int):
    import jax
    import optax

    import jaxmp
    from experiments.program import lean_optimizer

    schedule = optax.warmup_cosine_decay_schedule(0.0, hp["learning_rate"], hp["warmup"], hp["steps"], 0.0)
    decay_mask = lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p)  # noqa: E731
    inner = optax.adamw(schedule, weight_decay=hp["weight_decay"], mask=decay_mask)
    if recipe == REFERENCE:
        return jaxmp.loss_scaling(inner, "none", master_weights=True), schedule
    return jaxmp.loss_scaling(lean_optimizer(inner, recipe, seed), "none"), schedule


_LM_PROGRAMS: dict = {}


def _lm_program(recipe: str, hp: dict):
    """(model, step, eval) of ``recipe``, compiled once for every seed: a stochastic recipe's key is
    read from the optimizer state, never from the step, so the seeds share the step."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxmp.flax
    from benchmarks import _lm

    key = (recipe, tuple(sorted(hp.items())))
    if key not in _LM_PROGRAMS:
        module = _lm.CausalLM(context=hp["context"], width=hp["width"], num_layers=hp["num_layers"],
                              num_heads=hp["num_heads"], mlp_dim=hp["mlp_dim"])
        model = jaxmp.flax.mixed_precision(module, "O2-bf16")

        def eval_fn(state, batch):
            logits = state.model.apply(state.variables, batch["inputs"]).astype(jnp.float32)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            return jnp.sum(loss), jnp.sum(jnp.argmax(logits, -1) == batch["label"]), loss.size

        tx, schedule = _lm_tx(recipe, hp, 0)
        _LM_PROGRAMS[key] = (model, tx, schedule, jax.jit(jaxmp.flax.make_train_step(), donate_argnums=0),
                             jax.jit(eval_fn))
    return _LM_PROGRAMS[key]


def lm_run(text, recipe: str, seed: int, hp: dict, tail_fraction: float) -> dict:
    """Trains the LM under ``recipe`` from seed ``seed``; eval loss/accuracy on the held-out text."""
    import jax
    import jax.numpy as jnp

    import jaxmp
    import jaxmp.flax
    from benchmarks import _lm

    model, tx, schedule, step_fn, eval_fn = _lm_program(recipe, hp)
    sample = jnp.zeros((1, hp["context"]), jnp.int32)
    state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(seed), sample), tx)
    # The seed's stochastic-rounding key: the state of the same recipe built with key = seed.
    state = state.replace(opt_state=_lm_tx(recipe, hp, seed)[0].init(state.params))
    n = hp["steps"]
    first = n - max(1, int(round(tail_fraction * n)))
    idx = _bf16_leaves(state.params)
    stats, changed = TailStats(), []
    t0 = time.perf_counter()
    for step in range(n):
        tail = step >= first
        if tail:
            params = _host_leaves(state.params, idx)
            if recipe == REFERENCE:
                before = _host_leaves(jaxmp.master_params(state.opt_state), idx)
        batch = _lm.train_batch(text.train, step, hp["batch_size"], hp["context"], seed)
        state, metrics = step_fn(state, batch)
        if tail:
            new = _host_leaves(state.params, idx)
            changed.append(sum(int(np.sum(a != b)) for a, b in zip(new, params)) / sum(p.size for p in params))
            if recipe == REFERENCE:
                stats.add(update_ulp_ratios(before, _host_leaves(jaxmp.master_params(state.opt_state), idx), params))
    train_loss = float(metrics["loss"])
    train_time = time.perf_counter() - t0
    loss = correct = count = 0.0
    for batch in _lm.eval_batches(text.eval, 64, hp["context"], hp["eval_windows"]):
        l_, c_, n_ = jax.device_get(eval_fn(state, batch))
        loss, correct, count = loss + float(l_), correct + float(c_), count + float(n_)
    out = {"seed": seed, "eval_loss": loss / count, "eval_accuracy": correct / count, "train_loss": train_loss,
           "steps": n, "loop_time_s": train_time, "eval_tokens": int(count),
           "tail_fraction_of_bf16_params_changed_per_step": float(np.mean(changed)) if changed else None}
    if recipe == REFERENCE:
        out["tail"] = stats.result(n - first, first + 1, float(schedule(first)), float(schedule(n - 1)))
    return out


def run_lm(args, seeds, recipes, quiet) -> dict:
    from benchmarks import _lm

    hp = dict(LM_DRY if args.dry_run else LM_FULL)
    if args.lm_steps:
        hp["steps"] = args.lm_steps
    text = _lm.load_text(max_chars=hp["max_chars"])
    runs = {r: [] for r in recipes}
    for recipe in recipes:
        for seed in seeds:
            res = lm_run(text, recipe, seed, hp, args.tail_fraction)
            log(f"lm {recipe} seed {seed}: eval loss {res['eval_loss']:.4f}, acc {res['eval_accuracy']:.4f} "
                f"({res['loop_time_s']:.1f} s, compile included for the first seed)", quiet)
            runs[recipe].append(res)
    tails = [dict(r.pop("tail"), seed=r["seed"]) for r in runs.get(REFERENCE, [])]
    setup = {"model": "benchmarks/_lm.py CausalLM (pre-LN, learned positions, causal MHA)", **hp,
             "vocab_size": len(_lm.VOCAB), "policy": "O2-bf16", "optimizer": "adamw, warm-up + cosine decay to 0",
             "text_source": text.source, "text_sha256": text.sha256, "text_chars": text.num_chars,
             "train_chars": int(len(text.train)), "eval_chars": int(len(text.eval)),
             "eval": f"held-out last {int(_lm.EVAL_FRACTION * 100)}% of the text, consecutive windows"}
    return {"setup": setup, "runs": runs, "tail": tails}


# ------------------------------------------------------------------------------ verdicts


def summarize(runs: dict, reference: str = REFERENCE) -> dict:
    """Per recipe: mean and spread (max - min) over seeds, and the verdict against ``runs[reference]``
    (also the wire study's, benchmarks/_wire_study.py, with its unquantized reference)."""
    out = {}
    ref = runs.get(reference)
    for recipe, rs in runs.items():
        row = {}
        for metric in ("eval_loss", "eval_accuracy"):
            v = np.array([r[metric] for r in rs], np.float64)
            row[metric] = {"per_seed": v.tolist(), "mean": float(v.mean()), "spread": float(v.max() - v.min())}
            if ref:
                rv = np.array([r[metric] for r in ref], np.float64)
                tol = max(float(rv.max() - rv.min()), 0.01 * abs(float(rv.mean())))
                diff = float(v.mean() - rv.mean())
                row[metric].update(diff_from_reference=diff, tolerance=tol, within=bool(abs(diff) <= tol))
        out[recipe] = row
    return out


def _fmt(x: float, metric: str) -> str:
    return f"{100 * x:.2f}%" if metric == "eval_accuracy" else f"{x:.4f}"


def markdown(result: dict) -> str:
    """The tables of a result: per job, per recipe, the eval loss per seed, its mean, the difference
    from the float32-master mean and the verdict; accuracy means; then the decayed tail's update/ulp."""
    from jaxmp import lean

    lines = []
    for job in result["config"]["jobs"]:
        out = result["results"][job]
        summary, seeds = out["summary"], result["config"]["seeds"]
        lines += [f"**{job}**", "", "| recipe | B/param | " + " | ".join(f"loss seed {s}" for s in seeds)
                  + " | loss mean | diff vs fp32 masters (tolerance) | within | accuracy mean |",
                  "|---" * (len(seeds) + 6) + "|"]
        for recipe in [r for r in RECIPES if r in summary]:
            row = summary[recipe]
            loss, acc = row["eval_loss"], row["eval_accuracy"]
            base = recipe.split("-all")[0]   # a study variant: its preset's bytes (plus its small leaves' codes)
            nbytes = lean.PRESETS[base][0] if base in lean.PRESETS else 10
            verdict = "reference" if recipe == REFERENCE else ("yes" if loss["within"] else "**no**")
            diff = "" if recipe == REFERENCE else f"{loss['diff_from_reference']:+.4f} ({loss['tolerance']:.4f})"
            lines.append(f"| {recipe} | {nbytes} | " + " | ".join(_fmt(v, "eval_loss") for v in loss["per_seed"])
                         + f" | {_fmt(loss['mean'], 'eval_loss')} | {diff} | {verdict} | "
                         f"{_fmt(acc['mean'], 'eval_accuracy')} |")
        lines.append("")
        for t in out["tail"]:
            lines.append(f"- seed {t['seed']}: last {t['tail_steps']} steps (lr {t['lr_at_tail_start']:.2e} to "
                         f"{t['lr_at_last_step']:.2e}): median float32-master update / ulp(bf16 param) "
                         f"{t['median_update_over_ulp']:.3f} (first tail step {t['median_update_over_ulp_first_tail_step']:.3f},"
                         f" last {t['median_update_over_ulp_last_tail_step']:.3f}); "
                         f"{100 * t['fraction_below_half_ulp']:.1f}% of the updates below half an ulp")
        changed = {r: np.mean([x["tail_fraction_of_bf16_params_changed_per_step"] for x in rs])
                   for r, rs in ((r, out["runs"].get(r)) for r in RECIPES)
                   if rs and "tail_fraction_of_bf16_params_changed_per_step" in rs[0]}
        if changed:
            lines.append("- bf16 params changed per tail step (mean over seeds): "
                         + ", ".join(f"{r} {100 * v:.1f}%" for r, v in changed.items()))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, DEFAULT_OUT)
    p.add_argument("--jobs", default="main,lm", help="comma-separated: main, lm")
    p.add_argument("--recipes", default=None,
                   help=f"comma-separated subset of {','.join(RECIPES)} (default: all; dry run: fp32-masters,"
                        "bf16-sr,bf16-nearest)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default 3; dry run 2)")
    p.add_argument("--tail-fraction", type=float, default=0.2,
                   help="the decayed tail: this last fraction of the steps (default 0.2)")
    p.add_argument("--main-steps", type=int, default=None, help="override the main job's steps (default: the config's)")
    p.add_argument("--table", default=None, metavar="JSON",
                   help="print the markdown tables of a result file written by this script, and exit")
    p.add_argument("--lm-steps", type=int, default=None, help=f"override the LM's steps (default {LM_FULL['steps']})")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.table:
        import json

        print(markdown(json.loads(Path(args.table).read_text())), end="")
        return {}
    jobs = [j for j in args.jobs.split(",") if j]
    if not jobs or set(jobs) - {"main", "lm"}:
        raise SystemExit(f"--jobs: choose from main, lm; got {args.jobs!r}")
    default = "fp32-masters,bf16-sr,bf16-nearest" if args.dry_run else ",".join(RECIPES)
    recipes = [r for r in (args.recipes or default).split(",") if r]
    if not recipes or set(recipes) - set(RECIPES):
        raise SystemExit(f"--recipes: choose from {', '.join(RECIPES)}; got {args.recipes!r}")
    if not 0 < args.tail_fraction <= 1:
        raise SystemExit("--tail-fraction must be in (0, 1]")
    seeds = list(range(args.seeds or (2 if args.dry_run else 3)))
    t0, load0 = time.perf_counter(), os.getloadavg()
    env = jax_env()
    results = {}
    for job in jobs:
        out = run_main(args, seeds, recipes, args.quiet) if job == "main" else run_lm(args, seeds, recipes, args.quiet)
        out["summary"] = summarize(out["runs"])
        results[job] = out
    env["load_average_start"] = list(load0)
    env["load_average_end"] = list(os.getloadavg())
    config = {"jobs": jobs, "recipes": recipes, "seeds": seeds, "tail_fraction": args.tail_fraction,
              "reference": REFERENCE, "sr_recipes": [r for r in SR_RECIPES if r in recipes],
              "verdict_rule": "|mean - mean_ref| <= max(spread_ref (max - min over seeds), 1% of |mean_ref|)"}
    result = make_result("fidelity", env, config, results, args.dry_run, wall_time_s=time.perf_counter() - t0,
                         command="python -m benchmarks.fidelity " + " ".join(sys.argv[1:] if argv is None else argv))
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
