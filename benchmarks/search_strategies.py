"""The precision search's strategies side by side: greedy promotion, the integer program, verified.

    python -m benchmarks.search_strategies                      # both models, the default ladder
    python -m benchmarks.search_strategies --models mlp --steps 4 --out -
    python -m benchmarks.search_strategies --dry-run            # the MLP, bf16 < float32, 2 steps

Each model runs ``compare_to_float32(loss, params, x, y, choose=ladder, steps=K,
search=strategy)`` for ``greedy``, ``program`` and ``verified`` (docs/precision-search.md) and
records the rungs each chose, the drift against the band, the low-precision FLOP share, the predicted matmul speed-up
on B200 (datasheet peaks: a prediction) and the search's cost in training steps and seconds.
Models: ``mlp``, the docs page's MLP whose head needs float32; ``attn``, a one-block attention
model (embedding, q/k/v/o projections, an MLP, a head) on random tokens.
"""

from __future__ import annotations

import argparse
import json
import sys

MODELS = ("mlp", "attn")
STRATEGIES = ("greedy", "program", "verified")


def _mlp():
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.key(0), 4)
    params = {"l1": jax.random.normal(k[0], (16, 32)) * 0.3, "l2": jax.random.normal(k[1], (32, 32)) * 0.2,
              "head": jax.random.normal(k[2], (32, 8)) * 0.2}
    x, y = jax.random.normal(k[3], (32, 16)), jnp.arange(32) % 8

    def loss_fn(p, x, y):
        with jax.named_scope("l1"):
            h = jnp.tanh(x @ p["l1"])
        with jax.named_scope("l2"):
            h = jnp.tanh(h @ p["l2"])
        with jax.named_scope("head"):
            z = (h + 256.0) @ p["head"] - 256.0 * jnp.sum(p["head"], 0)
        return -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(32), y])

    return loss_fn, params, x, y


def _attn():
    import jax
    import jax.numpy as jnp

    vocab, d, t, b = 32, 32, 16, 8
    k = jax.random.split(jax.random.key(1), 8)
    shapes = {"embed": (vocab, d), "qkv": (d, 3 * d), "out": (d, d), "mlp": (d, 4 * d), "mlp_out": (4 * d, d),
              "head": (d, vocab)}
    params = {n: jax.random.normal(k[i], s) * (1.0 / s[0] ** 0.5) for i, (n, s) in enumerate(shapes.items())}
    tokens = jax.random.randint(k[7], (b, t + 1), 0, vocab)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def norm(h):
        return (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)

    def loss_fn(p, x, y):
        h = p["embed"][x]
        with jax.named_scope("attn"):
            q, kk, v = jnp.split(norm(h) @ p["qkv"], 3, -1)
            s = jnp.einsum("btd,bsd->bts", q, kk) / d ** 0.5
            s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
            h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v) @ p["out"]
        with jax.named_scope("mlp"):
            h = h + jax.nn.gelu(norm(h) @ p["mlp"]) @ p["mlp_out"]
        with jax.named_scope("head"):
            z = norm(h) @ p["head"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), y[..., None], -1))

    return loss_fn, params, x, y


def run(model: str, steps: int, lr: float, ladder: bool | tuple = True) -> dict:
    """Every strategy on ``model``: their rungs, drift, FLOP shares, prediction and cost."""
    import optax

    from jaxmp.diagnostics import compare_to_float32

    loss_fn, params, x, y = {"mlp": _mlp, "attn": _attn}[model]()
    out = {}
    for strategy in STRATEGIES:
        plan = compare_to_float32(loss_fn, params, x, y, choose=ladder, steps=steps, optimizer=optax.adam(lr),
                                  search=strategy)
        print(plan, flush=True)
        shares = plan.flop_shares()
        out[strategy] = {"rungs": {m.path: m.rung for m in plan.modules}, "drift_after": plan.drift_after,
                         "band": plan.threshold, "within_band": plan.within_band, "gave_up": plan.gave_up,
                         "flop_shares": shares, "below_bf16_share": sum(v for r, v in shares.items() if r not in ("O2-bf16", "float32")),
                         "predicted_speedup_b200_vs_bf16": plan.predicted_speedup("B200").vs_bf16
                         if plan.rules is not None else None,
                         "cost_steps": plan.cost_steps,
                         "seconds": plan.seconds}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--steps", type=int, default=6, help="training steps per measurement")
    ap.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    ap.add_argument("--out", default="-", help="JSON file for the result ('-': stdout only)")
    ap.add_argument("--dry-run", action="store_true", help="seconds: the MLP, the ladder O2-bf16 < float32, 2 steps")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    ladder: bool | tuple = True
    if args.dry_run:
        models, args.steps, ladder = ["mlp"], 2, ("O2-bf16", "float32")
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"unknown model {bad[0]!r}: choose from {', '.join(MODELS)}")
    result = {m: run(m, args.steps, args.lr, ladder) for m in models}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out != "-":
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
