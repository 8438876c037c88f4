"""fp8 against bf16 under jaxmp.autocast: step time and the loss curve, in one process.

    python benchmarks/fp8.py                    # GPU (H100 or newer: fp8 Tensor Cores)
    python benchmarks/fp8.py --dry-run --out -  # tiny sizes on CPU (fp8 emulated), seconds

Models (float32 params, AdamW through ``jaxmp.loss_scaling``, synthetic regression data):

* ``mlp``: 4096 -> 16384 -> 4096 with GELU, 16,384 tokens per step (the issue's Flax MLP);
* ``transformer``: pre-LN encoder blocks of width 2048 (16 heads, MLP 8192), 2 layers,
  batch 8 x 512 tokens, attention through ``jax.nn.dot_product_attention``.

Variants: ``bf16`` is ``jaxmp.autocast(loss, "O2-bf16")``; ``fp8`` the same with
``AutocastRules(fp8_matmuls=jaxmp.fp8.CurrentScaling())`` (E4M3 operands, E5M2 gradients,
per-tensor current scaling). Steps of the two variants are timed interleaved (median and IQR of
``--rounds`` blocks); then each trains ``--train-steps`` steps from the same init on the same
batches and the two loss curves are compared (final loss and the largest gap over the last
half). On a CPU the fp8 variant is emulated (fp8 rounding, matmuls in bf16): its times say
nothing about fp8 speed. Writes ``benchmarks/results/fp8_<device>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common as common  # noqa: E402

MODELS = ("mlp", "transformer")
VARIANTS = ("bf16", "fp8")
SIZES = {"mlp": dict(d_in=4096, hidden=16384, tokens=16384),
         "transformer": dict(layers=2, dim=2048, heads=16, mlp=8192, seq=512, batch=8)}
DRY_SIZES = {"mlp": dict(d_in=16, hidden=32, tokens=64),
             "transformer": dict(layers=1, dim=32, heads=2, mlp=64, seq=16, batch=2)}
TIMING = dict(rounds=10, steps=5, warmup_steps=3, train_steps=300)
DRY_TIMING = dict(rounds=2, steps=1, warmup_steps=1, train_steps=4)


def _normal(key, shape, scale):
    import jax

    return jax.random.normal(key, shape) * scale


def make_mlp(key, d_in: int, hidden: int, tokens: int):
    """(params, loss(params, x, y), batch maker) of the MLP."""
    import jax
    import jax.numpy as jnp

    k = jax.random.split(key, 2)
    params = {"w1": _normal(k[0], (d_in, hidden), d_in**-0.5), "w2": _normal(k[1], (hidden, d_in), hidden**-0.5)}

    def loss(p, x, y):
        return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def batch(key):
        kx, kt = jax.random.split(key)
        x = jax.random.normal(kx, (tokens, d_in))
        return x, jnp.tanh(x[:, ::-1]) + 0.1 * jax.random.normal(kt, (tokens, d_in))

    return params, loss, batch


def make_transformer(key, layers: int, dim: int, heads: int, mlp: int, seq: int, batch: int):
    """(params, loss(params, x, y), batch maker) of a pre-LN encoder regressing a target sequence."""
    import jax
    import jax.numpy as jnp

    def layer_params(k):
        k = jax.random.split(k, 4)
        return {"qkv": _normal(k[0], (dim, 3 * dim), dim**-0.5), "out": _normal(k[1], (dim, dim), dim**-0.5),
                "up": _normal(k[2], (dim, mlp), dim**-0.5), "down": _normal(k[3], (mlp, dim), mlp**-0.5),
                "ln1": jnp.ones((dim,)), "ln2": jnp.ones((dim,))}

    params = {"layers": [layer_params(k) for k in jax.random.split(key, layers)]}

    def norm(h, scale):
        mu = h.mean(-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * scale

    def loss(p, x, y):
        h = x
        for lp in p["layers"]:
            q, k, v = jnp.split(norm(h, lp["ln1"]) @ lp["qkv"], 3, axis=-1)
            shape = (*h.shape[:2], heads, dim // heads)
            a = jax.nn.dot_product_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape))
            h = h + a.reshape(h.shape) @ lp["out"]
            h = h + jax.nn.gelu(norm(h, lp["ln2"]) @ lp["up"]) @ lp["down"]
        return jnp.mean((h - y) ** 2)

    def make_batch(key):
        kx, kt = jax.random.split(key)
        x = jax.random.normal(kx, (batch, seq, dim))
        return x, jnp.roll(x, 1, axis=1) * 0.5 + 0.1 * jax.random.normal(kt, x.shape)

    return params, loss, make_batch


def make_step(loss, variant: str):
    """``jit(step)(params, opt_state, x, y) -> (params, opt_state, loss)`` for one variant."""
    import jax
    import optax

    import jaxmp
    from jaxmp import fp8

    rules = jaxmp.AutocastRules(fp8_matmuls=fp8.CurrentScaling()) if variant == "fp8" else None
    cast_loss = jaxmp.autocast(loss, "O2-bf16", rules=rules)
    tx = jaxmp.loss_scaling(optax.adamw(3e-4), loss_scale="none")

    def step(params, opt_state, x, y):
        value, grads = jaxmp.value_and_grad(cast_loss, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jaxmp.apply_updates(params, updates, opt_state), opt_state, value

    return tx, jax.jit(step, donate_argnums=(0, 1))


def measure_model(name: str, sizes: dict, variants: list[str], timing: dict, quiet: bool) -> dict:
    import jax

    build = {"mlp": make_mlp, "transformer": make_transformer}[name]
    params, loss, batch = build(jax.random.PRNGKey(0), **sizes[name])
    batches = [batch(k) for k in jax.random.split(jax.random.PRNGKey(1), 4)]
    out: dict = {"sizes": sizes[name], "variants": {}}
    steps, states = {}, {}
    for v in variants:
        tx, step = make_step(loss, v)
        p = jax.tree_util.tree_map(lambda a: a.copy(), params)
        state = (p, tx.init(p))
        t0 = time.perf_counter()
        compiled = step.lower(*state, *batches[0]).compile()
        out["variants"][v] = {"compile_s": time.perf_counter() - t0}
        steps[v], states[v] = compiled, state

    def block(v):
        def run():
            p, s = states[v]
            t0 = time.perf_counter()
            for i in range(timing["steps"]):
                p, s, value = steps[v](p, s, *batches[i % len(batches)])
            jax.block_until_ready(value)
            states[v] = (p, s)
            return (time.perf_counter() - t0) / timing["steps"]
        return run

    for v in variants:
        for _ in range(timing["warmup_steps"]):
            block(v)()
    samples = common.time_interleaved({v: block(v) for v in variants}, timing["rounds"])
    for v, s in samples.items():
        out["variants"][v].update(step_time_s=common.summarize(s), samples_s=s)
    if "bf16" in samples and "fp8" in samples:
        out["fp8_speedup"] = common.summarize(common.paired_ratios(samples["bf16"], samples["fp8"]))
    curves = {}
    for v in variants:  # same init, same batches: only the precision differs
        tx, step = make_step(loss, v)
        p = jax.tree_util.tree_map(lambda a: a.copy(), params)
        s, curve = tx.init(p), []
        for i in range(timing["train_steps"]):
            p, s, value = step(p, s, *batches[i % len(batches)])
            curve.append(float(value))
        curves[v] = curve
        out["variants"][v].update(loss_curve=curve, final_loss=curve[-1])
    if "bf16" in curves and "fp8" in curves:
        half = len(curves["bf16"]) // 2
        out["max_rel_loss_gap_last_half"] = max(abs(a - b) / abs(b) for a, b in
                                                zip(curves["fp8"][half:], curves["bf16"][half:]))
    common.log(summary(name, out), quiet)
    return out


def summary(name: str, r: dict) -> str:
    lines = [f"{name}: variant  step ms (IQR)          final loss"]
    for v, x in r["variants"].items():
        st = x["step_time_s"]
        lines.append(f"  {v:6s} {st['median'] * 1e3:9.3f} ({st['q25'] * 1e3:.3f}-{st['q75'] * 1e3:.3f})  "
                     f"{x['final_loss']:.5f}")
    if "fp8_speedup" in r:
        lines.append(f"  fp8 speed-up over bf16: {r['fp8_speedup']['median']:.3f}x; largest relative loss gap "
                     f"over the last half: {r['max_rel_loss_gap_last_half']:.4f}")
    return "\n".join(lines)


def run(args) -> dict:
    import jax

    from jaxmp import fp8

    sizes = DRY_SIZES if args.dry_run else SIZES
    timing = common.timing_from_args(args, TIMING, DRY_TIMING)
    if args.train_steps is not None:
        timing["train_steps"] = args.train_steps
    models = common.parse_choices(args.models, list(MODELS), "model")
    variants = common.parse_choices(args.variants, list(VARIANTS), "variant")
    env = common.jax_env()
    native, why = fp8.native_fp8(jax.devices()[0])
    common.log(f"fp8: {env['device']}: {why}", args.quiet)
    results = {m: measure_model(m, sizes, variants, timing, args.quiet) for m in models}
    config = {"sizes": {m: sizes[m] for m in models}, "timing": timing, "variants": variants,
              "native_fp8": native, "native_fp8_reason": why,
              "step": "jit(step) with jaxmp.autocast(loss, 'O2-bf16'[, fp8_matmuls=CurrentScaling()]), "
                      "AdamW 3e-4 through jaxmp.loss_scaling, float32 params"}
    return common.make_result("fp8", env, config, {"models": results}, args.dry_run)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser, default_out=None)
    parser.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    common.add_timing_args(parser, "untimed blocks per variant")
    parser.add_argument("--train-steps", type=int, help="steps of the loss-curve comparison")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    result = run(args)
    common.emit_to_default(result, args.out, "fp8")
    return result


if __name__ == "__main__":
    main()
