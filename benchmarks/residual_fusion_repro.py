"""A JAX-only repro: XLA:CPU's fusion duplicates a float32 residual chain ``(x + h @ w) + b`` into every layer.

    python -m benchmarks.residual_fusion_repro            # depths 2, 4, 8, 16
    python -m benchmarks.residual_fusion_repro --dry-run  # depths 2, 4

No jaxmp, no mixed precision: ``x = x + layer_norm(x) @ w + b``, ``L`` times, in float32, compiled
by ``jax.jit`` (forward only). Per depth it prints the ``add`` instructions of the optimized HLO,
as written and with the bias added inside the branch, ``x + (layer_norm(x) @ w + b)``. As
written the adds grow quadratically (each later layer's fusions recompute the whole residual
sum); with the bias in the branch they grow linearly. The same happens to O1's float32 residual
stream (docs/autocast.md, "Compile time of deep O1 models").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks import _common as common


def adds(depth: int, bias_in_branch: bool, width: int = 64) -> int:
    """``add`` instructions in the optimized HLO of the float32 residual chain at ``depth`` layers."""
    import jax
    import jax.numpy as jnp

    def ln(x):
        m = x.mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)

    def f(x, ws, bs):
        for w, b in zip(ws, bs):
            x = x + (ln(x) @ w + b) if bias_in_branch else x + ln(x) @ w + b
        return x.sum()

    x = jnp.ones((width, width))
    ws, bs = [jnp.ones((width, width)) * 0.01] * depth, [jnp.zeros(width)] * depth
    return jax.jit(f).lower(x, ws, bs).compile().as_text().count(" add(")


def main(argv=None) -> dict:
    parser = common.script_parser(__doc__, default_out="-")
    parser.add_argument("--depths", default="2,4,8,16", help="comma list of layer counts (default 2,4,8,16)")
    args = parser.parse_args(argv)
    depths = [2, 4] if args.dry_run else [int(s) for s in args.depths.split(",")]
    results = {form: {str(L): adds(L, form == "bias_in_branch") for L in depths}
               for form in ("as_written", "bias_in_branch")}
    for form, row in results.items():
        print(f"{form:15s} " + "  ".join(f"L={L}: {n} adds" for L, n in row.items()), flush=True)
    out = {"benchmark": "residual_fusion_repro", "env": common.jax_env(), "dry_run": args.dry_run,
           "command": " ".join(["residual_fusion_repro.py"] + sys.argv[1:]), "results": results}
    if args.out and args.out != "-":
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
