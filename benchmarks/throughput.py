"""Throughput, memory and achieved FLOP/s per precision policy (meant for a GPU).

One command runs every (model, batch, policy) of the suite and writes one JSON::

    python benchmarks/throughput.py                          # the full suite (GPU)
    python benchmarks/throughput.py --models resnet50        # a subset
    python benchmarks/throughput.py --dry-run --out -        # tiny models on CPU, seconds

Suite (synthetic data, on device, a few batches cycled):

* WRN-28-10 on CIFAR shapes (32x32x3, 10 classes), batch 128 and 512, SGD+momentum;
* ResNet-50 at 224x224x3, 1000 classes, batch 256, SGD+momentum;
* a Transformer encoder (12 layers, width 768, 12 heads, MLP 3072, 512 tokens), batch 32, AdamW;

each under ``O0-strict`` (O0 inside ``jax.default_matmul_precision("highest")``: true fp32),
``O0`` (default matmul precision: TF32 on Ampere and later), ``O1``, ``O2-bf16`` and
``O2-fp16`` (jaxmp recipes: policy, master weights and loss scale from ``jaxmp.get_recipe``;
the model runs through ``jaxmp.flax``).

Per run: items/s (images or tokens) from the median step time of ``--rounds`` blocks of
``--steps`` steps (warm-up and compilation excluded, ``jax.block_until_ready`` at each block's
end); peak device memory (``device.memory_stats()["peak_bytes_in_use"]`` measured in a fresh
process per run, else the compiled step's ``memory_analysis()``, labelled); FLOPs per step from
the lowered step's XLA ``cost_analysis()`` and the achieved TFLOP/s as a fraction of a bf16
matmul peak measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common as common  # noqa: E402

POLICIES = ("O0-strict", "O0", "O1", "O2-bf16", "O2-fp16")

# name -> spec. "model" is (experiments.models name, overrides); inputs are NHWC images or
# [N, L] sequences (the encoder embeds one scalar per token).
SUITE = {
    "wrn28_10": dict(model=("wrn28_10", {}), input=(32, 32, 3), classes=10, batches=(128, 512),
                     optimizer="sgd", unit="images"),
    "resnet50": dict(model=("resnet50", {}), input=(224, 224, 3), classes=1000, batches=(256,),
                     optimizer="sgd", unit="images"),
    "transformer": dict(model=("transformer", dict(num_layers=12, model_dim=768, num_heads=12, mlp_dim=3072)),
                        input=(512,), classes=10, batches=(32,), optimizer="adamw", unit="tokens"),
}
DRY_SUITE = {
    "wrn28_10": dict(model=("wrn16_4", dict(depth=10, widen_factor=1)), input=(8, 8, 3), classes=10,
                     batches=(2,), optimizer="sgd", unit="images"),
    "resnet50": dict(model=("resnet50", dict(stage_sizes=(1, 1), width=4)), input=(16, 16, 3), classes=10,
                     batches=(2,), optimizer="sgd", unit="images"),
    "transformer": dict(model=("transformer", dict(num_layers=1, model_dim=8, num_heads=2, mlp_dim=16)),
                        input=(8,), classes=10, batches=(2,), optimizer="adamw", unit="tokens"),
}
TIMING = dict(warmup_steps=10, rounds=15, steps=10, n_batches=2)
# fast_compile: XLA backend optimisation level 0 (dry runs check plumbing, not speed).
DRY_TIMING = dict(warmup_steps=1, rounds=2, steps=2, n_batches=2, fast_compile=True)
MATMUL_N, DRY_MATMUL_N = 8192, 128


# ----------------------------------------------------------------------------------------------
# Building blocks (imported lazily: the orchestrating parent never touches the GPU).


def load_model(name: str, classes: int, overrides: dict):
    """The Flax model of ``experiments.models`` (imported at run time)."""
    try:
        from experiments.models import get_model
    except ImportError as e:  # pragma: no cover - depends on the checkout
        raise RuntimeError(f"experiments.models is needed for the throughput benchmark: {e}") from e
    return get_model(name, classes, **overrides)


def mixed_precision(module, preset: str):
    """``jaxmp.flax.mixed_precision(module, preset)``, whatever the integration exports."""
    import jaxmp.flax as jflax

    if hasattr(jflax, "mixed_precision"):
        return jflax.mixed_precision(module, preset)
    from jaxmp.flax.linen import MixedPrecision  # pragma: no cover - older layout

    return MixedPrecision(module, preset)


def make_optimizer(kind: str):
    import optax

    if kind == "sgd":  # torch.optim.SGD(lr, momentum=0.9, weight_decay=5e-4): L2 added to the gradient
        return optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9))
    if kind == "adamw":
        return optax.adamw(1e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    raise ValueError(kind)


def _flops_from_cost(cost) -> float | None:
    if cost is None:
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not isinstance(cost, dict):
        return None
    f = cost.get("flops")
    return float(f) if f is not None and f > 0 else None


def memory_analysis_dict(compiled) -> dict | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001
        return None
    if m is None:
        return None
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    out = {f: int(getattr(m, f)) for f in fields if hasattr(m, f)}
    if all(k in out for k in fields[:4]):
        out["estimated_peak_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                       - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
    return out


def run_one(model_key: str, batch_size: int, policy: str, suite: dict, timing: dict,
            fresh_process: bool, quiet: bool = False) -> dict:
    """Builds, compiles, warms up and times one train step; returns the run's entry."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import optax

    import jaxmp

    spec = suite[model_key]
    entry = {"model": model_key, "model_def": list(spec["model"]), "batch_size": batch_size, "policy": policy,
             "unit": spec["unit"], "optimizer": spec["optimizer"]}
    preset = "O0" if policy == "O0-strict" else policy
    recipe = jaxmp.get_recipe(preset)
    precision = "highest" if policy == "O0-strict" else None
    entry.update(recipe={"name": recipe.name, "policy": str(recipe.policy), "master_weights": recipe.master_weights,
                         "loss_scale": recipe.loss_scale, "keep_fp32": list(recipe.keep_fp32)},
                 matmul_precision=precision or "default")
    ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()

    name, overrides = spec["model"]
    module = load_model(name, spec["classes"], overrides)
    model = mixed_precision(module, preset)
    tx = jaxmp.loss_scaling(make_optimizer(spec["optimizer"]), loss_scale=recipe.loss_scale,
                            master_weights=recipe.master_weights)

    # Data and state are built inside jit: eager op-by-op initialisation compiles every op
    # separately, which dominates the tiny (dry-run) configurations.
    nbatch = timing["n_batches"]
    shape = (nbatch, batch_size, *spec["input"])

    copts = {"xla_backend_optimization_level": 0} if timing.get("fast_compile") else None

    def jit_call(fn, *args):
        return jax.jit(fn).lower(*args).compile(compiler_options=copts)(*args)

    def make_data(key):
        kx, ky = jax.random.split(key)
        return jax.random.normal(kx, shape, jnp.float32), jax.random.randint(ky, shape[:2], 0, spec["classes"])

    xs, ys = jit_call(make_data, jax.random.PRNGKey(0))
    batches = [(xs[i], ys[i]) for i in range(nbatch)]
    del xs, ys

    def make_state(key, x):
        variables = model.init(key, x, train=False)
        # tree_map(jnp.copy): fresh buffers for the whole state, which is donated to the step;
        # outside jit an fp32 master copy of an fp32 (norm) param would alias it.
        opt_state = jax.tree_util.tree_map(jnp.copy, tx.init(variables["params"]))
        return variables["params"], variables.get("batch_stats", {}), opt_state

    with ctx:
        params, batch_stats, opt_state = jit_call(make_state, jax.random.PRNGKey(1), batches[0][0][:2])
    entry["n_params"] = int(sum(p.size for p in jax.tree_util.tree_leaves(params)))
    entry["param_dtypes"] = sorted({str(p.dtype) for p in jax.tree_util.tree_leaves(params)})

    def step(state, batch):
        params, batch_stats, opt_state = state
        x, y = batch

        def loss_fn(p):
            v = {"params": p, "batch_stats": batch_stats} if batch_stats else {"params": p}
            if batch_stats:
                logits, upd = model.apply(v, x, train=True, mutable=["batch_stats"])
                new_bs = upd["batch_stats"]
            else:
                logits, new_bs = model.apply(v, x, train=True), batch_stats
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()
            return loss, new_bs

        (loss, new_bs), grads = jaxmp.value_and_grad(loss_fn, opt_state, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jaxmp.apply_updates(params, updates, opt_state)
        # A skipped (non-finite) step keeps the BatchNorm statistics too.
        new_bs = jaxmp.select_tree(jaxmp.last_step_finite(opt_state), new_bs, batch_stats) if batch_stats else new_bs
        return (params, new_bs, opt_state), loss

    jstep = jax.jit(step, donate_argnums=(0,))
    state = (params, batch_stats, opt_state)
    with ctx:
        t0 = time.perf_counter()
        lowered = jstep.lower(state, batches[0])
        flops = None
        try:
            flops = _flops_from_cost(lowered.cost_analysis())
        except Exception:  # noqa: BLE001
            pass
        compiled = lowered.compile(compiler_options=copts)
        entry["compile_s"] = time.perf_counter() - t0
        if flops is None:
            try:
                flops = _flops_from_cost(compiled.cost_analysis())
            except Exception:  # noqa: BLE001
                pass
        entry["flops"] = {"per_step": flops, "source": "xla_cost_analysis" if flops else "unavailable"}
        mem_analysis = memory_analysis_dict(compiled)

        nb = len(batches)
        for i in range(timing["warmup_steps"]):
            state, loss = compiled(state, batches[i % nb])
        jax.block_until_ready((state, loss))
        if not bool(jnp.isfinite(loss)):
            entry["warning"] = "non-finite loss during warm-up"

        samples = []
        for r in range(timing["rounds"]):
            t0 = time.perf_counter()
            for i in range(timing["steps"]):
                state, loss = compiled(state, batches[i % nb])
            jax.block_until_ready((state, loss))
            samples.append((time.perf_counter() - t0) / timing["steps"])
    st = common.summarize(samples)
    items_per_step = batch_size * (spec["input"][0] if spec["unit"] == "tokens" else 1)
    entry.update(status="ok", step_time_s=st, samples_s=samples, items_per_step=items_per_step,
                 items_per_s=items_per_step / st["median"],
                 items_per_s_iqr=[items_per_step / st["q75"], items_per_step / st["q25"]],
                 final_loss=float(loss), skipped_steps=int(jaxmp.skipped_steps(state[2])),
                 loss_scale=float(jaxmp.get_loss_scale(state[2]).loss_scale))
    if flops:
        entry["tflops_per_s"] = flops / st["median"] / 1e12

    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001
        pass
    memory = {"analysis": mem_analysis}
    if stats and stats.get("peak_bytes_in_use"):
        memory["process_peak_bytes_in_use"] = int(stats["peak_bytes_in_use"])
    if fresh_process and stats and stats.get("peak_bytes_in_use"):
        memory.update(source="peak_bytes_in_use", peak_bytes=int(stats["peak_bytes_in_use"]))
    elif mem_analysis and mem_analysis.get("estimated_peak_bytes"):
        memory.update(source="memory_analysis (compiled step: arguments + outputs - aliased + temporaries)",
                      peak_bytes=int(mem_analysis["estimated_peak_bytes"]))
    else:
        memory.update(source="unavailable", peak_bytes=None)
    entry["memory"] = memory
    common.log(f"  {model_key} b{batch_size} {policy:9s}: {entry['items_per_s']:.1f} {spec['unit']}/s, "
               f"step {st['median'] * 1e3:.2f} ms (IQR {st['q25'] * 1e3:.2f}-{st['q75'] * 1e3:.2f}), "
               f"mem {memory.get('peak_bytes')} ({memory['source'].split(' ')[0]})", quiet)
    return entry


def matmul_peak(n: int, rounds: int = 10, steps: int = 10) -> dict:
    """Median TFLOP/s of an n x n x n bf16 matmul (float32 accumulation, bf16 output)."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.PRNGKey(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    out = f(a, b)
    for _ in range(3):
        out = f(a, b)
    jax.block_until_ready(out)
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = f(a, b)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / steps)
    st = common.summarize(samples)
    return {"n": n, "dtype": "bfloat16", "step_time_s": st, "tflops": 2 * n**3 / st["median"] / 1e12,
            "tflops_best": 2 * n**3 / st["min"] / 1e12}


# ----------------------------------------------------------------------------------------------
# Orchestration.


def _child(argv_tail: list[str], timeout: float | None) -> dict:
    """Runs this script in a fresh process (fresh device memory statistics) and reads its JSON."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "one.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv_tail, "--child-out", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=common.REPO_ROOT)
        except subprocess.TimeoutExpired:
            return {"status": "error", "error": f"timed out after {timeout}s"}
        sys.stderr.write(proc.stderr[-4000:] if proc.returncode else "")
        if out.exists():
            return json.loads(out.read_text())
        tail = (proc.stderr or proc.stdout)[-2000:]
        oom = "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower()
        return {"status": "oom" if oom else "error", "error": f"exit {proc.returncode}: {tail.strip()}"}


def _child_main(args) -> None:
    """``--single KIND``: one measurement in this process, JSON to --child-out."""
    suite = DRY_SUITE if args.dry_run else SUITE
    timing = common.timing_from_args(args, TIMING, DRY_TIMING)
    if args.single == "env":
        out = {"env": common.jax_env(),
               "matmul_peak": matmul_peak(args.matmul_n or (DRY_MATMUL_N if args.dry_run else MATMUL_N))}
    else:
        model_key, batch, policy = args.single.split(":")
        try:
            out = run_one(model_key, int(batch), policy, suite, timing, fresh_process=True, quiet=args.quiet)
        except Exception as e:  # noqa: BLE001 - recorded in the entry, the suite goes on
            msg = f"{type(e).__name__}: {e}"
            oom = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
            out = {"model": model_key, "batch_size": int(batch), "policy": policy,
                   "status": "oom" if oom else "error", "error": msg[:4000]}
    Path(args.child_out).write_text(json.dumps(common._finite_json(out)))


def plan(args) -> tuple[dict, dict, list[tuple[str, int, str]]]:
    suite = DRY_SUITE if args.dry_run else SUITE
    timing = common.timing_from_args(args, TIMING, DRY_TIMING)
    models = common.parse_choices(args.models, list(suite), "model")
    policies = common.parse_choices(args.policies, list(POLICIES), "policy")
    runs = []
    for m in models:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else list(suite[m]["batches"])
        for b in batches:
            for p in policies:
                runs.append((m, b, p))
    return suite, timing, runs


def run_suite(args) -> dict:
    suite, timing, runs = plan(args)
    isolate = args.isolate if args.isolate is not None else not args.dry_run
    tail = ["--dry-run"] if args.dry_run else []
    for k in ("rounds", "steps", "warmup_steps"):
        if getattr(args, k) is not None:
            tail += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.quiet:
        tail.append("--quiet")
    matmul_n = args.matmul_n or (DRY_MATMUL_N if args.dry_run else MATMUL_N)
    if isolate:
        head = _child(["--single", "env", "--matmul-n", str(matmul_n), *tail], args.timeout)
        if "env" not in head:
            raise SystemExit(f"could not start JAX in a child process: {head.get('error')}")
        env, peak = head["env"], head["matmul_peak"]
    else:
        env, peak = common.jax_env(), matmul_peak(matmul_n, rounds=3 if args.dry_run else 10,
                                                  steps=2 if args.dry_run else 10)
    common.log(f"throughput: {env['device']}; bf16 matmul peak {peak['tflops']:.1f} TFLOP/s "
               f"(n={peak['n']}); {len(runs)} runs, {'one process each' if isolate else 'in process'}",
               args.quiet)
    entries = []
    for m, b, p in runs:
        if isolate:
            e = _child(["--single", f"{m}:{b}:{p}", *tail], args.timeout)
            e.setdefault("model", m), e.setdefault("batch_size", b), e.setdefault("policy", p)
        else:
            try:
                e = run_one(m, b, p, suite, timing, fresh_process=False, quiet=args.quiet)
            except Exception as ex:  # noqa: BLE001
                e = {"model": m, "batch_size": b, "policy": p, "status": "error",
                     "error": f"{type(ex).__name__}: {ex}"[:4000]}
        if e.get("status") == "ok" and e.get("tflops_per_s"):
            e["fraction_of_matmul_peak"] = e["tflops_per_s"] / peak["tflops"]
        if e.get("status") != "ok":
            common.log(f"  {m} b{b} {p}: {e.get('status')}: {str(e.get('error'))[:300]}", args.quiet)
        entries.append(e)
    config = {"suite": {k: {**v, "model": list(v["model"])} for k, v in suite.items() if k in {r[0] for r in runs}},
              "timing": timing, "policies": sorted({r[2] for r in runs}, key=POLICIES.index),
              "isolated_processes": isolate, "matmul_n": matmul_n,
              "data": "synthetic, on device, n_batches cycled", "donated_state": True}
    return common.make_result("throughput", env, config, {"runs": entries, "matmul_peak": peak}, args.dry_run)


def summary_table(result: dict) -> str:
    rows = ["model        batch policy      items/s        step ms (IQR)          peak MiB (source)      TFLOP/s  %peak"]
    for e in result["results"]["runs"]:
        if e.get("status") != "ok":
            rows.append(f"{e['model']:12s} {e['batch_size']:5d} {e['policy']:10s} {e.get('status')}: {str(e.get('error'))[:80]}")
            continue
        st, mem = e["step_time_s"], e["memory"]
        mib = f"{mem['peak_bytes'] / 2**20:.0f}" if mem.get("peak_bytes") else "-"
        tf = e.get("tflops_per_s")
        frac = e.get("fraction_of_matmul_peak")
        rows.append(f"{e['model']:12s} {e['batch_size']:5d} {e['policy']:10s} {e['items_per_s']:10.1f} {e['unit'][:3]}  "
                    f"{st['median'] * 1e3:8.2f} ({st['q25'] * 1e3:.2f}-{st['q75'] * 1e3:.2f})  "
                    f"{mib:>8s} ({mem['source'].split(' ')[0]})  "
                    f"{(f'{tf:7.2f}' if tf else '      -')}  {(f'{100 * frac:5.1f}' if frac else '    -')}")
    return "\n".join(rows)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser, default_out=None)
    parser.add_argument("--models", help=f"comma list of {', '.join(SUITE)} (default: all)")
    parser.add_argument("--batches", help="comma list of batch sizes overriding each model's")
    parser.add_argument("--policies", help=f"comma list of {', '.join(POLICIES)} (default: all)")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--matmul-n", type=int, help=f"side of the bf16 matmul peak probe (default {MATMUL_N})")
    iso = parser.add_mutually_exclusive_group()
    iso.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                     help="one fresh process per run (default except --dry-run): per-run peak memory")
    iso.add_argument("--no-isolate", dest="isolate", action="store_false")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per isolated run")
    parser.add_argument("--single", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.single:
        _child_main(args)
        return None
    result = run_suite(args)
    print(summary_table(result), flush=True)
    out = args.out
    if out is None:
        slug = common.device_slug(result["env"]["device"])
        out = str(common.RESULTS_DIR / ("dry_run/throughput.json" if args.dry_run else f"throughput_{slug}.json"))
    common.emit(result, out)
    return result


if __name__ == "__main__":
    main()
