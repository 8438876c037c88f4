"""Fidelity of the quantized collectives (``gather_bits``, ``reduce_bits``; issue 63) on 8 simulated CPU devices.

Trains the wire tests' MLP (tests/_support/_wire.py: 30 steps of AdamW with a float32 master, a
NaN planted in one device's shard at step 10) under ZeRO and FSDP with each option, and prints,
per layout and option, the final loss's relative distance from the unquantized run, whether the
skips and loss scales are the same, and whether a second run gives the same bits. The numbers
docs/parallel.md#precision-on-the-wire quotes. Wire bytes are not measured here.

Usage: ``python -m benchmarks.wire_fidelity`` (a minute or two on 2 CPU cores).

``--study``: the issue's fidelity study instead (``benchmarks/_wire_study.py``): the small LM and
the MNIST-1D CNN under ZeRO and FSDP (``--layouts``), 3 seeds, each option against the unquantized sharded run, judged by
benchmarks/fidelity.py's tolerance (``max(seed spread, 1% of the mean)`` of the unquantized
run's final eval loss); writes ``benchmarks/results/wire_fidelity.json`` and prints the table
docs/parallel.md quotes (about 30 minutes for both layouts on 2 busy CPU cores). ``--study --quick``: tiny models,
4 steps, 2 seeds, two options (seconds; the tests use it).
"""

from __future__ import annotations

import argparse
import os
import sys

OPTIONS = ((8, None), (None, 8), (None, 4), (8, 4))


def main(argv: list[str] | None = None) -> int:
    """Runs the table and prints it.

    Args:
      argv: command-line arguments (``--layouts``).

    Returns:
      The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=None, help="comma-separated layouts (default zero,fsdp)")
    parser.add_argument("--study", action="store_true", help="the LM and MNIST-1D CNN study, 3 seeds (JSON + table)")
    parser.add_argument("--quick", action="store_true", help="with --study: tiny models, 4 steps, 2 seeds")
    parser.add_argument("--models", default="lm,cnn", help="with --study: comma-separated models (lm, cnn)")
    parser.add_argument("--out", default=None, help="with --study: the JSON path ('-': none; default "
                        "benchmarks/results/wire_fidelity.json, --quick: dry_run/wire_fidelity.json)")
    args = parser.parse_args(argv)
    if "jax" not in sys.modules:  # 8 CPU devices, set before JAX starts its backend
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    if args.study:
        study(args)
        return 0
    args.layouts = args.layouts or "zero,fsdp"
    import numpy as np

    from tests._support import _wire

    print("| layout | gather_bits | reduce_bits | final loss vs unquantized | same skips and scales | same bits again |")
    print("|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        base = _wire.run(layout)
        for gather_bits, reduce_bits in OPTIONS:
            run = _wire.run(layout, gather_bits, reduce_bits)
            again = _wire.run(layout, gather_bits, reduce_bits, repeat=1)
            rel = abs(run["loss"][-1] - base["loss"][-1]) / base["loss"][-1]
            same = run["finite"] == base["finite"] and run["scale"] == base["scale"]
            bits = run["final"] == again["final"] and np.array_equal(run["loss"], again["loss"], equal_nan=True)
            print(f"| {layout} | {gather_bits} | {reduce_bits} | {100 * rel:.2f}% | {same} | {bits} |")
    return 0


def study(args) -> dict:
    """``--study``: runs `benchmarks._wire_study.study`, prints its table and writes the JSON.

    Args:
      args: the parsed flags (``quick``, ``models``, ``layouts``, ``out``).

    Returns:
      The result written (``benchmarks/_common.make_result``'s envelope).
    """
    import jax

    from benchmarks import _common as common, _wire_study as ws

    models = common.parse_choices(args.models, ("lm", "cnn"), "model")
    layouts = common.parse_choices(args.layouts or "zero,fsdp", ("zero", "fsdp"), "layout")
    options = [ws.REFERENCE, "gather 8 + reduce 4"] if args.quick else list(ws.OPTIONS)
    seeds = [0, 1] if args.quick else [0, 1, 2]
    with jax.numpy_dtype_promotion("standard"):  # optax's AdamW: Python float ** int32 count
        results = ws.study(models, layouts, options, seeds, args.quick, log=lambda m: print(m, flush=True))
    print(ws.markdown(results), flush=True)
    config = {"devices": ws.N, "layouts": list(layouts), "seeds": seeds, "options": {o: ws.OPTIONS[o] for o in options},
              "verdict_rule": "|mean - mean_ref| <= max(spread_ref (max - min over seeds), 1% of |mean_ref|), "
                              "final eval loss, reference: the unquantized sharded run",
              "recipe": "bf16 params, float32 masters, AdamW (warm-up + cosine to 0), loss_scaling('none')"}
    result = common.make_result("wire_fidelity", common.jax_env(), config, {"models": results}, args.quick)
    out = args.out or str(common.RESULTS_DIR / ("dry_run/wire_fidelity.json" if args.quick else "wire_fidelity.json"))
    common.emit(result, out)
    return result


if __name__ == "__main__":
    sys.exit(main())
