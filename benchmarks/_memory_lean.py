"""The lean recipes' memory at GPT-2-small shape (``python -m benchmarks.memory --lean``): compile-only.

For each recipe (float32 AdamW, O2-bf16 with float32 masters, and the `jaxmp.lean` presets down
to 4-bit moments) and each state layout, the step of `jaxmp.parallel.make_sharded_train_step`
is lowered and compiled on 8 simulated devices (nothing is allocated); a row holds the params
and optimizer state bytes per device, read from the compiled program's input shardings
(``sharding.shard_shape`` of each leaf, block scales and counters included), and the compiled
program's memory statistics (``memory_analysis()``: temporaries and the peak estimate
arguments + outputs + temporaries - aliased). The per-parameter headline is the replicated
row's params + state over the parameter count; the peak is compared with O2-bf16 + masters in
the same layout.

The model is `benchmarks/_gpt2.py`'s (124.4M params; unrolled for ``replicated`` and ``zero``,
scanned with ``jaxmp.parallel.scan_layers`` for ``fsdp``), one 128-token sequence per device,
the gradient reduced in XLA's dtype (``reduce_dtype=None``).
"""

from __future__ import annotations

#: name -> (params dtype, what `_tx` builds). "fp32-adamw": float32 params and plain optax AdamW
#: (12 B/param); the rest bf16 params under `jaxmp.lean.preset`.
LEAN_RECIPES = ("fp32-adamw", "fp32-masters", "bf16-sr", "remainders-8bit", "remainders-4bit", "bf16-sr-8bit",
                "bf16-sr-4bit")
LEAN_LAYOUTS = ("replicated", "zero", "fsdp")
#: The recipe the peaks are compared with: O2-bf16 with float32 masters (jaxmp's default O2).
REFERENCE = "fp32-masters"

_NAMES = {"fp32-adamw": "float32 AdamW (float32 params)", "fp32-masters": "O2-bf16 + float32 masters",
          "bf16-sr": "`\"bf16-sr\"`", "remainders-8bit": "`\"remainders-8bit\"`",
          "remainders-4bit": "`\"remainders-4bit\"`", "bf16-sr-8bit": "`\"bf16-sr-8bit\"`",
          "bf16-sr-4bit": "`\"bf16-sr-4bit\"`"}


def compiled_stats(compiled) -> dict:
    """``compiled.memory_analysis()``'s sizes and the peak estimate arguments + outputs + temporaries - aliased."""
    mem = compiled.memory_analysis()
    stats = {k: int(getattr(mem, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                                               "alias_size_in_bytes")}
    stats["peak_estimate_bytes"] = (stats["argument_size_in_bytes"] + stats["output_size_in_bytes"]
                                    + stats["temp_size_in_bytes"] - stats["alias_size_in_bytes"])
    return stats


def _tx(recipe: str):
    import optax

    import jaxmp
    from jaxmp import lean

    if recipe == "fp32-adamw":
        return jaxmp.loss_scaling(optax.adamw(1e-3), "none")
    return jaxmp.loss_scaling(lean.preset(recipe, optax.adamw(1e-3), key=0), "none")


def measure_lean(recipe: str, layout: str, n: int, shape) -> dict:
    """One compile-only row: ``recipe``'s step in ``layout`` on the first ``n`` devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmp
    from benchmarks import _gpt2

    scanned = layout == "fsdp"
    params = _gpt2.abstract_params(shape, scanned, jnp.float32 if recipe == "fp32-adamw" else jnp.bfloat16)
    tx = _tx(recipe)
    mesh = jaxmp.parallel.make_data_mesh(jax.devices()[:n])
    step = jaxmp.parallel.make_sharded_train_step(_gpt2.loss_fn(shape, scanned, per_layer=scanned), tx, mesh,
                                                  layout=layout, donate=True)
    p, o = jaxmp.parallel.abstract_state((params, jax.eval_shape(tx.init, params)), mesh, layout)
    compiled = step.lower(p, o, _gpt2.abstract_batch(shape, n)).compile()
    (in_shardings, _), = [compiled.input_shardings]

    def per_device(tree, shardings):
        return sum(int(np.prod(s.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
                   for x, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)))

    n_params = _gpt2.param_count(shape)
    param_bytes, state_bytes = per_device(p, in_shardings[0]), per_device(o, in_shardings[1])
    return {"recipe": recipe, "layout": layout, "devices": n, "params": n_params,
            "param_bytes_per_device": param_bytes, "opt_state_bytes_per_device": state_bytes,
            "bytes_per_param": (param_bytes + state_bytes) / n_params, "compiled": compiled_stats(compiled)}


def lean_markdown(rows: list[dict]) -> str:
    """The rows as the markdown table docs/lean-recipes.md quotes (a test compares the two).

    One line per recipe: params + state bytes per parameter (replicated: the training state a
    parameter costs; zero, fsdp: per device), and the compiled peak per device in MiB with its
    ratio to O2-bf16 + masters in the same layout.
    """
    by = {(r["recipe"], r["layout"]): r for r in rows}
    layouts = [lay for lay in LEAN_LAYOUTS if any(r["layout"] == lay for r in rows)]
    head = "| recipe | " + " | ".join(f"state B/param {lay}" for lay in layouts) + " | " + " | ".join(
        f"peak MiB {lay} (vs O2 + masters)" for lay in layouts) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(layouts))]
    for recipe in LEAN_RECIPES:
        if not any(r["recipe"] == recipe for r in rows):
            continue
        cells = [f"{by[recipe, lay]['bytes_per_param']:.2f}" if (recipe, lay) in by else "-" for lay in layouts]
        for lay in layouts:
            row, ref = by.get((recipe, lay)), by.get((REFERENCE, lay))
            if row is None:
                cells.append("-")
                continue
            peak = row["compiled"]["peak_estimate_bytes"]
            ratio = f" ({peak / ref['compiled']['peak_estimate_bytes']:.2f}x)" if ref else ""
            cells.append(f"{peak / 2**20:.1f}{ratio}")
        lines.append(f"| {_NAMES[recipe]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
