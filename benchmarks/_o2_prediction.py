"""Bytes per param of the O2 optimizer step and of the ZeRO gather, for the GPU prediction.

    python -m benchmarks._o2_prediction                  # this tree's jaxmp
    PYTHONPATH=/tmp/old:. python -m benchmarks._o2_prediction --json   # an older jaxmp (git archive REV jaxmp)

XLA's deterministic figures of the CPU programs (``cost_analysis()['bytes accessed']``), divided by
the params: the optimizer step alone (gradients in, new params and state out, state donated) with
bfloat16 params (no loss scale) and float16 params (dynamic loss scale), each beside the hand-written
floor (AdamW on float32 masters under ``lax.cond``, the params cast from the masters); and the
elements ZeRO all-gathers per step, per dtype, from the program after SPMD partitioning on the 8 CPU
devices (tests/parallel/test_gather_dtypes.py reads the same program). docs/benchmarks.md turns them
into the bytes an H100 step saves (a prediction, for the GPU issue to check).
"""

from __future__ import annotations

import argparse
import json

# GPT-2-small's transformer block shapes: the per-param figures do not depend on the model.
SHAPES = {"qkv": (768, 2304), "proj": (768, 768), "fc": (768, 3072), "out": (3072, 768), "ln": (768,)}


def optimizer_step_bytes(half: str) -> dict:
    """Bytes accessed per param by the hand-written floor and by jaxmp's fused O2 step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxmp

    dtype = jnp.bfloat16 if half == "bf16" else jnp.float16
    params = {k: jnp.zeros(s, dtype) for k, s in SHAPES.items()}
    grads = {k: np.full(s, 1e-3, np.float32).astype(dtype) for k, s in SHAPES.items()}
    n = sum(int(np.prod(s)) for s in SHAPES.values())
    inner = optax.adamw(1e-3, weight_decay=1e-4)

    def hand(g, st, p):
        m, o, scale = st
        g = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) / scale, g)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(g)]))

        def apply(mo):
            u, no = inner.update(g, mo[1], mo[0])
            return optax.apply_updates(mo[0], u), no

        nm, no = jax.lax.cond(finite, apply, lambda mo: mo, (m, o))
        scale = jnp.where(finite, scale, scale / 2) if half == "fp16" else scale
        return jax.tree_util.tree_map(lambda a, b: a.astype(b.dtype), nm, p), (nm, no, scale)

    def bytes_of(f, state):
        c = jax.jit(f, donate_argnums=(1,)).lower(grads, state, params).compile()
        cost = c.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["bytes accessed"]) / n

    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: Python float ** int32
        masters = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
        floor = bytes_of(hand, (masters, inner.init(masters), jnp.float32(2.0 ** 15)))
        tx = jaxmp.loss_scaling(inner, "none" if half == "bf16" else "dynamic", master_weights=True)
        ours = bytes_of(lambda g, s, p: tx.update_and_apply(g, s, p), tx.init(params))
    return {"params": n, "floor_bytes_per_param": floor, "jaxmp_bytes_per_param": ours, "ratio": ours / floor}


def zero_gather_elements() -> dict:
    """Elements all-gathered per step per dtype over params, jaxmp's ZeRO step and the hand-written one."""
    import jax
    import optax

    import jaxmp
    from benchmarks import _zero_gathers as t

    mesh, params, batch = t.setup()
    n = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
    with jax.numpy_dtype_promotion("standard"):
        tx = jaxmp.loss_scaling(optax.adamw(1e-3), "none", master_weights=True)
        step = jaxmp.parallel.make_sharded_train_step(t.loss, tx, mesh, layout="zero")
        p, s = jaxmp.parallel.shard_state((params, tx.init(params)), step.layout)
        ours = t.gathers(step.lower(p, s, batch))
        hand = t.hand_written_zero_gathers()

    def per_param(c):
        return {k: v / n for k, v in c.items()}

    return {"params": n, "devices": len(jax.devices()), "jaxmp": per_param(ours), "hand_written": per_param(hand),
            "jaxmp_bytes_per_param": sum(v * (2 if k in ("bf16", "f16") else 4) for k, v in ours.items()) / n,
            "hand_written_bytes_per_param": sum(v * (2 if k in ("bf16", "f16") else 4) for k, v in hand.items()) / n}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--no-gather", action="store_true", help="leave the ZeRO gather out (an old jaxmp may lack it)")
    args = parser.parse_args(argv)
    import os

    # 8 CPU devices for the ZeRO program, as the tests have (set before JAX starts its backend).
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import jaxmp

    out = {"jaxmp": jaxmp.__file__, "bf16": optimizer_step_bytes("bf16"), "fp16": optimizer_step_bytes("fp16")}
    if not args.no_gather:
        out["zero_gather"] = zero_gather_elements()
    print(json.dumps(out, indent=1) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
