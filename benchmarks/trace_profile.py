"""Where jaxmp.autocast's trace time goes: the engine's own Python per equation vs JAX's tracing.

    python -m benchmarks.trace_profile                    # autocast.py's sizes, all four models
    python -m benchmarks.trace_profile --dry-run --out -  # tiny sizes, seconds

For each model of ``benchmarks/autocast.py`` it traces ``jit(value_and_grad(loss'))`` once
to warm JAX's global caches, then profiles (``cProfile``) one trace of a *fresh* wrapper for the
hand cast and for ``jaxmp.autocast(loss, "O1-bf16")``, and reports: the profiled trace time of
each; the time spent in the engine's own functions (``jaxmp/engine/*``, self time) and per
interpreted equation; the time in JAX's linearization (``linearize_jaxpr`` / per-equation
``fallback_linearize_rule``) and transposition (``backward_pass``); and the number of equations
the engine interpreted. cProfile slows everything alike, so read ratios, not absolute times;
the timings without a profiler are ``benchmarks/autocast.py``'s.
"""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import sys
from pathlib import Path

from benchmarks import _common as common

MODELS = ("mlp", "mlp32", "transformer", "resnet")


def _profile(fn, params, batch) -> pstats.Stats:
    import jax

    gc.collect()  # as benchmarks/autocast.py: no full collection owed by earlier traces lands here
    pr = cProfile.Profile()
    pr.enable()
    jax.jit(jax.value_and_grad(fn)).trace(params, *batch)
    pr.disable()
    return pstats.Stats(pr)


def _summary(st: pstats.Stats) -> dict:
    total = sum(v[2] for v in st.stats.values())  # self times: the whole profiled trace
    engine = sum(v[2] for (f, _, _), v in st.stats.items() if f"jaxmp{os.sep}engine{os.sep}" in f)
    cum = {}
    for (f, _, name), v in st.stats.items():
        for key, (file_part, func) in {"linearize": ("interpreters/ad.py", "linearize_jaxpr"),
                                       "transpose": ("interpreters/ad.py", "backward_pass3"),
                                       "interpret": (f"engine{os.sep}_interpreter.py", "run")}.items():
            if f.endswith(file_part) and name == func:
                cum[key] = max(cum.get(key, 0.0), v[3])
    calls = {name: v[1] for (f, _, name), v in st.stats.items()
             if f.endswith(f"engine{os.sep}_interpreter.py") and name in ("first_order",)}
    return {"profiled_trace_s": total, "engine_self_s": engine, "linearize_s": cum.get("linearize", 0.0),
            "transpose_s": cum.get("transpose", 0.0), "interpret_cumulative_s": cum.get("interpret", 0.0),
            "first_order_equations": calls.get("first_order", 0)}


def measure(name: str, sizes: dict) -> dict:
    import jax

    from benchmarks import autocast

    model = autocast.build_model(name, sizes)
    out = {}
    for v in ("hand", "jaxmp"):
        factory, _ = autocast.variant_factory(v, model, "bf16")
        jax.jit(jax.value_and_grad(factory())).trace(model.params, *model.batch)  # warm JAX's caches
        out[v] = _summary(_profile(factory(), model.params, model.batch))
    j = out["jaxmp"]
    eqns = j["first_order_equations"]
    out["engine_self_us_per_equation"] = 1e6 * j["engine_self_s"] / eqns if eqns else None
    out["engine_share_of_jaxmp_trace"] = j["engine_self_s"] / j["profiled_trace_s"]
    out["jaxmp_over_hand_profiled"] = j["profiled_trace_s"] / out["hand"]["profiled_trace_s"]
    return out


def main(argv=None) -> dict:
    parser = common.script_parser(__doc__, default_out="-")
    parser.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: all)")
    args = parser.parse_args(argv)

    from benchmarks import autocast

    sizes = autocast.DRY_SIZES if args.dry_run else autocast.SIZES
    models = common.parse_choices(args.models, list(MODELS), "model")
    results = {m: measure(m, sizes) for m in models}
    for m, r in results.items():
        h, j = r["hand"], r["jaxmp"]
        print(f"{m:12s} profiled trace: hand {h['profiled_trace_s'] * 1e3:7.1f} ms, jaxmp {j['profiled_trace_s'] * 1e3:7.1f} ms "
              f"({r['jaxmp_over_hand_profiled']:.2f}x); engine self {j['engine_self_s'] * 1e3:6.1f} ms "
              f"({100 * r['engine_share_of_jaxmp_trace']:.0f}%, {r['engine_self_us_per_equation'] or 0:.0f} us/eqn over "
              f"{j['first_order_equations']} eqns); JAX linearize {j['linearize_s'] * 1e3:.0f} ms (hand "
              f"{h['linearize_s'] * 1e3:.0f}), transpose {j['transpose_s'] * 1e3:.0f} ms (hand {h['transpose_s'] * 1e3:.0f})",
              flush=True)
    if args.out and args.out != "-":
        import json

        env = common.jax_env()
        Path(args.out).write_text(json.dumps({"benchmark": "trace_profile", "env": env, "dry_run": args.dry_run,
                                              "command": " ".join(["trace_profile.py"] + sys.argv[1:]),
                                              "results": results}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
