"""Training-state memory per device, per state layout and lean recipe: compile-only, nothing allocated.

For an O2-bf16 model (bfloat16 params) trained with AdamW under ``jaxmp.loss_scaling``, each
(recipe, layout, device count N) is lowered and compiled with
``make_sharded_train_step(...).lower(abstract params, abstract opt state, abstract batch).compile()``
on a mesh of the first N devices; the state's bytes per device are read from the *compiled*
program's input shardings (each leaf's ``sharding.shard_shape``), and compared with the analytic
value (bytes per parameter times the parameter count):

=================  ============  =============  ========
recipe             replicated    zero           fsdp
=================  ============  =============  ========
fp32-masters       14            2 + 12/N       14/N
remainders         12            2 + 10/N       12/N
bf16-sr            6             2 + 4/N        6/N
=================  ============  =============  ========

The compiled program's own memory statistics (``compiled.memory_analysis()``: arguments,
outputs, temporaries, aliased bytes, and the peak estimate arguments + outputs + temporaries -
aliased) are reported, not checked: on simulated CPU devices XLA emits an all-reduce and a
slice for a reduce-scatter and widens bfloat16 collectives, so the temporaries a GPU would save
do not show here.

    python -m benchmarks.memory                    # the 50M-parameter table, N = 1, 2, 4, 8 (minutes)
    python -m benchmarks.memory --dry-run --out -  # a tiny model, seconds (the tests use it)
    python -m benchmarks.memory --devices 8 --step-time   # + seconds per step of each layout
    python -m benchmarks.memory --gpt2 --devices 8        # GPT-2-small shape vs hand-written ZeRO (minutes)
    python -m benchmarks.memory --lean [--depth 2]        # the lean recipes at GPT-2-small shape, N = 8
    python -m benchmarks.memory --lean --update-cost      # their optimizer update alone: bytes, time

``--gpt2`` compiles a GPT-2-small-shaped Transformer (124.4M params, ``benchmarks/_gpt2.py``;
unrolled for ZeRO, scanned with ``jaxmp.parallel.scan_layers`` for FSDP) with jaxmp's layouts
and with the hand-written ZeRO a user would write (optax + ``NamedSharding`` +
``with_sharding_constraint`` + ``optax.apply_if_finite``; a ``shard_map`` ``psum_scatter`` for
the float32 reduce), and with the hand-written scan-over-layers FSDP (each layer's params
gathered inside the ``lax.scan`` body by ``with_sharding_constraint``, with and without
``jax.checkpoint(policy=nothing_saveable)``; with ``--gpt2-hand-fsdp``), at the same reduce
dtype, and reports temporaries and peak of each, at two per-device batches: 1 x 128 tokens
(every case at every N) and 8 x 512 (`GPT2_LARGE_BATCH_LAYERS` layers; ZeRO at N = 8 only,
jaxmp's FSDP at every N), and prints the markdown table docs/parallel.md quotes (`gpt2_markdown`).

Writes ``benchmarks/results/memory/memory_<device>.json`` (``dry_run.json`` with ``--dry-run``)
with the device, JAX version and git commit. Needs 8 devices: on CPU it sets
``--xla_force_host_platform_device_count=8`` itself when JAX is not yet imported.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks import _common as common, _memory_lean as memory_lean

RECIPES = ("fp32-masters", "remainders", "bf16-sr")
LAYOUTS = ("replicated", "zero", "fsdp")
DEVICE_COUNTS = (1, 2, 4, 8)
#: Bytes per parameter that are replicated / sharded under ``zero`` (params: 2; the rest: state).
STATE_BYTES = {"fp32-masters": 12, "remainders": 10, "bf16-sr": 4}
TOLERANCE = 0.05
# width 2048, depth 12: 12 * 2048**2 = 50.3M weights (+ 24.6K biases).
DEFAULT = dict(width=2048, depth=12, batch_per_device=2)
DRY = dict(width=256, depth=2, batch_per_device=2)


def analytic_bytes_per_param(recipe: str, layout: str, n: int) -> float:
    """The table above: bytes per parameter of params plus optimizer state on one device."""
    state = STATE_BYTES[recipe]
    return {"replicated": 2 + state, "zero": 2 + state / n, "fsdp": (2 + state) / n}[layout]


def _model(width: int, depth: int):
    import jax.numpy as jnp
    import numpy as np

    params = {f"layer{i}": {"w": np.zeros((width, width), jnp.bfloat16), "b": np.zeros((width,), jnp.bfloat16)}
              for i in range(depth)}

    def loss_fn(p, batch):
        h = batch["x"].astype(jnp.bfloat16)
        for i in range(depth):
            h = jnp.tanh(h @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    return params, loss_fn


def _tx(recipe: str):
    import optax

    import jaxmp
    from jaxmp import lean

    from experiments.program import lean_is_stochastic

    return jaxmp.loss_scaling(lean.preset(recipe, optax.adamw(1e-3), key=0 if lean_is_stochastic(recipe) else None),
                              "none")


def measure(recipe: str, layout: str, n: int, width: int, depth: int, batch_per_device: int) -> dict:
    """One row: compile the step on the first ``n`` devices, read the state's bytes per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmp

    params, loss_fn = _model(width, depth)
    tx = _tx(recipe)
    abstract_params = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    mesh = jaxmp.parallel.make_data_mesh(jax.devices()[:n])
    # Donated, as a training loop would: the new state then reuses the old state's buffers.
    step = jaxmp.parallel.make_sharded_train_step(loss_fn, tx, mesh, layout=layout, donate=True)
    batch = {"x": jax.ShapeDtypeStruct((batch_per_device * n, width), jnp.float32)}
    compiled = step.lower(abstract_params, abstract_state, batch).compile()
    (in_shardings, _), = [compiled.input_shardings]

    def per_device(tree, shardings):
        return sum(int(np.prod(s.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
                   for x, s in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(shardings)))

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    param_bytes = per_device(abstract_params, in_shardings[0])
    state_bytes = per_device(abstract_state, in_shardings[1])
    measured = (param_bytes + state_bytes) / n_params
    analytic = analytic_bytes_per_param(recipe, layout, n)
    row = {"recipe": recipe, "layout": layout, "devices": n, "params": n_params,
           "param_bytes_per_device": param_bytes, "opt_state_bytes_per_device": state_bytes,
           "bytes_per_param_measured": measured, "bytes_per_param_analytic": analytic,
           "relative_error": abs(measured - analytic) / analytic}
    mem = compiled.memory_analysis()
    if mem is not None:
        stats = {k: int(getattr(mem, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                   "temp_size_in_bytes", "alias_size_in_bytes",
                                                   "generated_code_size_in_bytes") if hasattr(mem, k)}
        stats["peak_estimate_bytes"] = (stats.get("argument_size_in_bytes", 0) + stats.get("output_size_in_bytes", 0)
                                        + stats.get("temp_size_in_bytes", 0) - stats.get("alias_size_in_bytes", 0))
        if getattr(mem, "peak_memory_in_bytes", None):
            stats["peak_memory_in_bytes"] = int(mem.peak_memory_in_bytes)
        row["compiled"] = stats
    return row


STEP_TIME = dict(width=512, depth=4, batch_per_device=8, rounds=7, steps=5)
STEP_TIME_DRY = dict(width=64, depth=1, batch_per_device=2, rounds=2, steps=1)


def step_times(width: int, depth: int, batch_per_device: int, rounds: int, steps: int, n: int = 8) -> dict:
    """Seconds per step of each layout (fp32-masters, N devices), timed interleaved.

    On simulated CPU devices this is a regression check only: the devices share the host's cores
    and their collectives are memory copies, so it says nothing about a real interconnect.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmp

    params, loss_fn = _model(width, depth)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(np.random.default_rng(0).normal(size=x.shape) * 0.02,
                                                          x.dtype), params)
    tx = _tx("fp32-masters")
    mesh = jaxmp.parallel.make_data_mesh(jax.devices()[:n])
    batch = jaxmp.parallel.make_global_batch(
        {"x": np.random.default_rng(1).normal(size=(batch_per_device * n, width)).astype(np.float32)}, mesh)
    blocks = {}
    for layout in LAYOUTS:
        step = jaxmp.parallel.make_sharded_train_step(loss_fn, tx, mesh, layout=layout, donate=True)
        box = list(jaxmp.parallel.shard_state((params, tx.init(params)), mesh, layout))
        box[0], box[1], m = step(box[0], box[1], batch)   # compile and warm up
        jax.block_until_ready(m)

        def block(step=step, box=box):
            with common.Timer() as t:
                for _ in range(steps):
                    box[0], box[1], m = step(box[0], box[1], batch)
                jax.block_until_ready((box[0], box[1], m))
            return t.seconds / steps

        blocks[layout] = block
    samples = common.time_interleaved(blocks, rounds)
    return {"label": "regression-only (simulated CPU devices)", "devices": n, "width": width, "depth": depth,
            "batch_per_device": batch_per_device, "seconds_per_step": {k: common.summarize(v) for k, v in samples.items()}}


GPT2_ZERO = (
    # (who, layout, reduce_dtype, model, remat): "scan_layers" gathers each layer in the scan
    # body; "scan_gather" is the hand-written FSDP's scan over layers, each layer gathered in
    # the body by a constraint.
    ("hand", "zero", None, "unrolled", None),
    ("jaxmp", "zero", None, "unrolled", None),
    ("hand", "zero", "float32", "unrolled", None),
    ("jaxmp", "zero", "float32", "unrolled", None),
)
GPT2_FSDP = (
    ("jaxmp", "fsdp", "float32", "scan_layers", None),
    ("jaxmp", "fsdp", "float32", "scan_layers", "nothing_saveable"),
)
#: jaxmp's FSDP against the hand-written one at XLA's (bf16) reduce (``--gpt2-hand-fsdp``).
GPT2_HAND_FSDP = (
    ("hand", "fsdp", None, "scan_gather", None),
    ("jaxmp", "fsdp", None, "scan_layers", None),
    ("hand", "fsdp", None, "scan_gather", "nothing_saveable"),
    ("jaxmp", "fsdp", None, "scan_layers", "nothing_saveable"),
)
GPT2_CASES = GPT2_ZERO + GPT2_FSDP + GPT2_HAND_FSDP
#: Per-device batches (sequences x tokens): state dominates the first, activations the second.
GPT2_BATCHES = ((1, 128), (8, 512))
#: Layers compiled at the large batch: 12 on a quiet machine; fewer keeps the compile in minutes
#: on a shared 2-core one (the table says which).
GPT2_LARGE_BATCH_LAYERS = 4


_compiled_stats = memory_lean.compiled_stats


def measure_gpt2(who: str, layout: str, reduce_dtype, model: str, remat, n: int, batch_per_device: int = 1,
                 shape=None) -> dict:
    """One compile-only row of the GPT-2-small-shaped model: jaxmp's step or the hand-written one."""
    import jax
    import optax

    import jaxmp
    from benchmarks import _gpt2
    from jaxmp import lean

    shape = _gpt2.GPT2_SMALL if shape is None else shape
    scanned = model != "unrolled"
    params = _gpt2.abstract_params(shape, scanned)
    mesh = jaxmp.parallel.make_data_mesh(jax.devices()[:n])
    batch = _gpt2.abstract_batch(shape, batch_per_device * n)
    loss = _gpt2.loss_fn(shape, scanned, per_layer=model == "scan_layers")
    if who == "hand":
        gathered = None
        if model == "scan_gather":
            policy = None if remat is None else getattr(jax.checkpoint_policies, remat)
            gathered = _gpt2.loss_fn(shape, True, layer_params=_gpt2.layer_gather(mesh), remat=policy)
        jitted, (p, m, o) = _gpt2.hand_written_step(loss, params, mesh, layout, reduce_dtype, gathered_loss=gathered)
        compiled = jitted.lower(p, m, o, batch).compile()
    else:
        tx = jaxmp.loss_scaling(lean.preset("fp32-masters", optax.adamw(1e-3)), "none")
        step = jaxmp.parallel.make_sharded_train_step(loss, tx, mesh, layout=layout, donate=True,
                                                      reduce_dtype=reduce_dtype, remat=remat)
        p, o = jaxmp.parallel.abstract_state((params, jax.eval_shape(tx.init, params)), mesh, layout)
        compiled = step.lower(p, o, batch).compile()
    return {"who": who, "layout": layout, "reduce_dtype": reduce_dtype, "model": model, "remat": remat,
            "devices": n, "batch_per_device": batch_per_device, "params": _gpt2.param_count(shape),
            "compiled": _compiled_stats(compiled)}


def _gpt2_table(rows: list[dict]) -> str:
    lines = [f"{'who':<7}{'layout':<7}{'reduce':<9}{'model':<12}{'remat':<18}{'batch':>8}{'L':>3}{'N':>3}"
             f"{'temp MiB':>11}{'peak MiB':>11}"]
    for r in rows:
        c = r["compiled"]
        lines.append(f"{r['who']:<7}{r['layout']:<7}{str(r['reduce_dtype']):<9}{r['model']:<12}"
                     f"{str(r['remat']):<18}{_batch_label(r):>8}{r.get('layers', 12):>3}{r['devices']:>3}"
                     f"{c['temp_size_in_bytes'] / 2**20:>11.1f}{c['peak_estimate_bytes'] / 2**20:>11.1f}")
    return "\n".join(lines)


def _batch_label(row: dict) -> str:
    return f"{row['batch_per_device']}x{row.get('seq', 128)}"


_WHO = {("hand", "zero", None): "hand-written ZeRO (optax + `NamedSharding`)",
        ("hand", "zero", "float32"): "hand-written ZeRO (`shard_map` `psum_scatter`)",
        ("jaxmp", "zero", None): "jaxmp `\"zero\"`", ("jaxmp", "zero", "float32"): "jaxmp `\"zero\"`",
        ("hand", "fsdp", None): "hand-written FSDP (constraint in the scan body)",
        ("jaxmp", "fsdp", None): "jaxmp `\"fsdp\"` + `scan_layers`",
        ("jaxmp", "fsdp", "float32"): "jaxmp `\"fsdp\"` + `scan_layers`"}


def gpt2_markdown(rows: list[dict]) -> str:
    """The GPT-2 rows as the markdown table docs/parallel.md quotes (a test compares the two).

    One line per (who, reduce dtype, remat, batch, layers); the N = 2 and N = 8 temporaries side
    by side where both were compiled, with their ratio, and the N = 8 peak.
    """
    by_key: dict = {}
    for r in rows:
        key = (r["who"], r["layout"], r["reduce_dtype"], r["remat"], _batch_label(r), r.get("layers", 12))
        by_key.setdefault(key, {})[r["devices"]] = r["compiled"]
    lines = ["| per-device batch (layers) | step | reduce | remat | temp MiB N=2 | temp MiB N=8 | N8/N2 "
             "| peak MiB N=8 |", "|---|---|---|---|---|---|---|---|"]
    mib = lambda c, k: f"{c[k] / 2**20:.1f}" if c else "-"  # noqa: E731
    for (who, layout, rd, remat, batch, layers), by_n in by_key.items():
        two, eight = by_n.get(2), by_n.get(8)
        ratio = f"{eight['temp_size_in_bytes'] / two['temp_size_in_bytes']:.2f}" if two and eight else "-"
        lines.append(f"| {batch} ({layers}) | {_WHO[who, layout, rd]} | {'bf16 (XLA)' if rd is None else rd} "
                     f"| {remat or '-'} | {mib(two, 'temp_size_in_bytes')} | {mib(eight, 'temp_size_in_bytes')} "
                     f"| {ratio} | {mib(eight, 'peak_estimate_bytes')} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_common_args(parser, default_out=None)
    parser.add_argument("--recipes", help=f"comma list of {', '.join(RECIPES)} (default all)")
    parser.add_argument("--layouts", help=f"comma list of {', '.join(LAYOUTS)} (default all; with --gpt2: "
                        "only those layouts' rows)")
    parser.add_argument("--devices", help="comma list of device counts (default 1,2,4,8)")
    parser.add_argument("--width", type=int, help="hidden width (default 2048; dry run 256)")
    parser.add_argument("--depth", type=int, help="layers (default 12; dry run 2)")
    parser.add_argument("--update-cost", action="store_true",
                        help="with --lean: the optimizer update alone on 2.1M params, one device: bytes accessed, "
                             "temporaries and CPU time per recipe against float32 AdamW, in one run")
    parser.add_argument("--vocab", type=int, help="with --lean: the vocabulary (default 50304, GPT-2's padded to a "
                        "multiple of 64)")
    parser.add_argument("--gpt2", action="store_true",
                        help="the GPT-2-small-shaped model: jaxmp's layouts against hand-written ZeRO (compile-only)")
    parser.add_argument("--gpt2-hand-fsdp", action="store_true",
                        help="with --gpt2: also the hand-written scan-over-layers FSDP against jaxmp's at XLA's reduce")
    parser.add_argument("--lean", action="store_true",
                        help="the lean recipes at GPT-2-small shape on 8 devices: state bytes per parameter and "
                        "compiled peak per device, replicated / zero / fsdp (compile-only)")
    parser.add_argument("--step-time", action="store_true",
                        help="also time a step of each layout on a small model (regression-only on CPU)")
    return parser


def _table(rows: list[dict]) -> str:
    lines = [f"{'recipe':<14}{'layout':<12}{'N':>3}{'B/param':>10}{'analytic':>10}{'err':>8}"
             f"{'temp MiB':>11}{'peak MiB':>11}"]
    for r in rows:
        c = r.get("compiled", {})
        lines.append(f"{r['recipe']:<14}{r['layout']:<12}{r['devices']:>3}{r['bytes_per_param_measured']:>10.3f}"
                     f"{r['bytes_per_param_analytic']:>10.3f}{r['relative_error']:>8.2%}"
                     f"{c.get('temp_size_in_bytes', 0) / 2**20:>11.1f}{c.get('peak_estimate_bytes', 0) / 2**20:>11.1f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()
    import jax

    if args.lean:
        return _main_lean(args, [int(c) for c in args.devices.split(",")] if args.devices else [8])
    size = dict(DRY if args.dry_run else DEFAULT)
    size.update({k: getattr(args, k) for k in ("width", "depth") if getattr(args, k) is not None})
    recipes = common.parse_choices(args.recipes, RECIPES, "recipe")
    layouts = common.parse_choices(args.layouts, LAYOUTS, "layout")
    counts = [int(c) for c in args.devices.split(",")] if args.devices else list(DEVICE_COUNTS)
    if max(counts) > jax.device_count():
        raise SystemExit(f"--devices asks for {max(counts)} devices, JAX has {jax.device_count()}")
    if any(size["width"] % c for c in counts):
        raise SystemExit(f"--width {size['width']} must be divisible by every device count {counts}")
    if args.gpt2:
        from benchmarks import _gpt2

        import dataclasses

        small = _gpt2.TINY if args.dry_run else _gpt2.GPT2_SMALL
        rows = []
        # The small batch: every case on every N; the large one: zero against the hand-written
        # one at N = 8, and jaxmp's float32 FSDP at every N (its N8/N2 temporaries ratio).
        # --layouts keeps the rows of those layouts only (e.g. zero: its eight compiles).
        cases = [c for c in GPT2_ZERO + GPT2_FSDP + (GPT2_HAND_FSDP if args.gpt2_hand_fsdp else ())
                 if c[1] in layouts]
        plan = [(b, n, case) for b in GPT2_BATCHES[1:] for n in sorted(counts, reverse=True)
                for case in GPT2_ZERO + GPT2_FSDP if case[1] in layouts and (n == max(counts) or case in GPT2_FSDP)]
        plan += [(b, n, case) for b in GPT2_BATCHES[:1] for n in sorted(counts, reverse=True) for case in cases
                 if n == max(counts) or case in GPT2_FSDP]
        env = common.jax_env()
        config = {"shape": str(small), "optimizer": "adamw", "policy": "O2-bf16", "label": "CPU compile-only"}
        out = args.out or str(common.RESULTS_DIR / "memory" / ("gpt2_dry_run.json" if args.dry_run else
                                                               f"gpt2_{common.device_slug(env['device'])}.json"))
        for (per_device, seq), n, case in plan:
            shape = small if per_device == GPT2_BATCHES[0][0] else dataclasses.replace(
                small, seq=min(seq, small.positions),
                layers=small.layers if args.dry_run else GPT2_LARGE_BATCH_LAYERS)
            rows.append(measure_gpt2(*case, n=n, batch_per_device=per_device, shape=shape))
            rows[-1].update(seq=shape.seq, layers=shape.layers)
            common.log(f"gpt2 {case} {per_device}x{shape.seq} L={shape.layers} N={n}: peak "
                       f"{rows[-1]['compiled']['peak_estimate_bytes'] / 2**20:.1f} MiB", args.quiet)
            if out != "-" and len(rows) < len(plan):  # minutes a row: what is done survives an interrupted run
                common.write_json(out, common.make_result("memory_gpt2", env, {**config, "partial": True},
                                                          {"rows": rows}, args.dry_run))
        print(_gpt2_table(rows), flush=True)
        print(gpt2_markdown(rows), flush=True)
        result = common.make_result("memory_gpt2", env, config, {"rows": rows}, args.dry_run)
        common.emit(result, out)
        return result
    rows = []
    for recipe in recipes:
        for layout in layouts:
            for n in counts:
                rows.append(measure(recipe, layout, n, **size))
                common.log(f"{recipe} {layout} N={n}: {rows[-1]['bytes_per_param_measured']:.3f} B/param "
                           f"(analytic {rows[-1]['bytes_per_param_analytic']:.3f})", args.quiet)
    print(_table(rows), flush=True)
    results = {"rows": rows}
    if args.step_time:
        results["step_time"] = step_times(**(STEP_TIME_DRY if args.dry_run else STEP_TIME))
        times = results["step_time"]["seconds_per_step"]
        results["step_time"]["ratio_to_replicated"] = {k: v["median"] / times["replicated"]["median"]
                                                       for k, v in times.items()}
        for k, v in times.items():
            print(f"step time {k:<11} {v['median'] * 1e3:8.2f} ms (IQR {v['iqr'] * 1e3:.2f}), "
                  f"{results['step_time']['ratio_to_replicated'][k]:.2f}x replicated (informational, CPU)")
    result = common.make_result("memory", common.jax_env(), {**size, "optimizer": "adamw", "policy": "O2-bf16",
                                                             "tolerance": TOLERANCE}, results, args.dry_run)
    out = args.out
    if out is None:
        name = "dry_run.json" if args.dry_run else f"memory_{common.device_slug(result['env']['device'])}.json"
        out = str(common.RESULTS_DIR / "memory" / name)
    common.emit(result, out)
    return result


#: The lean table's vocabulary: GPT-2's 50257 padded to a multiple of 64, as nanoGPT trains it.
#: With 50257 rows (odd) the tied embedding splits over 8 devices only on its
#: 768 columns, 96 a device: no whole 256-element block, so its quantized moments stay replicated.
LEAN_VOCAB = 50304


def _main_lean(args, counts: list[int]) -> dict:
    import jax

    from benchmarks import _gpt2

    import dataclasses

    shape = _gpt2.TINY if args.dry_run else dataclasses.replace(_gpt2.GPT2_SMALL, vocab=LEAN_VOCAB)
    if args.depth is not None:  # fewer layers: the compiles of a shared 2-core machine (the table says which)
        shape = dataclasses.replace(shape, layers=args.depth)
    if args.vocab is not None:
        shape = dataclasses.replace(shape, vocab=args.vocab)
    recipes = common.parse_choices(args.recipes, memory_lean.LEAN_RECIPES, "recipe")
    if args.update_cost:
        return _main_update_cost(args, recipes)
    layouts = common.parse_choices(args.layouts, LAYOUTS, "layout")
    n = max(counts)
    if n > jax.device_count():
        raise SystemExit(f"--devices asks for {n} devices, JAX has {jax.device_count()}")
    env = common.jax_env()
    config = {"shape": str(shape), "devices": n, "optimizer": "adamw", "label": "CPU compile-only"}
    out = args.out or str(common.RESULTS_DIR / "memory" / ("lean_dry_run.json" if args.dry_run else
                                                           f"lean_{common.device_slug(env['device'])}.json"))
    rows = []
    for recipe in recipes:
        for layout in layouts:
            rows.append(memory_lean.measure_lean(recipe, layout, n, shape))
            common.log(f"lean {recipe} {layout} N={n}: {rows[-1]['bytes_per_param']:.3f} B/param, peak "
                       f"{rows[-1]['compiled']['peak_estimate_bytes'] / 2**20:.1f} MiB", args.quiet)
            if out != "-":  # a compile a row: what is done survives an interrupted run
                common.write_json(out, common.make_result("memory_lean", env, {**config, "partial": True},
                                                          {"rows": rows}, args.dry_run))
    print(memory_lean.lean_markdown(rows), flush=True)
    result = common.make_result("memory_lean", env, config, {"rows": rows}, args.dry_run)
    common.emit(result, out)
    return result


def _main_update_cost(args, recipes: list[str]) -> dict:
    env = common.jax_env()
    shapes = memory_lean.UPDATE_SHAPES_DRY if args.dry_run else memory_lean.UPDATE_SHAPES
    rounds, calls = (2, 1) if args.dry_run else (7, 5)
    recipes = ["fp32-adamw"] + [r for r in recipes if r != "fp32-adamw"]
    rows = []
    for recipe in recipes:
        rows.append(memory_lean.measure_update(recipe, shapes, rounds, calls))
        common.log(f"update {recipe}: {rows[-1]['bytes_accessed_per_param']:.0f} B/param accessed, "
                   f"{rows[-1]['seconds_per_update'] * 1e3:.2f} ms", args.quiet)
    print(memory_lean.update_markdown(rows), flush=True)
    config = {"shapes": {k: list(v) for k, v in shapes.items()}, "devices": 1, "optimizer": "adamw",
              "rounds": rounds, "calls_per_round": calls, "label": "CPU, one process, one run: read ratios"}
    result = common.make_result("memory_lean", env, config, {"rows": rows}, args.dry_run)
    out = args.out or str(common.RESULTS_DIR / "memory" / ("lean_update_dry_run.json" if args.dry_run else
                                                           f"lean_update_{common.device_slug(env['device'])}.json"))
    common.emit(result, out)
    return result


if __name__ == "__main__":
    main()
