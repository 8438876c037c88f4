"""Top kernels by time of a benchmark run, from a ``jax.profiler`` trace, as a markdown table.

    python -m benchmarks.kernel_profile --models transformer --policies O2-bf16       # GPU
    python -m benchmarks.kernel_profile --dry-run --models resnet50 --policies O1     # CPU, seconds

Runs ``throughput.py --profile`` for the chosen runs (one process each unless ``--dry-run``):
each run is compiled and timed as usual, then ``--profile-steps`` more steps run under
``jax.profiler.trace``; the trace's XLA events (GPU kernels on the device timeline, XLA thunks
on a CPU) are summed per name and the top ``--top`` are written to
``benchmarks/results/profiles/<device>_<model>_b<batch>_<policy>.md`` (``dry_run/profiles/``
for dry runs) together with the share of the traced time each takes.
"""

from __future__ import annotations

# The library (also used by _runs.py) lives in _profile.py; its names stay importable from here.
from benchmarks._profile import markdown, profile_path, top_kernels, trace_steps  # noqa: F401


def main(argv=None):
    """``throughput.py --profile`` with this script's help text."""
    from benchmarks import throughput

    parser = throughput.build_parser()
    parser.description = __doc__.split("\n\n")[0]
    parser.prog = "kernel_profile.py"
    args = parser.parse_args(argv)
    args.profile = True
    return throughput.run_main(args)


if __name__ == "__main__":
    main()
