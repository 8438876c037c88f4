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
    from experiments.program import lean_is_stochastic

    return jaxmp.loss_scaling(lean.preset(recipe, optax.adamw(1e-3), key=0 if lean_is_stochastic(recipe) else None),
                              "none")


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


#: The update-cost setup: two 1024x1024 weights and a bias (2.1M params), one device.
UPDATE_SHAPES = {"w1": (1024, 1024), "w2": (1024, 1024), "b": (1024,)}
UPDATE_SHAPES_DRY = {"w1": (64, 64), "b": (64,)}


def measure_update(recipe: str, shapes: dict, rounds: int, calls: int) -> dict:
    """One row of the update cost: XLA's ``cost_analysis`` bytes accessed and temporaries of the
    jitted update + apply (params and state donated) per parameter, and its CPU time (median of
    ``rounds`` rounds of ``calls`` calls, after a warm-up call). ``"fp32-adamw"`` is optax's AdamW
    on float32 params, applied with ``optax.apply_updates``; the others the lean presets on
    bfloat16 params through ``jaxmp.loss_scaling(..., "none").update_and_apply``."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    dtype = jnp.float32 if recipe == "fp32-adamw" else jnp.bfloat16
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(size=s) / 30, dtype) for k, s in shapes.items()}
    grads = jax.tree_util.tree_map(lambda a: (a * 0.01).astype(dtype), params)
    if recipe == "fp32-adamw":
        tx = optax.adamw(1e-3)

        def update(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
    else:
        tx = _tx(recipe)

        def update(p, s, g):
            return tx.update_and_apply(g, s, p)

    state = tx.init(params)
    n = sum(int(np.prod(s)) for s in shapes.values())
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves((params, state)))
    jitted = jax.jit(update, donate_argnums=(0, 1))
    compiled = jitted.lower(params, state, grads).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    p, s = jitted(params, state, grads)
    jax.block_until_ready(p)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            p, s = jitted(p, s, grads)
        jax.block_until_ready(p)
        times.append((time.perf_counter() - start) / calls)
    return {"recipe": recipe, "layout": "update", "devices": 1, "params": n, "bytes_per_param": state_bytes / n,
            "bytes_accessed_per_param": float(cost["bytes accessed"]) / n,
            "compiled": {"peak_estimate_bytes": compiled_stats(compiled)["peak_estimate_bytes"],
                         "temp_size_in_bytes": int(compiled.memory_analysis().temp_size_in_bytes)},
            "seconds_per_update": float(np.median(times))}


def update_markdown(rows: list[dict]) -> str:
    """The update-cost rows as docs/lean-recipes.md#what-the-update-costs quotes them."""
    base = next(r for r in rows if r["recipe"] == "fp32-adamw")
    lines = ["| recipe | state B/param | update bytes accessed / param (vs float32 AdamW) | temporaries B/param | "
             "CPU time / update (vs float32 AdamW) |", "|---|---|---|---|---|"]
    for r in rows:
        name = "float32 AdamW (optax alone)" if r["recipe"] == "fp32-adamw" else _NAMES[r["recipe"]]
        lines.append(f"| {name} | {r['bytes_per_param']:.2f} | {r['bytes_accessed_per_param']:.0f} "
                     f"({r['bytes_accessed_per_param'] / base['bytes_accessed_per_param']:.2f}x) | "
                     f"{r['compiled']['temp_size_in_bytes'] / r['params']:.1f} | "
                     f"{r['seconds_per_update'] * 1e3:.1f} ms "
                     f"({r['seconds_per_update'] / base['seconds_per_update']:.2f}x) |")
    return "\n".join(lines)
