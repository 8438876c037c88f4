"""Fault drill: injects the faults a long training run meets and checks that none costs state.

  python -m experiments.fault_drill                      # the full drill (minutes)
  python -m experiments.fault_drill --short              # the version the tests run (about a minute on 2 cores)
  python -m experiments.fault_drill --only=damage,overflow

It prints one table row per check, each PASS or FAIL, and exits 1 if any failed:

* **nan**: NaN/Inf injected into one example of the first replica's shard in a fraction of
  the steps of a 4-device data-parallel run (O1 and O2-fp16): every faulty step is skipped,
  no leaf of the state changes on a skipped step (0 corrupted leaves) and the replicas stay
  bitwise equal;
* **kill**: a run is SIGKILLed at random points, some of them while a checkpoint is being
  written, and started again each time; every checkpoint it leaves is bitwise equal to the
  same step of an uninterrupted run;
* **damage**: each kind of checkpoint damage (garbled bytes, a flipped bit, a truncated or
  deleted array file, a deleted or emptied manifest or metadata, edited metadata) is detected,
  named, moved aside, and the run resumes from the older intact step and ends bitwise equal
  to an undamaged run; with no intact step it stops with a clear error; resuming under
  another policy or loss-scale mode is refused;
* **overflow**: every loss-scale mode of ``jaxmp.make_loss_scale`` survives N consecutive
  overflows and applies updates again once gradients are finite.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # simulated devices for the data-parallel check (CPU only)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from absl import flags  # noqa: E402

DRILLS = ("nan", "kill", "damage", "overflow")
LOSS_SCALE_MODES = ("dynamic", "torch", "static:1024", "none")

if __name__ == "__main__":
    flags.DEFINE_bool("short", False, "The quick version the tests run: fewer steps, one kill, fewer bit flips.")
    flags.DEFINE_list("only", list(DRILLS), f"Drills to run, any of {', '.join(DRILLS)}.")
    flags.DEFINE_integer("steps", 1000, "Steps of the NaN/Inf injection run.", lower_bound=20)
    flags.DEFINE_float("fault_rate", 0.05, "Fraction of steps with NaN/Inf injected.", lower_bound=0.0,
                       upper_bound=0.5)
    flags.DEFINE_integer("devices", 4, "Simulated devices of the injection run.", lower_bound=1)
    flags.DEFINE_integer("kills", 10, "SIGKILLs of the kill drill (every third one while a save is running).",
                         lower_bound=0)
    flags.DEFINE_integer("bitflips", 10, "Single-bit flips tried by the damage drill.", lower_bound=1)
    flags.DEFINE_integer("overflows", 300, "Consecutive overflowing steps per loss-scale mode.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed of the random fault positions.", lower_bound=0)
    flags.DEFINE_string("workdir", None, "Where the drill's runs go (default: a new temporary directory).")


def format_table(rows: list[dict]) -> str:
    """The drill's rows as an aligned text table."""
    head = ("drill", "check", "result", "verdict")
    cells = [head] + [(r["drill"], r["check"], r["result"], "PASS" if r["ok"] else "FAIL") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line, "| " + " | ".join(c.ljust(w) for c, w in zip(head, widths)) + " |", line]
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(out + [line])


def run_drills(only=DRILLS, *, workdir: str, short: bool = False, steps: int = 1000, fault_rate: float = 0.05,
               devices: int = 4, kills: int = 10, bitflips: int = 10, overflows: int = 300, seed: int = 0) -> list[dict]:
    """Runs the named drills and returns their rows (``drill``, ``check``, ``result``, ``ok``).

    Args:
      only: which of `DRILLS`.
      workdir: scratch directory.
      short: the quick version (100 injection steps, 1 kill, 3 bit flips).
      steps, fault_rate, devices, kills, bitflips, overflows, seed: see ``--help``.
    """
    from experiments import drills

    if short:
        steps, kills, bitflips = min(steps, 100), min(kills, 1), min(bitflips, 3)
    rows = []
    if "overflow" in only:
        rows += [drills.overflow_drill(mode, overflows) for mode in LOSS_SCALE_MODES]
    if "nan" in only:
        for policy in ("O1", "O2-fp16"):
            rows.append(drills.nan_drill(policy, steps, fault_rate, devices, seed))
    if "damage" in only:
        rows += drills.damage_drill(os.path.join(workdir, "damage"), bitflips, seed)
    if "kill" in only and kills:
        rows.append(drills.kill_drill(os.path.join(workdir, "kill"), kills, seed))
    return rows


def main(argv) -> None:
    del argv  # cli.run rejects extra arguments
    import tempfile
    import time

    from absl import logging

    from experiments.validation import UserError

    f = flags.FLAGS
    unknown = sorted(set(f.only) - set(DRILLS))
    if unknown:
        raise UserError(f"--only: unknown drill(s) {', '.join(unknown)}: choose from {', '.join(DRILLS)}.")
    logging.set_verbosity(logging.ERROR)
    workdir = f.workdir or tempfile.mkdtemp(prefix="jaxmp_fault_drill_")
    t0 = time.perf_counter()
    rows = run_drills(f.only, workdir=workdir, short=f.short, steps=f.steps, fault_rate=f.fault_rate,
                      devices=f.devices, kills=f.kills, bitflips=f.bitflips, overflows=f.overflows, seed=f.seed)
    print(format_table(rows))
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} checks passed in {time.perf_counter() - t0:.0f} s "
          f"(scratch: {workdir}).")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    from experiments import cli

    cli.run(main, parse=False)
