"""Wire bytes per step per device of the sharded layouts at GPT-2-small width: compile-only, 8 simulated devices.

    python -m benchmarks.wire                 # the table: GPT-2 small width, 2 and 3 layers compiled (minutes)
    python -m benchmarks.wire --quick --out - # a tiny model, one depth, ZeRO and the hand-written reference (seconds)

For each layout (``replicated``, ``zero``, ``fsdp``), weight-gather option (bf16 params gathered as
bf16; 8-bit blockwise gathers) and gradient-reduction option (float32, bf16, 8-bit, 4-bit),
`jaxmp.parallel.make_sharded_train_step` (O2-bf16 params, float32 masters, AdamW under
``jaxmp.loss_scaling``) is lowered and compiled on 8 simulated CPU devices (nothing runs) and
``benchmarks/_wire_bytes.py`` reads every collective of the partitioned program: the bytes one
device sends per step under the ring algorithms, and the raw buffer bytes (that module's docstring
defines both). An option this build of jaxmp lacks (read from the step's signature) is listed as
"not available in this build", never estimated. A hand-written ZeRO step (optax + ``NamedSharding``:
XLA gathers the float32 masters) is the reference a user would otherwise write.

The model is ``benchmarks/_gpt2.py``'s at GPT-2-small width (d 768, 12 heads, vocabulary 50257,
tied embedding; 16 tokens, one sequence per device: the wire bytes do not depend on the batch),
unrolled for ``replicated`` and ``zero``, scanned with ``jaxmp.parallel.scan_layers`` for
``fsdp``. Compiled at 2 and 3 layers, each (kind, dtype) figure is split into a per-layer and a
non-layer part (bytes(L) = non_layer + L x per_layer, exact: every layer is the same), and the
table states them and their sum at 12 layers.

Collectives that only the CPU program has are counted apart and left out of the totals: jaxmp's
loss-scaling skip flattens the gradient matrices on XLA:CPU only (``jaxmp/_cpu_layout.py``, a
layout workaround), and a matrix sharded along its columns must be gathered to be flattened.

``predict`` turns the table into a GPU prediction (printed as "predicted, not measured"): the
seconds per step one device spends sending its bytes at a stated link bandwidth, with no overlap
with compute, for GPT-2 small and a 1B model (the per-parameter bytes of the table scaled).

Writes ``benchmarks/results/wire.json`` (jax version, commit, machine and command) and prints the
markdown table docs/parallel.md quotes ("Wire bytes").
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
from typing import Any

from benchmarks import _common as common

LAYOUTS = ("replicated", "zero", "fsdp")
#: Gather option -> the step's keywords (bf16: today's gathers, the params' own dtype).
GATHERS = {"bf16": {}, "8-bit": {"gather_bits": 8}}
#: Gradient-reduction option -> the step's keywords.
REDUCES = {"float32": {"reduce_dtype": "float32"}, "bf16": {"reduce_dtype": "bfloat16"},
           "8-bit": {"reduce_bits": 8}, "4-bit": {"reduce_bits": 4}}
#: The headline's reference: ZeRO with bf16 gathers and a float32 reduction (jaxmp's default).
REFERENCE = ("jaxmp", "zero", "bf16", "float32")
#: Layers compiled (two depths give the per-layer split) and the depth the totals are stated at.
#: Two and three, not one and two: a stacked (scanned) bias of one layer, (1, 768), is under the
#: step's min_shard_size and stays replicated (all-reduced), two layers' (2, 768) are sharded.
LAYERS, TARGET_LAYERS = (2, 3), 12
SEQ = 16
QUICK_LAYERS = (1,)
#: The stack frame that marks a collective of the CPU-only layout workaround.
CPU_ONLY_FRAME = "_cpu_layout.py:"
#: Link bandwidths of the GPU prediction, bytes per second one GPU sends. NVLink 4 (H100/H200 SXM):
#: 18 links, 900 GB/s bidirectional per GPU (https://www.nvidia.com/en-us/data-center/nvlink/),
#: so 450 GB/s each way; a 400 Gb/s NIC per GPU (NDR InfiniBand, ConnectX-7): 50 GB/s each way.
LINKS = {"NVLink 4, 450 GB/s each way": 450e9, "400 Gb/s inter-node link, 50 GB/s": 50e9}
#: Parameter counts of the prediction: GPT-2 small (this table's model at 12 layers,
#: ``_gpt2.param_count(GPT2_SMALL)``) and 1B.
MODELS = {"GPT-2 small (124.4M)": 124_439_808, "1B": 1e9}
NOT_AVAILABLE = "not available in this build"


class NotLinearInLayers(RuntimeError):
    """The two compiled depths do not split into per-layer and non-layer bytes."""


class Refused(Exception):
    """The step refused the row's options (a ValueError or TypeError of its builder or lowering)."""


def step_options() -> set[str]:
    """The keywords this build's ``make_sharded_train_step`` takes."""
    import jaxmp

    return set(inspect.signature(jaxmp.parallel.make_sharded_train_step).parameters)


def plan(layouts=LAYOUTS) -> list[dict]:
    """Every row of the table: (who, layout, gather, reduce) and the keywords each needs."""
    rows = [{"who": "hand", "layout": "zero", "gather": "f32 masters", "reduce": "bf16 (XLA)", "kwargs": {}}]
    for layout in layouts:
        for gather, gkw in (GATHERS.items() if layout != "replicated" else [("-", {})]):
            # The replicated layout gathers nothing and all-reduces whole gradients: the step refuses
            # the quantized options there (a ValueError), so they are no rows of the table.
            for reduce, rkw in (REDUCES.items() if layout != "replicated" else list(REDUCES.items())[:2]):
                rows.append({"who": "jaxmp", "layout": layout, "gather": gather, "reduce": reduce,
                             "kwargs": {**gkw, **rkw}})
    return rows


def _shape(quick: bool, layers: int):
    from benchmarks import _gpt2

    base = dataclasses.replace(_gpt2.TINY, width=64, heads=2, vocab=256, seq=8) if quick else \
        dataclasses.replace(_gpt2.GPT2_SMALL, seq=SEQ)
    return dataclasses.replace(base, layers=layers)


def _breakdown(found: list) -> dict:
    """(kind dtype) -> wire and buffer bytes, the CPU-only collectives apart."""
    out: dict = {"by_kind": {}, "cpu_only": {"wire_bytes": 0.0, "buffer_bytes": 0.0}}
    for c in found:
        cpu_only = any(f.rsplit("/", 1)[-1].startswith(CPU_ONLY_FRAME) for f in c.frames)
        slot = out["cpu_only"] if cpu_only else out["by_kind"].setdefault(f"{c.kind} {c.dtype}", {
            "wire_bytes": 0.0, "buffer_bytes": 0.0})
        slot["wire_bytes"] += c.wire_bytes
        slot["buffer_bytes"] += c.count * c.buffer_bytes
    return out


def lower(row: dict, shape) -> Any:
    """The row's step at ``shape``, lowered with abstract inputs on the 8 devices."""
    import jax
    import optax

    import jaxmp
    from benchmarks import _gpt2
    from jaxmp import lean

    mesh = jaxmp.parallel.make_data_mesh(jax.devices()[:8])
    scanned = row["layout"] == "fsdp"
    params = _gpt2.abstract_params(shape, scanned)
    batch = _gpt2.abstract_batch(shape, 8)
    loss = _gpt2.loss_fn(shape, scanned, per_layer=scanned)
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW: Python float ** int32 count
        if row["who"] == "hand":
            jitted, (p, m, o) = _gpt2.hand_written_step(loss, params, mesh, "zero", None)
            return jitted.lower(p, m, o, batch)
        tx = jaxmp.loss_scaling(lean.preset("fp32-masters", optax.adamw(1e-3)), "none")
        step = jaxmp.parallel.make_sharded_train_step(loss, tx, mesh, layout=row["layout"], donate=True,
                                                      **row["kwargs"])
        p, o = jaxmp.parallel.abstract_state((params, jax.eval_shape(tx.init, params)), mesh, row["layout"])
        return step.lower(p, o, batch)


def _add(a: dict, b: dict, k: float = 1.0) -> dict:
    return {key: a.get(key, 0.0) + k * b.get(key, 0.0) for key in ("wire_bytes", "buffer_bytes")}


def measure(row: dict, quick: bool, layers=LAYERS, target: int = TARGET_LAYERS) -> dict:
    """One row: compile at each depth of ``layers``, split per layer, state the totals at ``target``."""
    from benchmarks import _gpt2, _wire_bytes

    at = {}
    for n in layers:
        try:  # only the step's own refusals: the reader's errors are errors of this benchmark
            lowered = lower(row, _shape(quick, n))
        except (ValueError, TypeError, NotImplementedError) as e:
            raise Refused(f"{type(e).__name__}: {e}"[:500]) from e
        at[n] = _breakdown(_wire_bytes.collectives(_wire_bytes.program_text(lowered)))
    params = {n: _gpt2.param_count(_shape(quick, n)) for n in (*layers, target)}
    keys = sorted({k for b in at.values() for k in b["by_kind"]})
    out = {k: v for k, v in row.items() if k != "kwargs"}
    out.update(status="measured", options=row["kwargs"], layers_compiled=list(layers), layers=target,
               params=params[target], shape=str(_shape(quick, target)))
    if len(layers) == 2:
        lo, hi = layers
        split = lambda a, b: ({k: (b[k] - a[k]) / (hi - lo) for k in a},  # noqa: E731
                              {k: a[k] - lo * (b[k] - a[k]) / (hi - lo) for k in a})
        zero = {"wire_bytes": 0.0, "buffer_bytes": 0.0}
        per_layer, non_layer = {}, {}
        for k in keys:
            per_layer[k], non_layer[k] = split(at[lo]["by_kind"].get(k, zero), at[hi]["by_kind"].get(k, zero))
        cpu_per, cpu_non = split(at[lo]["cpu_only"], at[hi]["cpu_only"])
        negative = [k for k in keys for v in (per_layer[k], non_layer[k]) if min(v.values()) < -1e-6]
        if negative:  # bytes(L) is not non_layer + L x per_layer: the depths differ in more than depth
            raise NotLinearInLayers(f"{row['layout']} gather={row['gather']} reduce={row['reduce']}: {negative} "
                                    f"split into a negative part between {lo} and {hi} layers")
        total = {k: _add(non_layer[k], per_layer[k], target) for k in keys}
        out.update(per_layer=per_layer, non_layer=non_layer, cpu_only_per_layer=cpu_per, cpu_only_non_layer=cpu_non,
                   params_per_layer=params[hi] - params[lo], params_non_layer=params[lo] - lo * (params[hi] - params[lo]))
        cpu_only = _add(cpu_non, cpu_per, target)
    else:  # one depth: the totals at that depth, no split
        (only,) = layers
        out["layers"] = only
        out["params"] = params[only]
        total, cpu_only = at[only]["by_kind"], at[only]["cpu_only"]
    out["by_kind"] = total
    out["cpu_only"] = cpu_only
    wire = lambda kinds: sum(v["wire_bytes"] for k, v in total.items() if k.split()[0] in kinds)  # noqa: E731
    out["gather_wire_bytes"] = wire(("all-gather",))
    out["reduce_wire_bytes"] = wire(("reduce-scatter", "all-reduce", "all-to-all"))
    out["other_wire_bytes"] = wire(("collective-permute",))
    out["wire_bytes"] = sum(v["wire_bytes"] for v in total.values())
    out["buffer_bytes"] = sum(v["buffer_bytes"] for v in total.values())
    out["wire_bytes_per_param"] = out["wire_bytes"] / out["params"]
    return out


def run(rows: list[dict], quick: bool, layers=LAYERS, log=print, save=None) -> list[dict]:
    """Measures every row whose options this build has; the others say so.

    ``save(rows)``, if given, is called after each row (what is done survives an interrupted run).
    """
    have = step_options()
    out: list[dict] = []
    for row in rows:
        missing = sorted(set(row["kwargs"]) - have)
        if missing:
            out.append({**{k: v for k, v in row.items() if k != "kwargs"}, "options": row["kwargs"],
                        "status": NOT_AVAILABLE, "missing": missing})
            log(f"{row['layout']} gather={row['gather']} reduce={row['reduce']}: {NOT_AVAILABLE} ({', '.join(missing)})")
            continue
        try:
            out.append(measure(row, quick, layers))
        except Refused as e:  # an option that refuses this layout
            out.append({**{k: v for k, v in row.items() if k != "kwargs"}, "options": row["kwargs"],
                        "status": "refused", "error": str(e)})
        r = out[-1]
        log(f"{r['who']} {r['layout']} gather={r['gather']} reduce={r['reduce']}: "
            + (f"{r['wire_bytes'] / 1e6:.2f} MB/step/device" if r["status"] == "measured" else r["status"]))
        if save is not None:
            save(out)
    ref = _find(out, *REFERENCE)
    for r in out:
        if r["status"] == "measured" and ref is not None:
            r["vs_reference"] = ref["wire_bytes"] / r["wire_bytes"]
    return out


def _find(rows: list[dict], who: str, layout: str, gather: str, reduce: str) -> dict | None:
    for r in rows:
        if (r["who"], r["layout"], r["gather"], r["reduce"]) == (who, layout, gather, reduce) and r["status"] == "measured":
            return r
    return None


def predict(rows: list[dict], links: dict | None = None, models: dict | None = None) -> list[dict]:
    """Predicted seconds per step on the wire, per measured row, model and link (not measured).

    Each device's bytes per parameter (the row's wire bytes over its parameters) times the model's
    parameters, over the bandwidth one GPU sends at; no overlap with compute, so an upper bound on
    the time the wire adds, and the time saved against the reference row.

    Args:
      rows: :func:`run`'s rows.
      links: name -> bytes per second (default :data:`LINKS`).
      models: name -> parameters (None: the row's own, GPT-2 small; default :data:`MODELS`).

    Returns:
      One dict per (row, model, link): ``seconds``, ``saved_seconds`` against the reference row.

    >>> from benchmarks.wire import predict
    >>> row = {"who": "jaxmp", "layout": "zero", "gather": "bf16", "reduce": "float32", "status": "measured",
    ...        "wire_bytes": 6e8, "params": 1e8}
    >>> predict([row], {"link": 6e9}, {"m": 1e9})[0]["seconds"]
    1.0
    """
    links = LINKS if links is None else links
    models = MODELS if models is None else models
    ref = _find(rows, *REFERENCE)
    out = []
    for r in rows:
        if r["status"] != "measured":
            continue
        for model, n in models.items():
            for link, bw in links.items():
                per_param = r["wire_bytes"] / r["params"]
                seconds = per_param * (r["params"] if n is None else n) / bw
                saved = None if ref is None else ref["wire_bytes"] / ref["params"] * (
                    ref["params"] if n is None else n) / bw - seconds
                out.append({"who": r["who"], "layout": r["layout"], "gather": r["gather"], "reduce": r["reduce"],
                            "model": model, "link": link, "seconds": seconds, "saved_seconds": saved})
    return out


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


_WHO = {"hand": "hand-written ZeRO (optax + `NamedSharding`)"}


def markdown(rows: list[dict]) -> str:
    """The table docs/parallel.md quotes: one line per row, MB (1e6 bytes) per step per device."""
    lines = ["| step | gathers | gradient reduction | gather MB | reduce MB | total MB | per layer MB | non-layer MB "
             "| buffer MB | x fewer than ZeRO bf16/f32 | CPU-only MB (left out) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        who = _WHO.get(r["who"], f"jaxmp `\"{r['layout']}\"`")
        head = f"| {who} | {r['gather']} | {r['reduce']} "
        if r["status"] != "measured":
            lines.append(head + f"| {r['status']} |" + " |" * 7)
            continue
        per = sum(v["wire_bytes"] for v in r["per_layer"].values()) if "per_layer" in r else None
        non = sum(v["wire_bytes"] for v in r["non_layer"].values()) if "non_layer" in r else None
        lines.append(head + f"| {_mb(r['gather_wire_bytes'])} | {_mb(r['reduce_wire_bytes'])} | {_mb(r['wire_bytes'])} "
                     f"| {'-' if per is None else _mb(per)} | {'-' if non is None else _mb(non)} "
                     f"| {_mb(r['buffer_bytes'])} | {r.get('vs_reference', float('nan')):.2f} "
                     f"| {_mb(r['cpu_only']['wire_bytes'])} |")
    return "\n".join(lines)


def prediction_text(pred: list[dict]) -> str:
    """The prediction as printed lines, each labelled "predicted, not measured"."""
    lines = []
    for p in pred:
        saved = "" if p["saved_seconds"] is None else f", saves {p['saved_seconds'] * 1e3:.2f} ms against ZeRO bf16/f32"
        lines.append(f"predicted, not measured: {p['model']}, {p['link']}: {p['who']} {p['layout']} gather={p['gather']} "
                     f"reduce={p['reduce']}: {p['seconds'] * 1e3:.2f} ms/step on the wire{saved}")
    return "\n".join(lines)


def headline(rows: list[dict]) -> str:
    """The measured row with the fewest bytes, against ZeRO with bf16 gathers and a float32 reduction."""
    measured = [r for r in rows if r["status"] == "measured" and "vs_reference" in r]
    if not measured:
        return "headline: no reference row measured"
    best = max(measured, key=lambda r: r["vs_reference"])
    return (f"headline: {best['who']} {best['layout']} gather={best['gather']} reduce={best['reduce']} sends "
            f"{best['vs_reference']:.2f}x fewer bytes per step than ZeRO with bf16 gathers and a float32 reduction "
            f"({best['wire_bytes'] / best['params']:.2f} against "
            f"{best['wire_bytes'] * best['vs_reference'] / best['params']:.2f} bytes a parameter)")


def prediction_markdown(pred: list[dict]) -> str:
    """The prediction as the table docs/parallel.md quotes: ms on the wire per step, per model and link."""
    cols = list(dict.fromkeys((p["model"], p["link"]) for p in pred))
    lines = ["| step | gathers | gradient reduction | " + " | ".join(f"{m}, {link}" for m, link in cols) + " |",
             "|---|---|---|" + "---:|" * len(cols)]
    by_row: dict = {}
    for p in pred:
        by_row.setdefault((p["who"], p["layout"], p["gather"], p["reduce"]), {})[p["model"], p["link"]] = p["seconds"]
    for (who, layout, gather, reduce), secs in by_row.items():
        name = _WHO.get(who, f"jaxmp `\"{layout}\"`")
        lines.append(f"| {name} | {gather} | {reduce} | " + " | ".join(f"{secs[c] * 1e3:.2f}" for c in cols) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = common.script_parser(__doc__)
    parser.add_argument("--quick", dest="dry_run", action="store_true",
                        help="a tiny model (width 64), one depth, the ZeRO rows and the hand-written reference "
                        "(seconds; the tests use it); the same as --dry-run")
    parser.add_argument("--layouts", help=f"comma list of {', '.join(LAYOUTS)} (default all; --quick: zero)")
    parser.add_argument("--layers", help="the depths compiled: two (split per layer, totals at 12; default "
                        f"{','.join(map(str, LAYERS))}) or one (totals at that depth, e.g. 12 to check the split)")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if "jax" not in sys.modules:  # 8 CPU devices, set before JAX starts its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import jax

    if jax.device_count() < 8:
        raise SystemExit(f"the wire table needs 8 devices, JAX has {jax.device_count()}")
    layouts = common.parse_choices(args.layouts or ("zero" if args.dry_run else None), LAYOUTS, "layout")
    layers = tuple(int(n) for n in args.layers.split(",")) if args.layers else QUICK_LAYERS if args.dry_run else LAYERS
    if not 1 <= len(layers) <= 2 or min(layers) < 1 or (len(layers) == 2 and layers[0] >= layers[1]):
        raise SystemExit(f"--layers takes one depth or two increasing ones, got {args.layers!r}")
    config = {"shape": str(_shape(args.dry_run, layers[-1])), "layers_compiled": list(layers),
              "target_layers": layers[0] if len(layers) == 1 else TARGET_LAYERS, "devices": 8,
              "recipe": "O2-bf16 + float32 masters, AdamW, loss_scaling('none')",
              "label": "CPU compile-only; bytes one device sends per step (ring algorithms)",
              "step_options": sorted(step_options()), "links_bytes_per_s": LINKS}
    env = common.jax_env()
    # Another depth than the table's is a check, written beside the dry runs (git-ignored).
    name = "wire.json" if layers == LAYERS and not args.dry_run else f"dry_run/wire_{'_'.join(map(str, layers))}.json"
    out = args.out or str(common.RESULTS_DIR / name)

    def save(rows):
        if out != "-":  # minutes a row at full size: what is done survives an interrupted run
            common.write_json(out, common.make_result("wire", env, {**config, "partial": True},
                                                      {"rows": rows, "prediction": []}, args.dry_run))

    rows = run(plan(layouts), args.dry_run, layers, log=lambda m: common.log(m, args.quiet), save=save)
    pred = predict(rows)
    print(markdown(rows), flush=True)
    print(headline(rows), flush=True)
    print(prediction_text(pred), flush=True)
    print("predicted, not measured (ms per step on the wire):\n" + prediction_markdown(pred), flush=True)
    result = common.make_result("wire", env, config, {"rows": rows, "prediction": pred}, args.dry_run)
    common.emit(result, out)
    return result


if __name__ == "__main__":
    main()
