"""jaxmp.autocast against a hand cast, float32 and its peers: step, trace and compile time, converts, error.

    python -m benchmarks.autocast                       # CPU or GPU, the default sizes
    python -m benchmarks.autocast --dry-run --out -     # tiny sizes, seconds
    python -m benchmarks.autocast --models mlp,mlp32 --variants float32,hand,jaxmp

Models (loss functions ``loss(params, x, y)``, ``benchmarks/_autocast_models.py``):

* ``mlp``: a 3-layer MLP with a hand-written layer norm and log-softmax loss;
* ``mlp32``: the same with 32 layers (trace time grows with the program);
* ``transformer``: the experiments' pre-LN Transformer encoder (``experiments.models``);
* ``resnet``: the experiments' bottleneck ResNet (BatchNorm in training mode).

Variants (each gives ``loss'`` with the loss's signature; the step is
``jit(value_and_grad(loss'))`` with respect to the float32 params):

* ``float32``: the loss as written;
* ``hand``: the dtypes of ``jaxmp.autocast``'s O1 rules, written by hand -- matmul and
  convolution operands in the half dtype (bfloat16, or float16 with ``--half fp16``); exp, log,
  rsqrt, sqrt, pow, erf and all reductions (sums, max, mean/var, softmax, log-softmax, the
  loss) in float32; other element-wise ops follow their inputs, where a float32 param meeting
  a half value takes the half dtype and the float32 result of a reduction promotes what it
  meets; the output in float32. For the Flax models (Transformer, ResNet) the hand cast is
  Flax's own ``dtype=half`` on every layer (params float32, norm statistics and attention
  softmax in float32), which differs from O1 in that norm outputs and GELU stay in half;
* ``jaxmp``: ``jaxmp.autocast(loss, "O1-bf16")`` (``"O1-fp16"``);
* ``grampax``: ``grampax.autocast(loss, dtype=half)``; ``jaxamp``:
  ``jaxamp.amp(loss, compute_dtype=half)``; ``mpx``: ``mpx.cast_function(loss, half,
  return_dtype=float32)`` -- each only when importable (the script says which it skipped and
  why; they are not jaxmp dependencies: install them in a scratch virtualenv).

Per variant: the compiled step time (``--rounds`` blocks of ``--steps`` steps, variants
interleaved with a rotating order in one process; median and IQR; CPU time on the CPU backend,
``step_clock``), the trace time and the
trace + lower + compile time of the step (medians of ``--compile-repeats`` fresh wrappers, each
after a ``gc.collect()``), the number of ``convert`` instructions in the compiled HLO, the
compiled step's memory (``memory_analysis()``: temporaries and arguments + outputs +
temporaries), and the loss and gradient errors against float32 (``|l - l32| / |l32|``,
``||g - g32|| / ||g32||`` over all params). Writes ``benchmarks/results/autocast_<device>.json`` (``dry_run/autocast.json``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import time

from benchmarks import _common as common

MODELS = ("mlp", "mlp32", "transformer", "resnet")
VARIANTS = ("float32", "hand", "jaxmp", "grampax", "jaxamp", "mpx")
SIZES = {
    "mlp": dict(depth=3, width=512, batch=256, in_dim=512, classes=10),
    "mlp32": dict(depth=32, width=256, batch=64, in_dim=256, classes=10),
    "transformer": dict(layers=2, dim=128, heads=4, mlp=512, seq=64, batch=8, classes=10),
    "resnet": dict(stages=(1, 1, 1), width=16, size=32, batch=8, classes=10),
}
DRY_SIZES = {
    "mlp": dict(depth=3, width=16, batch=4, in_dim=8, classes=4),
    "mlp32": dict(depth=32, width=8, batch=2, in_dim=8, classes=4),
    "transformer": dict(layers=1, dim=8, heads=2, mlp=16, seq=8, batch=2, classes=4),
    "resnet": dict(stages=(1,), width=4, size=8, batch=2, classes=4),
}
TIMING = dict(rounds=15, steps=5, warmup_steps=2, compile_repeats=3)
DRY_TIMING = dict(rounds=2, steps=1, warmup_steps=1, compile_repeats=1)
_CONVERT = re.compile(r"\sconvert\(")


def build_model(name: str, sizes: dict):
    import jax

    from benchmarks import _autocast_models as am

    key = jax.random.PRNGKey(0)
    s = sizes[name]
    if name in ("mlp", "mlp32"):
        return am.make_mlp(0, s["depth"], s["width"], s["batch"], s["in_dim"], s["classes"])
    if name == "transformer":
        return am.make_transformer(key, s["layers"], s["dim"], s["heads"], s["mlp"], s["seq"], s["batch"], s["classes"])
    return am.make_resnet(key, tuple(s["stages"]), s["width"], s["size"], s["batch"], s["classes"])


def _fresh(fn):
    """A new function object calling ``fn``: no cache keyed on the function carries over."""
    return lambda p, x, y: fn(p, x, y)


def variant_factory(variant: str, model, half_name: str):
    """A function making a *fresh* ``loss'`` for the variant (fresh: no wrapper cache is reused).

    Returns (factory, None), or (None, reason) when the variant cannot run here.
    """
    import jax.numpy as jnp

    half = jnp.bfloat16 if half_name == "bf16" else jnp.float16
    if variant == "float32":
        return (lambda: lambda p, x, y: model.loss(p, x, y)), None
    if variant == "hand":
        return (lambda: lambda p, x, y: model.hand_loss(p, x, y, half)), None
    try:
        if variant == "jaxmp":
            import jaxmp

            if not hasattr(jaxmp, "autocast"):
                return None, "this jaxmp has no jaxmp.autocast yet"
            # A fresh function per repeat: jaxmp's program cache is shared by every autocast
            # function built from one function object, so reusing model.loss would skip the
            # user's trace in every repeat after the first.
            return (lambda: jaxmp.autocast(_fresh(model.loss), f"O1-{half_name}")), None
        if variant == "grampax":
            import grampax

            return (lambda: grampax.autocast(_fresh(model.loss), dtype=half)), None
        if variant == "jaxamp":
            import jaxamp

            return (lambda: jaxamp.amp(_fresh(model.loss), compute_dtype=half)), None
        if variant == "mpx":
            import mpx

            return (lambda: mpx.cast_function(_fresh(model.loss), half, return_dtype=jnp.float32)), None
    except Exception as e:  # noqa: BLE001 - an ImportError, or a peer that breaks on import
        return None, f"cannot import {variant} ({type(e).__name__}: {e}); it is not a jaxmp dependency: " \
                      "install it in a scratch virtualenv to compare"
    raise ValueError(variant)


def _compile_once(factory, params, batch):
    """(trace s, trace+lower+compile s, compiled, trace CPU s, trace+lower+compile CPU s) for a fresh wrapper.

    The CPU times (``time.process_time``: this process, all threads) are what other processes on
    a shared machine do not inflate; the wall times are kept beside them.
    """
    import jax

    fn = factory()
    # Python's cyclic collector runs a full collection once enough objects have survived since
    # the last one, whichever run allocates them; collected here, a full collection owed by
    # earlier traces (of any variant) does not land in this one's time.
    gc.collect()
    # stdout silenced for every variant alike: grampax 0.1.0 prints its arrays while tracing.
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        c0, t0 = time.process_time(), time.perf_counter()
        traced = jax.jit(jax.value_and_grad(fn)).trace(params, *batch)
        c1, t1 = time.process_time(), time.perf_counter()
        compiled = traced.lower().compile()
        c2, t2 = time.process_time(), time.perf_counter()
    return t1 - t0, t2 - t0, compiled, c1 - c0, c2 - c0


def _rel_errors(out, ref) -> dict:
    import jax
    import jax.numpy as jnp

    (loss, grads), (loss32, grads32) = out, ref
    num = sum(float(jnp.sum(jnp.square(a.astype(jnp.float32) - b))) for a, b in
              zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads32)))
    den = sum(float(jnp.sum(jnp.square(b))) for b in jax.tree_util.tree_leaves(grads32))
    grad_dtypes = sorted({str(a.dtype) for a in jax.tree_util.tree_leaves(grads)})
    return {"loss": float(loss), "loss_rel_error": abs(float(loss) - float(loss32)) / abs(float(loss32)),
            "grad_rel_error": (num / den) ** 0.5 if den else None, "grad_dtypes": grad_dtypes}


def measure_model(name: str, sizes: dict, variants: list[str], half: str, timing: dict, quiet: bool) -> dict:
    """Compiles every variant of one model, checks its numerics and times the steps interleaved."""
    import jax

    from benchmarks._runs import memory_analysis_dict

    model = build_model(name, sizes)
    out: dict = {"sizes": sizes[name], "hand_cast": model.hand_note, "variants": {}, "skipped": {}}
    factories = {}
    for v in ["float32"] + [v for v in variants if v != "float32"]:
        factory, reason = variant_factory(v, model, half)
        if factory is None:
            out["skipped"][v] = reason
            common.log(f"  {name}: {v} skipped: {reason}", quiet)
        else:
            factories[v] = factory
    # Compiles interleaved like the steps (rotating order): a slow spell of the machine falls
    # on every variant alike instead of on whichever compiled during it.
    runs: dict = {v: [] for v in factories}
    for r in range(timing["compile_repeats"]):
        order = list(runs)
        for v in order[r % len(order):] + order[:r % len(order)]:
            try:
                runs[v].append(_compile_once(factories[v], model.params, model.batch))
            except Exception as e:  # noqa: BLE001 - a peer that fails on this model: recorded, not fatal
                out["skipped"][v] = f"failed: {type(e).__name__}: {str(e)[:300]}"
                common.log(f"  {name}: {v} failed: {type(e).__name__}: {str(e)[:200]}", quiet)
                del runs[v]
    compiled, ref = {}, None
    for v, vruns in runs.items():
        c = vruns[-1][2]
        try:
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
                result = jax.block_until_ready(c(model.params, *model.batch))
        except Exception as e:  # noqa: BLE001 - as above
            out["skipped"][v] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            common.log(f"  {name}: {v} failed: {type(e).__name__}: {str(e)[:200]}", quiet)
            continue
        ref = result if v == "float32" else ref
        mem = memory_analysis_dict(c) or {}
        out["variants"][v] = {
            "trace_s": statistics.median(r[0] for r in vruns),
            "trace_lower_compile_s": statistics.median(r[1] for r in vruns),
            "trace_cpu_s": statistics.median(r[3] for r in vruns),
            "trace_lower_compile_cpu_s": statistics.median(r[4] for r in vruns),
            "hlo_converts": len(_CONVERT.findall(c.as_text())),
            "temp_bytes": mem.get("temp_size_in_bytes"), "peak_bytes_estimate": mem.get("estimated_peak_bytes"),
            **_rel_errors(result, ref)}
        compiled[v] = c
    if "float32" not in variants:
        compiled.pop("float32", None)
        out["variants"].pop("float32", None)
    _time_steps(compiled, model, timing, out)
    _ratios(out)
    return out


def _time_steps(compiled: dict, model, timing: dict, out: dict) -> None:
    import jax

    # CPU time on the CPU backend (this process, all threads: other processes on a shared machine
    # do not inflate it), wall time on accelerators, whose kernels no host clock sees.
    clock = time.process_time if jax.default_backend() == "cpu" else time.perf_counter
    out["step_clock"] = "cpu" if clock is time.process_time else "wall"

    def block(c):
        def run():
            t0 = clock()
            for _ in range(timing["steps"]):
                r = c(model.params, *model.batch)
            jax.block_until_ready(r)
            return (clock() - t0) / timing["steps"]
        return run

    for c in compiled.values():
        for _ in range(timing["warmup_steps"]):
            jax.block_until_ready(c(model.params, *model.batch))
    samples = common.time_interleaved({v: block(c) for v, c in compiled.items()}, timing["rounds"])
    for v, s in samples.items():
        out["variants"][v].update(step_time_s=common.summarize(s), samples_s=s)
    out["samples_paired"] = True


def _ratios(out: dict) -> None:
    vs = out["variants"]
    for v, r in vs.items():
        if "hand" in vs and "step_time_s" in r:
            paired = common.paired_ratios(r["samples_s"], vs["hand"]["samples_s"])
            r["step_vs_hand"] = common.summarize(paired)
        if "float32" in vs:  # in CPU time (the wall times are in trace_s, trace_lower_compile_s)
            r["trace_vs_float32"] = r["trace_cpu_s"] / vs["float32"]["trace_cpu_s"]
            r["tlc_vs_float32"] = r["trace_lower_compile_cpu_s"] / vs["float32"]["trace_lower_compile_cpu_s"]


def run(args) -> dict:
    sizes, timing, models, variants, env = common.run_setup(args, (SIZES, DRY_SIZES), (TIMING, DRY_TIMING), MODELS,
                                                            VARIANTS, compile_repeats=args.compile_repeats)
    env["versions"].update({p: common._version(d) for p, d in
                            (("grampax", "grampax"), ("jaxamp", "jaxamp"), ("mpx", "mixed-precision-for-jax"))})
    common.log(f"autocast: {env['device']}, jax {env['versions']['jax']}, half {args.half}; models {models}", args.quiet)
    results = {}
    for m in models:
        results[m] = measure_model(m, sizes, variants, args.half, timing, args.quiet)
        common.log(summary(m, results[m]), args.quiet)
    # The machine may be shared: the load at the end beside the one at the start (env), so a
    # reader can tell a quiet run from a busy one; the ratios are of interleaved runs.
    results_end = {"load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    config = {"sizes": {m: sizes[m] for m in models}, "timing": timing, "variants": variants, "half": args.half,
              "step": "jit(value_and_grad(variant(loss)))(params, x, y), params float32",
              "policy": f"O1-{args.half}"}
    return common.make_result("autocast", env, config, {"models": results, **results_end}, args.dry_run)


def summary(name: str, r: dict) -> str:
    lines = [f"{name}: variant   step ms (IQR)        /hand   trace ms  /f32   T+L+C ms  /f32  converts  loss err  grad err"]
    for v, x in r["variants"].items():
        st = x.get("step_time_s")
        sh = x.get("step_vs_hand", {}).get("median")
        lines.append(f"  {v:10s} {st['median'] * 1e3:8.3f} ({st['q25'] * 1e3:.3f}-{st['q75'] * 1e3:.3f}) "
                     f"{(f'{sh:5.2f}' if sh else '    -')} {x['trace_s'] * 1e3:9.1f} {x.get('trace_vs_float32', 0):5.2f} "
                     f"{x['trace_lower_compile_s'] * 1e3:9.1f} {x.get('tlc_vs_float32', 0):5.2f} {x['hlo_converts']:8d} "
                     f"{x['loss_rel_error']:9.2e} {x['grad_rel_error'] or 0:9.2e}")
    lines += [f"  {v:10s} skipped: {why}" for v, why in r["skipped"].items()]
    return "\n".join(lines)


def build_parser():
    parser = common.script_parser(__doc__)
    parser.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)} (default: all; peers that do not "
                                           "import are skipped and named)")
    parser.add_argument("--half", choices=("bf16", "fp16"), default="bf16", help="half dtype (default bf16)")
    common.add_timing_args(parser, "untimed steps per variant")
    parser.add_argument("--compile-repeats", type=int, help="fresh traces + compiles per variant (median)")
    return parser


def main(argv=None) -> dict:
    return common.run_and_emit("autocast", build_parser().parse_args(argv), run)


if __name__ == "__main__":
    main()
