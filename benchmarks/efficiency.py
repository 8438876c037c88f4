"""Deterministic efficiency of the compiled programs: HLO ops, converts and bytes accessed, no timing.

    python -m benchmarks.efficiency                     # autocast.py's sizes, CPU: results/efficiency_cpu.json
    python -m benchmarks.efficiency --dry-run --out -   # tiny sizes, seconds (the tests use it)

For each model of ``benchmarks/autocast.py`` (MLP, 32-layer MLP, Transformer, ResNet with
BatchNorm in training mode) it compiles, without running:

* the gradient program ``jit(value_and_grad(loss'))`` for ``loss'`` = ``float32`` (the loss as
  written), ``native`` (the model's native half-precision reference: the hand cast for the
  plain-function MLPs, Flax's own ``dtype=bfloat16`` on every layer for the Flax models),
  ``jaxmp-O1`` and ``jaxmp-O2`` (``jaxmp.autocast(loss, "O1-bf16" / "O2-bf16")``);
* the whole train step (``optax.chain(clip_by_global_norm(1), adamw)``, params and optimizer
  state donated): ``floor`` -- the native loss in a bare optax step plus one ``isfinite`` pass
  over the gradients, what any skip-on-overflow step costs at least -- and ``jaxmp-O1`` /
  ``jaxmp-O2`` stepped by :func:`jaxmp._step.make_step` with
  ``jaxmp.loss_scaling(chain, "dynamic")``.

Per program: ``ops`` (HLO instructions outside fused computations, parameters, tuples,
constants and bitcasts excluded: the kernels the step launches), ``converts`` (``convert``
instructions anywhere in the optimized module, fused ones included), ``bytes`` (XLA's
``cost_analysis()`` bytes accessed). Ratios: jaxmp over native (gradient) and over the floor
(step). Every number is a property of the compiled program: the same on a busy machine.
"""

from __future__ import annotations

import re

from benchmarks import _common as common

MODELS = ("mlp", "mlp32", "transformer", "resnet")
NATIVE = {"mlp": "hand cast (mlp_hand_loss)", "mlp32": "hand cast (mlp_hand_loss)",
          "transformer": "Flax dtype=bfloat16 on every layer", "resnet": "Flax dtype=bfloat16 on every layer"}
_SKIP_OPS = re.compile(r"\s(parameter|get-tuple-element|tuple|constant|bitcast)\(")
_CONVERT = re.compile(r"\sconvert\(")


def hlo_stats(compiled) -> dict:
    """ops, converts and bytes accessed of a compiled program (see the module docstring)."""
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    ops = 0
    for comp in re.split(r"\n\n", text):
        head = comp.lstrip().split("\n", 1)[0]
        if "fused_computation" in head or head.startswith("%wrapped_") or "_computation" in head.split("(")[0]:
            continue
        if re.match(r"%region_\d", head) and " ROOT " in comp and "conditional" not in comp and comp.count(" = ") <= 4:
            continue  # reduction bodies (add / max of two scalars)
        ops += sum(1 for ln in comp.splitlines() if " = " in ln and not _SKIP_OPS.search(ln))
    return {"ops": ops, "converts": len(_CONVERT.findall(text)), "bytes": float((cost or {}).get("bytes accessed", 0.0))}


def _grad_programs(model):
    import jax

    import jaxmp

    losses = {
        "float32": model.loss,
        "native": lambda p, x, y: model.hand_loss(p, x, y, jax.numpy.bfloat16),
        "jaxmp-O1": jaxmp.autocast(model.loss, "O1-bf16"),
        "jaxmp-O2": jaxmp.autocast(model.loss, "O2-bf16"),
    }
    return {n: jax.jit(jax.value_and_grad(f)).lower(model.params, *model.batch).compile() for n, f in losses.items()}


def _step_programs(model):
    import jax
    import jax.numpy as jnp
    import optax

    import jaxmp
    from jaxmp._step import make_step

    def chain():
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=1e-4))

    native = lambda p, x, y: model.hand_loss(p, x, y, jnp.bfloat16)  # noqa: E731
    tx = chain()

    def floor_step(state, batch):
        p, o = state
        loss, g = jax.value_and_grad(native)(p, *batch)
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(g)]))
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), (loss, finite)

    out = {"floor": (floor_step, tx)}
    for name, policy in (("jaxmp-O1", "O1-bf16"), ("jaxmp-O2", "O2-bf16")):
        loss = jaxmp.autocast(model.loss, policy)
        jtx = jaxmp.loss_scaling(chain(), "dynamic")
        body = make_step(lambda p, s, b, r, loss=loss: (loss(p, *b), (s, None)), jtx)

        def step(state, batch, body=body):
            p, o = state
            res = body(p, None, o, batch)
            return (res.params, res.opt_state), (res.loss, res.finite)

        out[name] = (step, jtx)
    compiled = {}
    for name, (fn, t) in out.items():
        state = (model.params, t.init(model.params))
        compiled[name] = jax.jit(fn, donate_argnums=(0,)).lower(state, model.batch).compile()
    return compiled


def measure(name: str, sizes: dict) -> dict:
    from benchmarks import autocast

    model = autocast.build_model(name, sizes)
    grad = {n: hlo_stats(c) for n, c in _grad_programs(model).items()}
    step = {n: hlo_stats(c) for n, c in _step_programs(model).items()}
    ratios = {}
    for v in ("jaxmp-O1", "jaxmp-O2"):
        ratios[f"grad {v}/native"] = {k: grad[v][k] / grad["native"][k] for k in ("ops", "converts", "bytes")
                                      if grad["native"][k]}
        ratios[f"step {v}/floor"] = {k: step[v][k] / step["floor"][k] for k in ("ops", "converts", "bytes")
                                     if step["floor"][k]}
    return {"sizes": sizes[name], "native": NATIVE[name], "grad": grad, "step": step, "ratios": ratios}


def table(results: dict) -> list[str]:
    lines = ["| model | program | variant | HLO ops | converts | bytes accessed | vs native / floor (bytes) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for m, r in results.items():
        for prog, ref in (("grad", "native"), ("step", "floor")):
            for v, s in r[prog].items():
                rel = s["bytes"] / r[prog][ref]["bytes"] if r[prog][ref]["bytes"] else float("nan")
                lines.append(f"| {m} | {prog} | {v} | {s['ops']} | {s['converts']} | {s['bytes']:.4g} | {rel:.3f} |")
    return lines


def main(argv=None) -> dict:
    parser = common.script_parser(__doc__)
    parser.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: all)")
    args = parser.parse_args(argv)

    from benchmarks import autocast

    sizes = autocast.DRY_SIZES if args.dry_run else autocast.SIZES
    models = common.parse_choices(args.models, list(MODELS), "model")
    env = common.jax_env()
    results = {}
    for m in models:
        results[m] = measure(m, sizes)
        common.log(f"efficiency: {m} done", args.quiet)
    config = {"sizes": {m: sizes[m] for m in models}, "native": {m: NATIVE[m] for m in models},
              "optimizer": "optax.chain(clip_by_global_norm(1.0), adamw(1e-3, weight_decay=1e-4))",
              "loss_scale": "jaxmp.loss_scaling(chain, 'dynamic') (jaxmp variants of the step)",
              "half": "bfloat16"}
    result = common.make_result("efficiency", env, config, {"models": results}, args.dry_run)
    print("\n".join(table(results)), flush=True)
    out = args.out
    if out is None:
        platform = env["platform"]
        out = str(common.RESULTS_DIR / (f"efficiency_{platform}.json" if not args.dry_run else "dry_run/efficiency.json"))
    common.emit(result, out)
    return result


if __name__ == "__main__":
    main()
