"""``python -m jaxmp.selfcheck``: run jaxmp.autocast's contract on this install and print what holds.

Every check traces a small program and reads the dtypes of its ops (see
`jaxmp.engine._contract`): the composition table (each op class under each JAX
transformation, in both orders) and the constructs (padding masks, O2 state, custom_vjp,
norms). Takes well under a minute on a CPU. Exit code 0 when everything holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    """Runs the checks and prints a report.

    Args:
      argv: command-line arguments (``--markdown`` prints the composition table only).

    Returns:
      The exit code: 0 when every check holds, 1 otherwise.

    Example:
      >>> from jaxmp.selfcheck import main
      >>> callable(main)
      True
    """
    parser = argparse.ArgumentParser(prog="python -m jaxmp.selfcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print the composition table as markdown only")
    parser.add_argument("--policy", default="O1-bf16", help="the autocast preset to check (default O1-bf16)")
    args = parser.parse_args(argv)

    import jax

    from jaxmp.engine._seams import contract, internals, tested
    from jaxmp.engine._seams import resolve_config

    try:
        compute = resolve_config(args.policy, None).compute_dtype
    except (TypeError, ValueError) as e:
        parser.error(f"--policy {args.policy!r}: {e}")
    if compute.itemsize >= 4:
        parser.error(f"--policy {args.policy!r} computes in {compute.name}: the contract is about mixed precision; "
                     "check a half-precision preset such as O1-bf16 or O1-fp16")

    start = time.perf_counter()
    table = contract.composition_table(args.policy)
    if args.markdown:
        print(contract.render_table(table))
        return 0 if all(c.holds for c in table) else 1
    constructs = contract.construct_checks()
    print(f"jaxmp self-check: jax {jax.__version__}, Python {sys.version.split()[0]}, backend "
          f"{jax.default_backend()}, policy {args.policy}")
    status = "newer than every tested version" if tested.is_newer_than_tested(internals.JAX_VERSION) else "tested"
    print(f"tested JAX versions: {tested.describe()} ({status})\n")
    print(contract.render_table(table))
    print()
    for c in constructs:
        print(f"{'holds' if c.holds else 'FAILS'}  {c.name}" + ("" if c.holds else f"  (saw {c.detail})"))
    failed = [c for c in table + constructs if not c.holds]
    print(f"\n{len(table) + len(constructs) - len(failed)} of {len(table) + len(constructs)} checks hold "
          f"({time.perf_counter() - start:.1f} s)")
    for c in failed:
        print(f"FAILS: {c.name} (saw {c.detail})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
