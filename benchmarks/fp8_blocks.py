"""Block-scaled fp8 and fp4 on the experiments' MNIST-1D CNN and a small LM: does it train like bf16? 3 seeds each.

    python -m benchmarks.fp8_blocks                    # the CNN study (CPU: every format emulated)
    python -m benchmarks.fp8_blocks --model lm         # the LM study -> fp8_blocks_lm_cpu.json
    python -m benchmarks.fp8_blocks --dry-run --out -  # seconds: a tiny CNN, 2 seeds

The experiments' default CPU job (``experiments/configs/cpu.py``: MNIST-1D, the 1-D CNN, AdamW,
cosine decay), trained by ``experiments.train.train_and_evaluate`` under each policy: ``O2-bf16``
(the reference), ``O2-fp8-current`` (per-tensor fp8), ``O2-fp8-rowwise``, ``O2-fp8-block128``,
``O2-mxfp8`` and ``O2-nvfp4``. The CNN's convolutions run per-tensor fp8 under every fp8 policy
(a convolution has no contraction axis to block along); its Dense head is block-scaled.

Verdict per policy: *within* when ``|mean - mean_bf16| <= max(spread_bf16, 1% of |mean_bf16|)``
(eval accuracy; spread = max - min over bf16's seeds). ``time_vs_bf16``: median over seeds of
the policy's train time over bf16's; on a CPU every format is emulated (quantize-dequantize
around a bf16 matmul), so this is the simulator's cost, not a speed. Writes
``benchmarks/results/fp8_blocks/fp8_blocks_cpu.json``.

``--model lm``: ``benchmarks/_lm.py``'s character-level causal Transformer (2 layers, width 64,
context 64, batch 16, AdamW with warm-up and cosine decay, the standard library's docstrings;
``LM`` below) through ``jaxmp.flax.mixed_precision``, which quantizes every ``Dense`` and
``DenseGeneral`` (the attention projections, the MLP, the head; attention's two batched matmuls
stay bf16). Besides the presets: ``O2-nvfp4-plain`` (NVFP4 without the Hadamard transform and
stochastic rounding) and ``O2-nvfp4-head-f32`` (NVFP4 with the output head kept out of fp4, by a
path rule: in float32). The verdict is on the held-out loss (lower is better): *within* when
``|mean - mean_bf16| <= max(spread_bf16, 1% of mean_bf16)``. Writes
``benchmarks/results/fp8_blocks/fp8_blocks_lm_cpu.json``.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time

import numpy as np

from benchmarks._common import REPO_ROOT, emit, jax_env, log, make_result, script_parser

POLICIES = ("O2-bf16", "O2-fp8-current", "O2-fp8-rowwise", "O2-fp8-block128", "O2-mxfp8", "O2-nvfp4")
#: Variants beyond the presets (the LM study): name -> (preset, recipe fields, Flax path rules).
EXTRA = {"O2-nvfp4-plain": ("O2-nvfp4", {"hadamard": False, "stochastic_rounding": False}, ()),
         "O2-nvfp4-head-f32": ("O2-nvfp4", {}, (("Dense_0", "float32"),))}
REFERENCE = "O2-bf16"
DEFAULT_OUT = str(REPO_ROOT / "benchmarks" / "results" / "fp8_blocks" / "fp8_blocks_cpu.json")
LM_OUT = str(REPO_ROOT / "benchmarks" / "results" / "fp8_blocks" / "fp8_blocks_lm_cpu.json")
LM = dict(context=64, width=64, num_layers=2, num_heads=4, mlp_dim=256, batch_size=16, steps=300, warmup=30,
          learning_rate=3e-3, weight_decay=0.01, eval_windows=256, max_chars=None)
LM_DRY = dict(LM, context=16, width=16, num_layers=1, num_heads=2, mlp_dim=32, batch_size=8, steps=6, warmup=2,
              eval_windows=16, max_chars=20000)
DRY = {"num_train_steps": 8, "mnist1d_num_samples": 400, "model_kwargs.features": (8,),
       "model_kwargs.kernel_sizes": (3,), "eval_batch_size": 100}


def _config(dry: bool):
    from experiments import configs

    c = configs.get_config("cpu")
    c.progress_bar = False
    if dry:
        for k, v in DRY.items():
            if k.startswith("model_kwargs."):
                c.model_kwargs[k.split(".", 1)[1]] = v
            else:
                c[k] = v
    return c


def _summary(rows: list, metric: str = "eval_accuracy") -> dict:
    by = {}
    for r in rows:
        by.setdefault(r["policy"], []).append(r)
    ref = by[REFERENCE]
    ref_acc = np.array([r[metric] for r in ref])
    spread = float(ref_acc.max() - ref_acc.min())
    tolerance = max(spread, 0.01 * abs(float(ref_acc.mean())))
    ref_time = {r["seed"]: r["train_time_s"] for r in ref}
    out = {}
    for policy, runs in by.items():
        acc = np.array([r["eval_accuracy"] for r in runs])
        loss = np.array([r["eval_loss"] for r in runs])
        ratios = [r["train_time_s"] / ref_time[r["seed"]] for r in runs if r["seed"] in ref_time]
        judged = np.array([r[metric] for r in runs])
        out[policy] = {"eval_accuracy_mean": float(acc.mean()), "eval_accuracy_min": float(acc.min()),
                       "eval_accuracy_max": float(acc.max()), "eval_loss_mean": float(loss.mean()),
                       "within_bf16_spread": bool(abs(judged.mean() - ref_acc.mean()) <= tolerance),
                       "time_vs_bf16": float(np.median(ratios)) if ratios else None}
        if metric == "eval_loss":
            out[policy].update(eval_loss_min=float(loss.min()), eval_loss_max=float(loss.max()))
    out["bf16_accuracy_spread" if metric == "eval_accuracy" else "bf16_loss_spread"] = spread
    return out


def _lm_policy(name: str):
    """``(policy, rules)`` of a preset or an `EXTRA` variant, for ``jaxmp.flax.mixed_precision``."""
    import dataclasses

    import jaxmp

    if name not in EXTRA:
        return name, None
    preset, fields, paths = EXTRA[name]
    recipe = jaxmp.get_recipe(preset)
    recipe = recipe._replace(fp8=dataclasses.replace(recipe.fp8, **fields))
    return recipe, (jaxmp.AutocastRules(path_rules=paths) if paths else None)


_LM_PROGRAMS: dict = {}


def lm_run(text, name: str, seed: int, hp: dict) -> dict:
    """Trains ``benchmarks/_lm.py``'s CausalLM under ``name`` from ``seed``; held-out loss/accuracy."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxmp
    import jaxmp.flax
    from benchmarks import _lm

    key = (name, tuple(sorted(hp.items())))
    if key not in _LM_PROGRAMS:  # one model and compiled step per variant, shared by the seeds
        module = _lm.CausalLM(context=hp["context"], width=hp["width"], num_layers=hp["num_layers"],
                              num_heads=hp["num_heads"], mlp_dim=hp["mlp_dim"])
        policy, rules = _lm_policy(name)
        model = jaxmp.flax.mixed_precision(module, policy, rules=rules)
        schedule = optax.warmup_cosine_decay_schedule(0.0, hp["learning_rate"], hp["warmup"], hp["steps"], 0.0)
        inner = optax.adamw(schedule, weight_decay=hp["weight_decay"],
                            mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p))
        tx = jaxmp.loss_scaling(inner, "none", master_weights=True)

        @jax.jit
        def eval_fn(state, batch):
            logits = state.model.apply(state.variables, batch["inputs"]).astype(jnp.float32)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            return jnp.sum(loss), jnp.sum(jnp.argmax(logits, -1) == batch["label"])

        _LM_PROGRAMS[key] = (model, tx, jax.jit(jaxmp.flax.make_train_step(), donate_argnums=0), eval_fn)
    model, tx, step_fn, eval_fn = _LM_PROGRAMS[key]
    sample = jnp.zeros((1, hp["context"]), jnp.int32)
    state = jaxmp.flax.TrainState.create(model, model.init(jax.random.key(seed), sample), tx)
    t_compile = time.perf_counter()
    state, metrics = step_fn(state, _lm.train_batch(text.train, 0, hp["batch_size"], hp["context"], seed))
    jax.block_until_ready(metrics["loss"])
    compile_s = time.perf_counter() - t_compile
    t0 = time.perf_counter()
    for step in range(1, hp["steps"]):
        state, metrics = step_fn(state, _lm.train_batch(text.train, step, hp["batch_size"], hp["context"], seed))
    train_loss = float(metrics["loss"])
    train_time = time.perf_counter() - t0
    loss = correct = count = 0.0
    for batch in _lm.eval_batches(text.eval, 64, hp["context"], hp["eval_windows"]):
        l_, c_ = jax.device_get(eval_fn(state, batch))
        loss, correct, count = loss + float(l_), correct + float(c_), count + batch["label"].size
    return {"policy": name, "seed": seed, "eval_loss": loss / count, "eval_accuracy": correct / count,
            "train_loss": train_loss, "steps": hp["steps"], "train_time_s": train_time, "compile_time_s": compile_s}


def main_lm(args, seeds: list, policies: list) -> dict:
    from benchmarks import _lm

    hp = dict(LM_DRY if args.dry_run else LM)
    text = _lm.load_text(max_chars=hp["max_chars"])
    rows = []
    for name in policies:
        for seed in seeds:
            r = lm_run(text, name, seed, hp)
            rows.append(r)
            log(f"{name} seed {seed}: eval loss {r['eval_loss']:.4f}, acc {r['eval_accuracy']:.4f} "
                f"({r['train_time_s']:.1f} s)", args.quiet)
    setup = {"model": "benchmarks/_lm.py CausalLM (pre-LN, learned positions, causal MHA) via jaxmp.flax", **hp,
             "text_sha256": text.sha256, "seeds": seeds, "optimizer": "adamw, warm-up + cosine decay to 0",
             "variants": {k: {"preset": v[0], "recipe_fields": v[1], "path_rules": v[2]} for k, v in EXTRA.items()},
             "verdict": "held-out loss within max(bf16's seed spread, 1% of bf16's mean)",
             "emulated": "every fp8/fp4 format is emulated on CPU: times are the simulator's cost"}
    return make_result("fp8_blocks", jax_env(), setup, {"rows": rows, "summary": _summary(rows, "eval_loss")},
                       args.dry_run)


def main(argv=None) -> dict:
    parser = script_parser(__doc__, DEFAULT_OUT)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0 1 2; dry run 0 1)")
    parser.add_argument("--policies", nargs="+", default=None, choices=(*POLICIES, *EXTRA),
                        help="what to train (default: the presets; with --model lm also " + ", ".join(EXTRA) + ")")
    parser.add_argument("--model", choices=("cnn", "lm"), default="cnn", help="the MNIST-1D CNN or the small LM")
    args = parser.parse_args(argv)
    seeds = args.seeds or ([0, 1] if args.dry_run else [0, 1, 2])
    chosen = args.policies or (list(POLICIES) + (list(EXTRA) if args.model == "lm" else []))
    policies = [REFERENCE] + [p for p in chosen if p != REFERENCE]
    if args.model == "lm":
        result = main_lm(args, seeds, policies)
        emit(result, LM_OUT if args.out == DEFAULT_OUT else args.out)
        return result
    if any(p in EXTRA for p in policies):
        raise SystemExit(f"{', '.join(EXTRA)}: --model lm only")
    from experiments import train

    config = _config(args.dry_run)
    root = tempfile.mkdtemp(prefix="jaxmp_fp8_blocks_")
    rows = []
    try:
        for policy in policies:
            for seed in seeds:
                t = time.perf_counter()
                r = train.train_and_evaluate(copy.deepcopy(config), os.path.join(root, f"{policy}_{seed}"),
                                             policy=policy, seed=seed)
                rows.append({"policy": policy, "seed": seed, "eval_loss": r["val_loss"],
                             "eval_accuracy": r["val_accuracy"], "train_loss": r["train_loss"], "steps": r["steps"],
                             "train_time_s": r["train_time_s"], "compile_time_s": r["compile_time_s"]})
                log(f"{policy} seed {seed}: eval acc {r['val_accuracy']:.4f}, loss {r['val_loss']:.4f} "
                    f"({time.perf_counter() - t:.1f} s)", args.quiet)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    setup = {"config": "experiments/configs/cpu.py", "model": config.model,
             "model_kwargs": config.model_kwargs.to_dict(), "num_train_steps": rows[0]["steps"],
             "global_batch_size": config.global_batch_size, "seeds": seeds,
             "emulated": "every fp8/fp4 format is emulated on CPU: times are the simulator's cost"}
    result = make_result("fp8_blocks", jax_env(), setup, {"rows": rows, "summary": _summary(rows)}, args.dry_run)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
