"""Fidelity of the quantized collectives (``gather_bits``, ``reduce_bits``; issue 63) on 8 simulated CPU devices.

Trains the wire tests' MLP (tests/_support/_wire.py: 30 steps of AdamW with a float32 master, a
NaN planted in one device's shard at step 10) under ZeRO and FSDP with each option, and prints,
per layout and option, the final loss's relative distance from the unquantized run, whether the
skips and loss scales are the same, and whether a second run gives the same bits. The numbers
docs/parallel.md#precision-on-the-wire quotes. Wire bytes are not measured here.

Usage: ``python benchmarks/wire_fidelity.py`` (a minute or two on 2 CPU cores).
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
    parser.add_argument("--layouts", default="zero,fsdp", help="comma-separated layouts (default zero,fsdp)")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


if __name__ == "__main__":
    sys.exit(main())
