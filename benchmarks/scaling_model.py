"""Predicted data-parallel efficiency: a model, not a measurement.

For synchronous data parallelism with a fixed per-device batch (weak scaling), every step
pays one gradient all-reduce on top of the single-device step time. With a ring all-reduce
of ``B`` bytes over ``n`` devices on links of bandwidth ``bw`` and per-hop latency ``alpha``:

    T_comm(n)  = 2 (n - 1) / n * B / bw  +  2 (n - 1) * alpha
    T_hidden   = min(overlap * T_comm, T_compute)        # all-reduce run behind the backward pass
    T_step(n)  = T_compute + T_comm(n) - T_hidden
    efficiency = T_compute / T_step(n)       speed-up = n * efficiency

``B`` is ``params * 4`` for a float32 all-reduce and ``params * 2`` for a float16/bfloat16
one (``jaxmp.parallel.make_pmap_train_step(..., reduce_dtype=jnp.float16)``). The model leaves out
the input pipeline, stragglers, gradient bucketing and hierarchical (NVLink inside a node,
network across nodes) collectives, so it is an upper bound on efficiency for the given link;
pass the bandwidth of the slowest link the ring crosses.

Defaults (override them with your own measurements):

* ResNet-50, 25.6M params, step 0.268 s: 2 V100s with Apex AMP O2, 208 images per GPU took
  20h36m51s for 90 epochs of ImageNet's 1.281M images (NVIDIA's data-parallel ResNet-50 study), i.e. 777
  images/s per GPU; 208 / 777 = 0.268 s per step (that includes their input pipeline).
* WRN-28-10, 36.5M params, step 0.067 s: an estimate, not a measurement: 5.25 GFLOP per
  32x32 image forward, x3 for forward+backward, 128 images per device, at 30 TFLOP/s
  achieved in half precision on a V100.
* 12.5 GB/s per link (100 Gb/s EDR InfiniBand between nodes), 5 us per hop, overlap 0.5.

Usage::

    python -m benchmarks.scaling_model
    python -m benchmarks.scaling_model --step-time resnet50=0.15 --bandwidth-gbs 100 --overlap 0.8
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple, Sequence


class Model(NamedTuple):
    """A network to predict for: name, parameter count, single-device step time (s)."""

    name: str
    params: float
    step_time_s: float


MODELS = {
    "resnet50": Model("ResNet-50", 25.6e6, 0.268),
    "wrn28_10": Model("WRN-28-10", 36.5e6, 0.067),
}
DEVICE_COUNTS = (8, 64, 512)
REDUCE_BYTES = (("fp32", 4), ("half", 2))


def ring_allreduce_time(num_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of ``num_bytes`` over ``n`` devices.

    Args:
      num_bytes: size of the gradient buffer.
      n: devices in the ring.
      bandwidth: bytes per second of each link.
      latency: seconds per hop (there are ``2 (n - 1)`` sequential hops).

    Returns:
      ``2 (n-1)/n * num_bytes / bandwidth + 2 (n-1) * latency`` (0 for one device).

    Example:
      >>> ring_allreduce_time(1e9, 2, 1e9, 0.0)
      1.0
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * num_bytes / bandwidth + 2 * (n - 1) * latency


def efficiency(step_time: float, comm_time: float, overlap: float) -> float:
    """Data-parallel efficiency ``T_compute / T_step`` with a fraction of the all-reduce hidden.

    Args:
      step_time: single-device step time (s).
      comm_time: all-reduce time (s).
      overlap: fraction of the all-reduce that runs behind compute, in [0, 1]; at most the
        whole compute time can hide it.

    Returns:
      A number in (0, 1].

    Example:
      >>> efficiency(1.0, 1.0, 0.0)
      0.5
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    hidden = min(overlap * comm_time, step_time)
    return step_time / (step_time + comm_time - hidden)


def table(models: Sequence[Model], device_counts: Sequence[int], bandwidth_gbs: float, latency_us: float,
          overlap: float) -> list[dict]:
    """Rows of the prediction: one per model, device count and all-reduce dtype.

    Args:
      models: the networks.
      device_counts: data-parallel sizes.
      bandwidth_gbs: link bandwidth in GB/s (1e9 bytes/s).
      latency_us: per-hop latency in microseconds.
      overlap: as in :func:`efficiency`.

    Returns:
      A list of dicts with model, devices, dtype, MB, comm_ms, step_ms, eff_no_overlap, eff, speedup.

    Example:
      >>> rows = table([MODELS["resnet50"]], [8], 12.5, 5.0, 0.5)
      >>> [r["dtype"] for r in rows]
      ['fp32', 'half']
    """
    rows = []
    for m in models:
        for n in device_counts:
            for dtype, nbytes in REDUCE_BYTES:
                size = m.params * nbytes
                comm = ring_allreduce_time(size, n, bandwidth_gbs * 1e9, latency_us * 1e-6)
                eff = efficiency(m.step_time_s, comm, overlap)
                rows.append({
                    "model": m.name, "devices": n, "dtype": dtype, "MB": size / 1e6, "comm_ms": comm * 1e3,
                    "step_ms": m.step_time_s / eff * 1e3, "eff_no_overlap": efficiency(m.step_time_s, comm, 0.0),
                    "eff": eff, "speedup": n * eff,
                })
    return rows


def format_table(rows: list[dict], overlap: float) -> str:
    """A fixed-width text table of :func:`table`'s rows.

    Args:
      rows: from :func:`table`.
      overlap: the overlap used (for the column title).

    Returns:
      The table as a string.

    Example:
      >>> print(format_table(table([MODELS["resnet50"]], [8], 12.5, 5.0, 0.5), 0.5).splitlines()[0].split()[:3])
      ['model', 'devices', 'allreduce']
    """
    head = (f"{'model':<10} {'devices':>7} {'allreduce':>9} {'grad MB':>8} {'comm ms':>8} {'step ms':>8} "
            f"{'eff(ov=0)':>9} {f'eff(ov={overlap:g})':>11} {'speed-up':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<10} {r['devices']:>7d} {r['dtype']:>9} {r['MB']:>8.1f} {r['comm_ms']:>8.1f} "
                     f"{r['step_ms']:>8.1f} {r['eff_no_overlap']:>9.1%} {r['eff']:>11.1%} {r['speedup']:>8.1f}")
    return "\n".join(lines)


def _parse_step_times(items: Sequence[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in MODELS:
            raise SystemExit(f"--step-time expects MODEL=SECONDS with MODEL in {sorted(MODELS)}, got {item!r}")
        try:
            out[key] = float(value)
        except ValueError:
            raise SystemExit(f"--step-time {item!r}: {value!r} is not a number") from None
        if out[key] <= 0:
            raise SystemExit(f"--step-time {item!r}: the step time must be > 0")
    return out


def main(argv: Sequence[str] | None = None) -> str:
    """Prints the model's inputs and the table; returns the printed text."""
    parser = argparse.ArgumentParser(description="Predicted data-parallel efficiency (a model, not a measurement).")
    parser.add_argument("--step-time", action="append", default=[], metavar="MODEL=SECONDS",
                        help=f"measured single-device step time, MODEL in {sorted(MODELS)} (repeatable)")
    parser.add_argument("--bandwidth-gbs", type=float, default=12.5, help="link bandwidth, GB/s (default 12.5)")
    parser.add_argument("--latency-us", type=float, default=5.0, help="per-hop latency, us (default 5)")
    parser.add_argument("--overlap", type=float, default=0.5, help="fraction of the all-reduce hidden behind compute")
    parser.add_argument("--devices", type=int, nargs="+", default=list(DEVICE_COUNTS))
    args = parser.parse_args(argv)
    if args.bandwidth_gbs <= 0 or args.latency_us < 0:
        raise SystemExit("--bandwidth-gbs must be > 0 and --latency-us >= 0")
    if not 0 <= args.overlap <= 1:
        raise SystemExit("--overlap must be in [0, 1]")
    times = _parse_step_times(args.step_time)
    models = [m._replace(step_time_s=times.get(k, m.step_time_s)) for k, m in MODELS.items()]
    inputs = [
        "Data-parallel scaling MODEL (ring all-reduce; not a measurement). Inputs:",
        *[f"  {m.name}: {m.params / 1e6:.1f}M params, single-device step {m.step_time_s * 1e3:.0f} ms" for m in models],
        f"  link bandwidth {args.bandwidth_gbs:g} GB/s, latency {args.latency_us:g} us/hop, overlap {args.overlap:g}",
        "  T_comm = 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency",
        "  fp32 = 4 bytes/param, half = 2",
        "",
    ]
    text = "\n".join(inputs) + format_table(table(models, args.devices, args.bandwidth_gbs, args.latency_us,
                                                      args.overlap), args.overlap)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
