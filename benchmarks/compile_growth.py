"""How XLA's optimized program and compile time grow with depth: O1, O2, the Flax doors, hand casts.

    python -m benchmarks.compile_growth                           # depths 1,2,4,8,16, width 64
    python -m benchmarks.compile_growth --depths 1,4,8,16,32,64 --width 256
    python -m benchmarks.compile_growth --dry-run --out -         # depths 1,2, tiny, seconds
    python -m benchmarks.compile_growth --bias-in-branch          # ``x + (h @ w + b)``: converts per layer constant

The model is ``benchmarks/promotion.py``'s plain-JAX pre-LN Transformer LM (hand-written layer
norm, separate bias adds, unrolled layers), its residual written as the user wrote it,
``x = x + h @ w + b`` (``(x + h @ w) + b``), or with ``--bias-in-branch`` as
``x = x + (h @ w + b)``. The step is ``jit(value_and_grad(loss'))``; per variant and depth it
reports the ``convert`` instructions and all instructions of the optimized HLO (XLA's figures:
deterministic), the converts added per layer since the previous depth, and the trace + lower
+ compile time (CPU seconds of this process, one run; read ratios).

Variants: ``float32`` (the loss as written); ``hand-bf16`` (every matmul, add and activation in
bfloat16, norm statistics and softmax in float32, the loss in float32: a user's all-bf16 cast);
``hand-same`` (O1's plan written by hand: float32 residual stream, norms, GELU and softmax,
bfloat16 matmul operands; the qkv bias add and the logit scale, whose values only half matmuls
use, in bfloat16 as O1's ``promote="demand"`` runs them); ``O1`` (``jaxmp.autocast(loss, "O1-bf16")``,
``promote="demand"``); ``O2`` (``"O2-bf16"`` with ``promote="narrow"``); ``linen`` and ``nnx``
(the same model as a Linen / NNX module through ``jaxmp.flax.mixed_precision(model, "O1-bf16")``);
``O1-scan`` and ``float32-scan`` (the layers' params stacked and run by one ``lax.scan``).

Why (see docs/autocast.md, "Compile time of deep O1 models"): XLA:CPU's ``fusion`` pass
duplicates a float32 residual chain ``(x + h) + b`` into every later consumer fusion (the
float32 program itself grows quadratically); ``float-normalization-bf16`` (bf16 ops upcast,
CPU has no bf16 arithmetic) adds the converts, which the duplication then multiplies. Writes
``benchmarks/results/compile/compile_growth_<device>.json`` (``--out``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from benchmarks import _common as common

VARIANTS = ("float32", "hand-bf16", "hand-same", "O1", "O2", "linen", "nnx", "O1-scan", "float32-scan")
_CONVERT = re.compile(r"\sconvert\(")
_INSTR = re.compile(r"^\s+(ROOT )?%\S+ = ", re.M)


def sizes(width: int) -> dict:
    return dict(d=width, mlp=4 * width, seq=32, batch=2, heads=4)


def init_params(key, layers: int, d: int, mlp: int, **_):
    import jax
    import jax.numpy as jnp

    ks = iter(jax.random.split(key, 8 * layers + 4))
    n = lambda *s: jax.random.normal(next(ks), s) * 0.02  # noqa: E731
    blocks = [dict(ln1=jnp.ones(d), ln1b=jnp.zeros(d), wqkv=n(d, 3 * d), bqkv=jnp.zeros(3 * d), wo=n(d, d),
                   bo=jnp.zeros(d), ln2=jnp.ones(d), ln2b=jnp.zeros(d), w1=n(d, mlp), b1=jnp.zeros(mlp),
                   w2=n(mlp, d), b2=jnp.zeros(d)) for _ in range(layers)]
    return {"emb": n(64, d), "blocks": blocks, "head": n(d, 10), "hb": jnp.zeros(10)}


def forward(p, tok, *, d, seq, batch, heads, bias_in_branch=False, half=None, same=False, **_):
    """Logits of the plain LM. ``half``: a hand cast (``same``: O1's plan, else all-half)."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    c = (lambda a: a.astype(half)) if half is not None else (lambda a: a)  # matmul operands
    r = (lambda a: a) if (half is None or same) else (lambda a: a.astype(half))  # everything else

    def ln(x, s, b):
        x = x.astype(f32)
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return r((x - m) * jax.lax.rsqrt(v + 1e-5) * s + b)

    def dense(h, w, b):
        return c(h) @ c(w), r(b)

    def residual(x, h, w, b):
        y, b = dense(h, w, b)
        y = y.astype(x.dtype)  # explicit, so it also runs under strict dtype promotion
        return r(x + (y + b)) if bias_in_branch else r(x + y + b)

    def block(x, b):
        y, bb = dense(ln(x, b["ln1"], b["ln1b"]), b["wqkv"], b["bqkv"])
        # O1's plan: a value that only half matmuls use stays half (the qkv bias add, the logit scale)
        q, k, v = jnp.split((c(y) + c(bb)).reshape(batch, seq, 3 * heads, d // heads), 3, axis=2)
        a = jax.nn.softmax((jnp.einsum("bqhd,bkhd->bhqk", c(q), c(k)) / 8.0).astype(f32), -1)
        o = jnp.einsum("bhqk,bkhd->bqhd", c(a), c(v)).reshape(batch, seq, d)
        x = residual(x, o, b["wo"], b["bo"])
        y, bb = dense(ln(x, b["ln2"], b["ln2b"]), b["w1"], b["b1"])
        return residual(x, jax.nn.gelu(r(y.astype(bb.dtype) + bb)), b["w2"], b["b2"])

    x = r(p["emb"][tok])
    if isinstance(p["blocks"], dict):  # stacked layers: one lax.scan body
        x, _ = jax.lax.scan(lambda x, b: (block(x, b), None), x, p["blocks"])
    else:
        for b in p["blocks"]:
            x = block(x, b)
    return x.astype(f32).mean(1) @ p["head"] + p["hb"]


def _xent(logits, y):
    import jax
    import jax.numpy as jnp

    return -jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[jnp.arange(logits.shape[0]), y])


def make_variant(variant: str, layers: int, cfg: dict):
    """(loss, params, batch) of a variant: ``loss(params, tok, y)``, differentiated w.r.t. params."""
    import jax
    import jax.numpy as jnp

    import jaxmp

    key = jax.random.key(0)
    params = init_params(key, layers, **cfg)
    batch = (jax.random.randint(key, (cfg["batch"], cfg["seq"]), 0, 64), jnp.arange(cfg["batch"]) % 10)
    loss = lambda p, tok, y: _xent(forward(p, tok, **cfg), y)  # noqa: E731
    if variant == "float32":
        return loss, params, batch
    if variant in ("hand-bf16", "hand-same"):
        same = variant == "hand-same"
        return (lambda p, tok, y: _xent(forward(p, tok, half=jnp.bfloat16, same=same, **cfg), y)), params, batch
    if variant == "O1":
        return jaxmp.autocast(loss, "O1-bf16"), params, batch
    if variant in ("O1-scan", "float32-scan"):  # the layers stacked, run by lax.scan
        params = {**params, "blocks": jax.tree_util.tree_map(lambda *a: jnp.stack(a), *params["blocks"])}
        return (jaxmp.autocast(loss, "O1-bf16") if variant == "O1-scan" else loss), params, batch
    if variant == "O2":
        return jaxmp.autocast(loss, "O2-bf16", rules=jaxmp.AutocastRules(promote="narrow")), params, batch
    if variant == "linen":
        return _linen(params, batch, cfg)
    if variant == "nnx":
        return _nnx(params, batch, cfg)
    raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(VARIANTS)}")


def _linen(params, batch, cfg):
    import flax.linen as nn

    import jaxmp.flax

    class PlainLM(nn.Module):  # the same forward, its params Linen's
        @nn.compact
        def __call__(self, tok):
            p = self.param("p", lambda _: params)
            return forward(p, tok, **cfg)

    model = jaxmp.flax.mixed_precision(PlainLM(), "O1-bf16")
    return (lambda p, tok, y: _xent(model.apply({"params": p}, tok), y)), {"p": params}, batch


def _nnx(params, batch, cfg):
    import jax
    from flax import nnx

    import jaxmp.flax

    leaves, treedef = jax.tree_util.tree_flatten(params)

    class PlainLM(nnx.Module):  # one nnx.Param per array, the same forward
        def __init__(self):
            for i, leaf in enumerate(leaves):
                setattr(self, f"w{i}", nnx.Param(leaf))

        def __call__(self, tok):
            p = jax.tree_util.tree_unflatten(treedef, [getattr(self, f"w{i}").get_value() for i in range(len(leaves))])
            return forward(p, tok, **cfg)

    graphdef, state = nnx.split(PlainLM())

    def loss(s, tok, y):
        model = jaxmp.flax.mixed_precision(nnx.merge(graphdef, s), "O1-bf16")
        return _xent(model(tok), y)

    return loss, state, batch


def measure(variant: str, layers: int, cfg: dict, grad: bool = True) -> dict:
    """Optimized-HLO figures and CPU times of ``jit(value_and_grad(loss'))`` (``grad=False``: ``jit(loss')``)."""
    import jax

    loss, params, batch = make_variant(variant, layers, cfg)
    t0 = time.process_time()
    lowered = jax.jit(jax.value_and_grad(loss) if grad else loss).lower(params, *batch)
    t1 = time.process_time()
    text = lowered.compile().as_text()
    t2 = time.process_time()
    return {"converts": len(_CONVERT.findall(text)), "instructions": len(_INSTR.findall(text)),
            "trace_lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def per_layer(rows: dict, depths: list[int]) -> None:
    """Adds ``converts_per_layer``: converts added per layer since the previous depth (at the first: total / depth)."""
    prev = None
    for L in depths:
        r = rows[str(L)]
        r["converts_per_layer"] = (r["converts"] / L if prev is None
                                   else (r["converts"] - rows[str(prev)]["converts"]) / (L - prev))
        prev = L


def main(argv=None) -> dict:
    parser = common.script_parser(__doc__, default_out=None)
    parser.add_argument("--depths", default="1,2,4,8,16", help="comma list of layer counts (default 1,2,4,8,16)")
    parser.add_argument("--width", type=int, default=64, help="model width d (mlp 4d; default 64)")
    parser.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--bias-in-branch", action="store_true", help="write the residual as x + (h @ w + b)")
    args = parser.parse_args(argv)
    depths = [1, 2] if args.dry_run else [int(s) for s in args.depths.split(",")]
    cfg = dict(sizes(8 if args.dry_run else args.width), bias_in_branch=args.bias_in_branch)
    if args.dry_run:
        cfg.update(seq=4, heads=2)
    variants = common.parse_choices(args.variants, list(VARIANTS), "variant")
    results: dict = {}
    for v in variants:
        rows = results[v] = {}
        for L in depths:
            rows[str(L)] = measure(v, L, cfg)
        per_layer(rows, depths)
    base = results.get("hand-bf16")
    for v, rows in results.items():
        for L in depths:
            r = rows[str(L)]
            if base is not None:
                r["compile_vs_hand_bf16"] = r["compile_s"] / base[str(L)]["compile_s"]
            print(f"{v:10s} L={L:3d} converts {r['converts']:6d} ({r['converts_per_layer']:7.1f}/layer) "
                  f"instructions {r['instructions']:7d} compile {r['compile_s']:7.2f} s"
                  + (f" ({r['compile_vs_hand_bf16']:.2f}x hand-bf16)" if base is not None else ""), flush=True)
    out = {"benchmark": "compile_growth", "env": common.jax_env(), "commit": common.git_commit(),
           "utc": common.utc_now(), "dry_run": args.dry_run, "command": " ".join(["compile_growth.py"] + sys.argv[1:]),
           "config": cfg, "depths": depths,
           "units": "converts/instructions: optimized HLO; times: CPU seconds of this process, one run",
           "results": results}
    if args.out and args.out != "-":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
