"""What each autocast promotion rule costs: XLA bytes accessed and compiled peak of value_and_grad.

Run: ``python -m benchmarks.promotion [--out FILE]``; ``--dry-run`` runs every row at tiny sizes
in seconds (the tests use it). Compares float32, the native half
reference (hand cast / Flax dtype=bfloat16), O1 under ``promote="narrow"``, ``"demand"`` (O1's
default) and ``"widest"``, and O2 (narrow), on the benchmark models and a 4-block plain-JAX
Transformer whose biases are separate adds. CPU times are printed but informational only.
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxmp
from jaxmp import AutocastRules
from benchmarks import autocast as ab
from benchmarks import efficiency as eff


def plain_transformer(key, layers=4, d=256, mlp=1024, seq=128, batch=8, heads=4):
    ks = iter(jax.random.split(key, 64))
    n = lambda *s: jax.random.normal(next(ks), s) * 0.02
    params = {"emb": n(64, d), "blocks": [dict(ln1=jnp.ones(d), ln1b=jnp.zeros(d), wqkv=n(d, 3 * d), bqkv=jnp.zeros(3 * d),
              wo=n(d, d), bo=jnp.zeros(d), ln2=jnp.ones(d), ln2b=jnp.zeros(d), w1=n(d, mlp), b1=jnp.zeros(mlp),
              w2=n(mlp, d), b2=jnp.zeros(d)) for _ in range(layers)], "head": n(d, 10), "hb": jnp.zeros(10)}
    def ln(x, s, b):
        m = x.mean(-1, keepdims=True); v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * s + b
    def loss(p, tok, y):
        x = p["emb"][tok]
        for b in p["blocks"]:
            h = ln(x, b["ln1"], b["ln1b"]) @ b["wqkv"] + b["bqkv"]
            q, k, v = jnp.split(h.reshape(batch, seq, 3 * heads, d // heads), 3, axis=2)
            a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0, -1)
            o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(batch, seq, d)
            x = x + o @ b["wo"] + b["bo"]
            x = x + jax.nn.gelu(ln(x, b["ln2"], b["ln2b"]) @ b["w1"] + b["b1"]) @ b["w2"] + b["b2"]
        logits = x.mean(1) @ p["head"] + p["hb"]
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(batch), y])
    tok = jax.random.randint(key, (batch, seq), 0, 64); y = jnp.arange(batch) % 10
    return params, (tok, y), loss

#: The plain Transformer's sizes: full, and tiny for ``--dry-run``.
PLAIN = dict(layers=4, d=256, mlp=1024, seq=128, batch=8, heads=4)
DRY_PLAIN = dict(layers=1, d=16, mlp=32, seq=8, batch=2, heads=2)


def measure(loss, params, batch, repeats=7):
    c = jax.jit(jax.value_and_grad(loss)).lower(params, *batch).compile()
    st = eff.hlo_stats(c); ma = c.memory_analysis()
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
    c(params, *batch)[0].block_until_ready()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter(); jax.block_until_ready(c(params, *batch)); ts.append(time.perf_counter() - t0)
    return {"MiB": st["bytes"] / 2**20, "peak MiB": peak / 2**20, "converts": st["converts"], "ms": 1e3 * float(np.median(ts))}

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, one timed call: a smoke run in seconds")
    parser.add_argument("--models", help="comma list of mlp, transformer, resnet, plain-transformer (default: all)")
    args = parser.parse_args(argv)
    from benchmarks import _common as common

    chosen = common.parse_choices(args.models, ["mlp", "transformer", "resnet", "plain-transformer"], "model")
    sizes, plain, repeats = (ab.DRY_SIZES, DRY_PLAIN, 1) if args.dry_run else (ab.SIZES, PLAIN, 7)
    models = {}
    for name in [m for m in ("mlp", "transformer", "resnet") if m in chosen]:
        m = ab.build_model(name, sizes)
        models[name] = (m.params, m.batch, m.loss, lambda p, x, y, m=m: m.hand_loss(p, x, y, jnp.bfloat16))
    if "plain-transformer" in chosen:
        p, b, l = plain_transformer(jax.random.key(0), **plain)
        models[f"plain-transformer-{plain['layers']}"] = (p, b, l, None)
    out = {}
    for name, (params, batch, loss, native) in models.items():
        row = {"float32": measure(loss, params, batch, repeats)}
        if native is not None:
            row["native"] = measure(native, params, batch, repeats)
        for pr in ["narrow", "demand", "widest"]:
            o1 = jaxmp.autocast(loss, "O1-bf16", rules=AutocastRules(promote=pr))
            row[f"O1 {pr}"] = measure(o1, params, batch, repeats)
        o2 = jaxmp.autocast(loss, "O2-bf16", rules=AutocastRules(promote="narrow"))
        row["O2 narrow"] = measure(o2, params, batch, repeats)
        out[name] = row
        for k, v in row.items():
            print(f"{name:22s} {k:10s} bytes {v['MiB']:9.1f} MiB  peak {v['peak MiB']:8.1f} MiB  "
                  f"converts {v['converts']:4d}  cpu {v['ms']:7.2f} ms", flush=True)
    if args.out:  # provenance beside the table: device, JAX version, commit
        with open(args.out, "w") as f:
            json.dump({"env": common.jax_env(), "commit": common.git_commit(), "utc": common.utc_now(),
                       "dry_run": args.dry_run,
                       "units": "bytes and peak in MiB, cpu time in ms (informational)", "models": out}, f, indent=1)
    return out


if __name__ == "__main__":
    main()
