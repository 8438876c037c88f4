"""The precision search on five models: fixed presets against the rules jaxmp chooses (issue 62).

    python -m benchmarks.precision_search                        # the table -> benchmarks/results/precision_search.json
    python -m benchmarks.precision_search --models flax_vae      # one model
    python -m benchmarks.precision_search --quick --models flax_vae --out -   # seconds: tiny sizes (the test)

For each model (``benchmarks/_search_models.py``: jaxmp's small LM and MNIST-1D CNN, google/flax's
lm1b Transformer, VAE and ImageNet ResNet, widths reduced): the search
``compare_to_float32(loss, params, *batch, choose=True, steps=k, optimizer=adam, search=...)`` on
seed 0's first batch (``--search``, default ``verified``: judged by float32's seed spread, as the
table is), then float32, ``O2-bf16``, ``O2-mxfp8``, ``O2-nvfp4`` (``jaxmp.autocast(loss, preset)``)
and the chosen rules (``jaxmp.autocast(loss, "O2-bf16", rules=plan.rules)``) trained for the same
steps with Adam on 3 seeds (a seed sets the init and the data order). Reported per variant: the
held-out loss per seed (each variant evaluates with its own forward), whether its mean is within
float32's seed spread (``|mean - mean_float32| <= max - min`` of float32's seeds), the share of
matmul FLOPs at each rung (a fixed preset: 100% at its format; the chosen rules: the plan's
shares, matmuls outside any scope at ``O2-bf16``), the FLOP-weighted bits per matmul operand
(4 NVFP4, 8 MXFP8, 16 bf16, 32 float32), and the search's cost in training steps and in
wall time over one float32 training step (median, compiled). On CPU every fp8/fp4 format is
emulated: the numerics are the formats', the times are not.
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks._common import REPO_ROOT, emit, jax_env, log, make_result, parse_choices, script_parser

MODELS = ("lm", "cnn1d", "flax_lm1b", "flax_vae", "flax_resnet")
PRESETS = ("O2-bf16", "O2-mxfp8", "O2-nvfp4")
VARIANTS = ("float32", *PRESETS, "chosen")
SEEDS = (0, 1, 2)
#: Bits per matmul operand at each rung (the FLOP-weighted mean is the table's "bits").
BITS = {"O2-nvfp4": 4, "O2-mxfp8": 8, "O2-bf16": 16, "float32": 32}
DEFAULT_OUT = str(REPO_ROOT / "benchmarks" / "results" / "precision_search.json")
#: Training steps per variant and seed, and steps per search measurement: full, --quick.
STEPS = ({"train_steps": 100, "search_steps": 4}, {"train_steps": 3, "search_steps": 2})
#: The search's ladder: the default (NVFP4 < MXFP8 < bf16 < float32); --quick's two rungs keep the
#: test to a few compiles (every candidate is a compiled program).
LADDERS = (True, ("O2-bf16", "float32"))


def _parser():
    p = script_parser(__doc__, default_out=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="tiny sizes, 3 training steps, 2 search steps (the test)")
    p.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: all)")
    p.add_argument("--train-steps", type=int, help="training steps per variant and seed")
    p.add_argument("--search-steps", type=int, help="training steps per search measurement")
    p.add_argument("--skip-search", action="store_true",
                   help="train float32 and the fixed presets only (no search, no chosen rules): the table's rows "
                        "for a model whose search does not fit the time at hand")
    p.add_argument("--search", default="verified", choices=("greedy", "program", "verified"),
                   help="the search strategy of the chosen rules (default: verified, judged as the table is: "
                        "float32's seed spread at the search's steps)")
    p.add_argument("--merge-from", help="comma list of result files to merge (models of later files win) into --out, "
                                        "instead of running")
    return p


def _trainer(loss_fn, task, steps: int):
    """``seed -> (held-out loss, step times)``: Adam for ``steps`` steps from ``task.init(seed)`` on
    seed's batches (one compiled step and one compiled evaluation, shared by the seeds)."""
    import jax
    import optax

    tx = optax.adam(task.lr)

    @jax.jit
    def step(p, o, batch):
        loss, g = jax.value_and_grad(loss_fn)(p, *batch)
        u, o = tx.update(g, o, p)
        return loss, optax.apply_updates(p, u), o

    evaluate = jax.jit(loss_fn)

    def train(seed: int):
        params = task.init(seed)
        opt = tx.init(params)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            loss, params, opt = step(params, opt, task.batch(seed, i))
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - t0)
        return float(evaluate(params, *task.eval_batch)), times[1:] or times

    return train


def shares_of(variant: str, plan) -> dict[str, float]:
    """The share of matmul FLOPs at each rung: a preset's 100% at its format, the plan's for ``chosen``."""
    if variant == "chosen":
        return {r: float(s) for r, s in plan.flop_shares().items()}
    return {r: float(r == variant) for r in BITS}


def _bits(shares: dict[str, float]) -> float:
    return float(sum(BITS[r] * s for r, s in shares.items()))


def run_model(name: str, quick: bool, train_steps: int, search_steps: int, quiet: bool, ladder=True,
              search: bool = True, strategy: str = "verified") -> dict:
    """The search, then every variant on every seed, for one model: its entry of ``results.models``."""
    import optax

    import jaxmp
    from benchmarks import _search_models
    from jaxmp.diagnostics import compare_to_float32

    task = _search_models.task(name, quick)
    if not search:
        return _presets_only(name, task, train_steps, quiet)
    log(f"[{name}] {strategy} search ({search_steps} steps per measurement)", quiet)
    plan = compare_to_float32(task.loss, task.init(0), *task.batch(0, 0), choose=ladder, steps=search_steps,
                              optimizer=optax.adam(task.lr), search=strategy)
    log(str(plan), quiet)
    fns = {"float32": task.loss, **{p: jaxmp.autocast(task.loss, p) for p in PRESETS}}
    if plan.rules is not None:
        fns["chosen"] = jaxmp.autocast(task.loss, plan.policy, rules=plan.rules)
    variants, step_s, spread = _train_variants(name, task, fns, plan, train_steps, quiet)
    search = {"strategy": plan.search, "cost_steps": int(plan.cost_steps), "seconds": float(plan.seconds), "step_s": step_s,
              "cost_x_step_wall": float(plan.seconds / step_s), "steps_per_measurement": int(plan.steps),
              "band": float(plan.threshold), "drift_before": float(plan.drift_before),
              "drift_after": float(plan.drift_after), "within_band": bool(plan.within_band), "gave_up": plan.gave_up,
              "promotions": [list(p) for p in plan.promotions]}
    modules = [{"path": m.path, "rung": m.rung, "flops": int(m.flops), "scanned": bool(m.scanned)} for m in plan.modules]
    return {"source": _search_models.SOURCES[name], "metric": task.metric, "config": dict(task.config),
            "seeds": list(SEEDS), "float32_spread": spread, "variants": variants, "search": search,
            "modules": modules, "unscoped_flops": int(plan.unscoped_flops), "policy": plan.policy,
            "rules_code": plan.code, "verdict": verdict({"variants": variants})}


def _presets_only(name: str, task, train_steps: int, quiet: bool) -> dict:
    """``--skip-search``: float32 and the fixed presets on every seed, the search marked not run."""
    import jaxmp
    from benchmarks import _search_models

    fns = {"float32": task.loss, **{p: jaxmp.autocast(task.loss, p) for p in PRESETS}}
    variants, step_s, spread = _train_variants(name, task, fns, None, train_steps, quiet)
    return {"source": _search_models.SOURCES[name], "metric": task.metric, "config": dict(task.config),
            "seeds": list(SEEDS), "float32_spread": spread, "variants": variants,
            "search": {"step_s": step_s, "gave_up": "not run (--skip-search)"}, "modules": [], "unscoped_flops": 0,
            "policy": "O2-bf16", "rules_code": "", "verdict": verdict({"variants": variants})}


def _train_variants(name: str, task, fns: dict, plan, train_steps: int, quiet: bool):
    """Every variant on every seed: ``(variants, median float32 step seconds, float32's seed spread)``."""
    variants: dict[str, dict] = {}
    step_times: list[float] = []
    for v, fn in fns.items():
        finals, train = [], _trainer(fn, task, train_steps)
        for seed in SEEDS:
            final, times = train(seed)
            finals.append(final)
            if v == "float32":
                step_times += times
        variants[v] = {"final": finals, "mean": float(np.mean(finals)), "shares": shares_of(v, plan)}
        variants[v]["bits"] = _bits(variants[v]["shares"])
        log(f"[{name}] {v}: {np.round(finals, 4).tolist()}", quiet)
    ref = np.asarray(variants["float32"]["final"])
    spread = float(ref.max() - ref.min())
    for v, row in variants.items():
        row["gap"] = float(row["mean"] - ref.mean())
        row["within"] = bool(abs(row["gap"]) <= spread)
    return variants, float(np.median(step_times)), spread


def verdict(model: dict) -> dict:
    """The issue's goal on one model: the chosen rules within the band, and their bits at most the
    lowest of the fixed presets within it (fewer bits: more low-precision FLOPs)."""
    vs = model["variants"]
    fixed = [p for p in PRESETS if p in vs and vs[p]["within"]]
    best = min(fixed, key=lambda p: vs[p]["bits"]) if fixed else None
    chosen = vs.get("chosen")
    if chosen is None:  # the search gave up or was not run: nothing to judge
        return {"best_fixed_within": best, "chosen_within": None, "chosen_as_cheap_as_best_fixed": None}
    return {"best_fixed_within": best, "chosen_within": bool(chosen["within"]),
            "chosen_as_cheap_as_best_fixed": bool(best is None or chosen["bits"] <= vs[best]["bits"])}


def rules_from_modules(modules: list[dict], policy: str = "O2-bf16"):
    """The chosen `jaxmp.AutocastRules` rebuilt from the JSON's modules (a rung other than the
    policy's format becomes ``with_scope(path, rung)``)."""
    import jaxmp

    rules = jaxmp.AutocastRules()
    for m in modules:
        if m["rung"] != policy:
            rules = rules.with_scope(m["path"], m["rung"])
    return rules


def table(result: dict) -> str:
    """The markdown table of a result (docs/precision-search.md's "The table")."""
    lines = [("| model | variant | held-out loss, mean (min-max) | - float32 | within float32's spread | "
              "matmul FLOPs: nvfp4 / mxfp8 / bf16 / f32 | bits | search cost |"),
             "|---|---|---|---:|---|---|---:|---|"]
    models = result["results"]["models"]  # in MODELS' order (the JSON file's keys are sorted)
    for name in sorted(models, key=lambda k: (k not in MODELS, MODELS.index(k) if k in MODELS else 0, k)):
        m, s = models[name], models[name]["search"]
        cost = (f"{s['cost_steps']} steps; {s['seconds']:.0f} s = {s['cost_x_step_wall']:.0f}x a step "
                f"({1e3 * s['step_s']:.1f} ms)") if "cost_steps" in s else ""
        for v in VARIANTS:
            if v not in m["variants"]:
                lines.append(f"| {name} | {v} | (no chosen rules: search {s['gave_up']}) | | | | | |")
                continue
            r = m["variants"][v]
            sh = " / ".join(f"{100 * r['shares'].get(k, 0.0):.0f}%" for k in BITS)
            lines.append(f"| {name} | {v} | {r['mean']:.4f} ({min(r['final']):.4f}-{max(r['final']):.4f}) | "
                         f"{r['gap']:+.4f} | {'yes' if r['within'] else '**no**'} | {sh} | {r['bits']:.2f} | "
                         f"{cost if v == 'chosen' else ''} |")
    return "\n".join(lines)


def run(args) -> dict:
    args.quick = args.quick or args.dry_run  # --dry-run, the scripts' common smoke flag, is --quick here
    models = parse_choices(args.models, MODELS, "model")
    steps = dict(STEPS[1 if args.quick else 0])
    if args.train_steps:
        steps["train_steps"] = args.train_steps
    if args.search_steps:
        steps["search_steps"] = args.search_steps
    env = jax_env()
    out = {}
    for name in models:
        t0 = time.perf_counter()
        out[name] = run_model(name, args.quick, steps["train_steps"], steps["search_steps"], args.quiet,
                              LADDERS[1 if args.quick else 0], search=not args.skip_search, strategy=args.search)
        out[name]["wall_s"] = time.perf_counter() - t0
    ladder = LADDERS[1 if args.quick else 0]
    config = {**steps, "search": args.search, "seeds": list(SEEDS), "ladder": list(BITS) if ladder is True else list(ladder),
              "variants": list(VARIANTS), "optimizer": "optax.adam(model's lr)",
              "within": "|mean - mean_float32| <= max - min of float32's seeds", "bits": BITS}
    return make_result("precision_search", env, config, {"models": out}, args.quick)


def merge(paths: list[str]) -> dict:
    """One result from several runs' files (``--models`` split over processes): their models, the
    first file's envelope, and each part's command and commit under ``config.parts``."""
    import json
    import os
    from pathlib import Path

    parts = [json.loads(Path(p).read_text()) for p in paths]
    out = dict(parts[0], results={"models": {}}, config=dict(parts[0]["config"], parts=[]))
    for part in parts:
        out["results"]["models"].update(part["results"]["models"])
        for model in part["results"]["models"].values():
            model["verdict"] = verdict(model)
        out["config"]["parts"].append({"command": part["command"], "commit": part["env"]["git_commit"],
                                       "created_utc": part["created_utc"], "models": list(part["results"]["models"])})
    out["command"] = "precision_search.py --merge-from " + ",".join(os.path.basename(p) for p in paths)
    return out


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    result = merge(args.merge_from.split(",")) if args.merge_from else run(args)
    print(table(result))
    emit(result, args.out if not (args.quick and args.out == DEFAULT_OUT) else "-")
    return result


if __name__ == "__main__":
    main()
