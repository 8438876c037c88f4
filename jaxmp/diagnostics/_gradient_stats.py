"""Gradient range statistics: would these gradients survive float16 at a given loss scale?

Thresholds on ``|g| * scale`` (Micikevicius et al., ICLR 2018, Fig. 3): underflow below
``2**-24``, subnormal below ``2**-14``, overflow above 65504. The suggested static scale is the
largest power of two ``S`` with ``max|g| * S * headroom <= 65504``, clipped to ``[1, 2**24]``.
See docs/diagnostics.md#would-the-gradients-survive-float16.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from jax.typing import ArrayLike

from jaxmp.diagnostics import _format
from jaxmp._typing import PyTree

if TYPE_CHECKING:
    from jaxmp._scaling._loss_scale import LossScale

FP16_MIN_SUBNORMAL = 2.0**-24
FP16_MIN_NORMAL = 2.0**-14
FP16_MAX = 65504.0
MIN_SUGGESTED_SCALE = 1.0
MAX_SUGGESTED_SCALE = 2.0**24


class GroupStats(NamedTuple):
    """Statistics of one parameter group (or of all gradients).

    Attributes:
      name: the group's key path (``"Dense_0"``, ``"params/Conv_0/kernel"``) or ``"all"``.
      size: number of elements.
      zeros: elements exactly zero.
      nonfinite: NaN or infinite elements.
      min_abs: smallest non-zero finite ``|g|`` (nan when there is none).
      max_abs: largest finite ``|g|`` (0.0 when there is none).
      log2_bins: exponents ``e`` of the histogram; bin ``e`` holds ``2**e <= |g| < 2**(e+1)``
        (non-zero finite values only, so ``sum(log2_counts) == size - zeros - nonfinite``).
      log2_counts: counts per bin.
      underflow: elements with ``0 < |g| * loss_scale < 2**-24``.
      subnormal: elements with ``2**-24 <= |g| * loss_scale < 2**-14``.
      overflow: finite elements with ``|g| * loss_scale > 65504``.
    """

    name: str
    size: int
    zeros: int
    nonfinite: int
    min_abs: float
    max_abs: float
    log2_bins: tuple[int, ...]
    log2_counts: tuple[int, ...]
    underflow: int
    subnormal: int
    overflow: int

    @property
    def underflow_fraction(self) -> float:
        return self.underflow / self.size if self.size else 0.0

    @property
    def subnormal_fraction(self) -> float:
        return self.subnormal / self.size if self.size else 0.0

    @property
    def overflow_fraction(self) -> float:
        return self.overflow / self.size if self.size else 0.0

    @property
    def zero_fraction(self) -> float:
        return self.zeros / self.size if self.size else 0.0

    def underflow_at(self, log2_scale: int) -> int:
        """Elements that underflow at loss scale ``2**log2_scale`` (exact, from the histogram)."""
        # |g| * 2**s < 2**-24  <=>  floor(log2|g|) < -24 - s, because -24 - s is an integer.
        return sum(c for e, c in zip(self.log2_bins, self.log2_counts) if e < -24 - log2_scale)


@dataclasses.dataclass(frozen=True)
class GradientStats:
    """What [`gradient_stats`][jaxmp.diagnostics._gradient_stats.gradient_stats] returns.

    Attributes:
      groups: one [`GroupStats`][jaxmp.diagnostics.GroupStats] per parameter group.
      total: the same statistics over all gradients (``name == "all"``).
      loss_scale: the scale the float16 fractions were evaluated at.
      headroom: the factor kept below 65504 by the suggestion.
      suggested_loss_scale: the suggested static loss scale (a power of two).
      suggested_underflow_fraction: fraction of all values that underflow at the suggestion.
    """

    groups: tuple[GroupStats, ...]
    total: GroupStats
    loss_scale: float
    headroom: float
    suggested_loss_scale: float
    suggested_underflow_fraction: float

    def summary(self) -> str:
        """One line for logs."""
        t = self.total
        return (
            f"gradients: {_format.fmt_count(t.size)} values in {len(self.groups)} group(s) at loss scale "
            f"{self.loss_scale:g}: fp16 underflow {_format.fmt_pct(t.underflow_fraction)} (<2^-24), "
            f"subnormal {_format.fmt_pct(t.subnormal_fraction)}, overflow {_format.fmt_pct(t.overflow_fraction)}, "
            f"zeros {_format.fmt_pct(t.zero_fraction)}, non-finite {t.nonfinite}; max|g| {t.max_abs:.3g}; "
            f"suggested static scale 2^{int(math.log2(self.suggested_loss_scale))} "
            f"(underflow {_format.fmt_pct(self.suggested_underflow_fraction)})"
        )

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-serialisable dict (groups as lists of dicts, fractions included)."""

        def group(g: GroupStats) -> dict:
            d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g._asdict().items()}
            d["min_abs"] = None if math.isnan(g.min_abs) else g.min_abs
            d.update(underflow_fraction=g.underflow_fraction, subnormal_fraction=g.subnormal_fraction,
                     overflow_fraction=g.overflow_fraction, zero_fraction=g.zero_fraction)
            return d

        return {
            "loss_scale": self.loss_scale,
            "headroom": self.headroom,
            "suggested_loss_scale": self.suggested_loss_scale,
            "suggested_underflow_fraction": self.suggested_underflow_fraction,
            "total": group(self.total),
            "groups": [group(g) for g in self.groups],
            "summary": self.summary(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Returns [`to_dict`][jaxmp.diagnostics.GradientStats.to_dict] as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def table(self, width: int = _format.WIDTH) -> str:
        """Returns a per-group table (rich if installed, else plain) and the summary line.

        Args:
          width: characters per line the table wraps to.

        Returns:
          The table followed by [`summary`][jaxmp.diagnostics.GradientStats.summary].
        """
        rows = []
        for g in (*self.groups, self.total):
            # the log2 range of the histogram is min|g| and max|g| rounded: not a column of its own
            rows.append([g.name, _format.fmt_count(g.size), _format.fmt_pct(g.zero_fraction), str(g.nonfinite),
                         "-" if math.isnan(g.min_abs) else f"{g.min_abs:.3g}", f"{g.max_abs:.3g}",
                         _format.fmt_pct(g.underflow_fraction), _format.fmt_pct(g.subnormal_fraction),
                         _format.fmt_pct(g.overflow_fraction)])
        title = f"Gradient ranges in float16 at loss scale {self.loss_scale:g}"
        headers = ["group", "size", "zeros", "inf/nan", "min|g|", "max|g|", "underflow", "subnormal", "overflow"]
        return _format.render_table(title, headers, rows, self.summary(), width, compact=True)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str, max_groups: int = 8) -> str:
        """Saves the log2|g| histograms with float16's limits as a PNG.

        One panel for all gradients, then one per group (the first ``max_groups``). Vertical
        lines mark where values underflow, turn subnormal and overflow at `loss_scale`.

        Args:
          path: the output file (``.png``).
          max_groups: at most this many per-group panels.

        Returns:
          ``path``.

        Raises:
          ImportError: matplotlib is not installed.

        Example:
          >>> import os, tempfile, jax.numpy as jnp, jaxmp
          >>> path = os.path.join(tempfile.mkdtemp(), "grads.png")
          >>> jaxmp.gradient_stats({"w": jnp.array([1e-9, 1e-3])}).plot(path) == path
          True
        """
        try:
            # Imported here so that `import jaxmp` never pulls in matplotlib; no pyplot, so no
            # global backend state is touched.
            from matplotlib.figure import Figure
        except ImportError as e:
            raise ImportError("GradientStats.plot needs matplotlib: pip install matplotlib") from e
        panels = [self.total, *self.groups[:max_groups]] if len(self.groups) > 1 else [self.total]
        fig = Figure(figsize=(8, 1.9 * len(panels) + 0.6))
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        shift = math.log2(self.loss_scale)
        lines = ((-24 - shift, "|g|*scale = 2^-24: underflow below", "tab:red"),
                 (-14 - shift, "|g|*scale = 2^-14: subnormal below", "tab:orange"),
                 (math.log2(FP16_MAX) - shift, "|g|*scale = 65504: overflow above", "tab:purple"))
        for ax, g in zip(axes, panels):
            if g.log2_bins:
                ax.bar(g.log2_bins, g.log2_counts, width=0.9, align="edge", color="tab:blue")
            for x, label, color in lines:
                ax.axvline(x, color=color, linestyle="--", linewidth=1, label=label)
            ax.set_yscale("symlog", linthresh=1)
            ax.set_ylabel("count")
            ax.set_title(f"{g.name}: {g.size} values, zeros {_format.fmt_pct(g.zero_fraction)}, underflow "
                         f"{_format.fmt_pct(g.underflow_fraction)}, overflow {_format.fmt_pct(g.overflow_fraction)}",
                         fontsize=9, loc="left")
        axes[0].legend(fontsize=7, loc="upper left")
        axes[-1].set_xlabel(f"log2|g|  (float16 limits drawn for loss scale {self.loss_scale:g}; "
                            f"suggested 2^{int(math.log2(self.suggested_loss_scale))})")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return path


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _path_name(path) -> str:
    return "/".join(_key_name(k) for k in path) or "<root>"


def _as_scale(loss_scale) -> float:
    # Loss-scale objects (jaxmp's, jmp's) carry the scale in `.loss_scale`.
    value = getattr(loss_scale, "loss_scale", loss_scale)
    if isinstance(value, bool):
        raise TypeError(f"loss_scale must be a number, got {value!r}")
    try:
        scale = float(np.asarray(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"loss_scale must be a number or a loss-scale object, got {type(loss_scale).__name__}") from e
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"loss_scale must be positive and finite, got {scale}")
    return scale


def _leaf_stats(x: np.ndarray, scale: float) -> dict:
    a = np.abs(np.asarray(x, dtype=np.float64)).ravel()
    finite = np.isfinite(a)
    nz = finite & (a > 0)
    vals = a[nz]
    scaled = vals * scale
    # frexp is exact: v = m * 2**e with m in [0.5, 1), so floor(log2 v) = e - 1 without rounding.
    exps = np.frexp(vals)[1] - 1
    bins, counts = np.unique(exps, return_counts=True)
    return {
        "size": int(a.size),
        "zeros": int(np.count_nonzero(a == 0)),
        "nonfinite": int(a.size - np.count_nonzero(finite)),
        "min_abs": float(vals.min()) if vals.size else math.nan,
        "max_abs": float(vals.max()) if vals.size else 0.0,
        "hist": Counter(dict(zip(bins.tolist(), counts.tolist()))),
        "underflow": int(np.count_nonzero(scaled < FP16_MIN_SUBNORMAL)),
        "subnormal": int(np.count_nonzero((scaled >= FP16_MIN_SUBNORMAL) & (scaled < FP16_MIN_NORMAL))),
        "overflow": int(np.count_nonzero(scaled > FP16_MAX)),
    }


def _merge(name: str, parts: list[dict]) -> GroupStats:
    hist = Counter()
    for p in parts:
        hist.update(p["hist"])
    bins = tuple(sorted(hist))
    mins = [p["min_abs"] for p in parts if not math.isnan(p["min_abs"])]
    return GroupStats(
        name=name, size=sum(p["size"] for p in parts), zeros=sum(p["zeros"] for p in parts),
        nonfinite=sum(p["nonfinite"] for p in parts), min_abs=min(mins) if mins else math.nan,
        max_abs=max((p["max_abs"] for p in parts), default=0.0),
        log2_bins=bins, log2_counts=tuple(int(hist[b]) for b in bins),
        underflow=sum(p["underflow"] for p in parts), subnormal=sum(p["subnormal"] for p in parts),
        overflow=sum(p["overflow"] for p in parts))


def suggest_loss_scale(max_abs: float, headroom: float = 8.0) -> float:
    """The largest power of two ``S`` in ``[1, 2**24]`` with ``max_abs * S * headroom <= 65504``.

    Args:
      max_abs: the largest finite ``|g|`` of the unscaled gradients.
      headroom: factor to stay below float16's maximum by (>= 1).

    Returns:
      ``S`` as a float; ``2**24`` when ``max_abs`` is 0 (nothing can overflow).

    Raises:
      ValueError: ``max_abs`` is negative or not finite, or ``headroom`` is below 1.
    """
    # A NaN or inf would land on the minimum scale and a headroom of 0 divide by zero, silently or not.
    if not (isinstance(max_abs, (int, float, np.floating, np.integer)) and math.isfinite(max_abs) and max_abs >= 0):
        raise ValueError(f"max_abs must be a finite number >= 0 (the largest finite |g|), got {max_abs!r}")
    if not (isinstance(headroom, (int, float, np.floating, np.integer)) and headroom >= 1):
        raise ValueError(f"headroom must be a number >= 1, got {headroom!r}")
    if max_abs == 0:
        return MAX_SUGGESTED_SCALE
    # frexp: x = m * 2**e, m in [0.5, 1) -> floor(log2 x) = e - 1, exactly.
    exponent = math.frexp(FP16_MAX / (headroom * max_abs))[1] - 1
    return float(min(max(2.0**exponent, MIN_SUGGESTED_SCALE), MAX_SUGGESTED_SCALE))


def gradient_stats(grads: PyTree, loss_scale: ArrayLike | LossScale = 1.0, *, group_by: str = "top",
                   headroom: float = 8.0) -> GradientStats:
    """Histograms log2|g| per parameter group and counts what float16 would lose at ``loss_scale``.

    Gradients are copied to the host one leaf at a time; only floating leaves are looked at.

    Args:
      grads: a pytree of unscaled gradients (e.g. float32 gradients of a float32 run, or what
        the optimizer sees after unscaling).
      loss_scale: the loss scale to evaluate float16's range at: a positive number or a
        loss-scale object with a ``loss_scale`` attribute.
      group_by: ``"top"`` (default): the first level of the tree's key paths where it branches,
        so ``{"params": {"Dense_0": ..., "Dense_1": ...}}`` gives groups ``params/Dense_0`` and
        ``params/Dense_1``; ``"leaf"``: one group per array; ``"all"``: a single group.
      headroom: factor the suggested scale keeps ``max|g| * scale`` below 65504 by (>= 1).

    Returns:
      A [`GradientStats`][jaxmp.diagnostics.GradientStats] with ``.groups``, ``.total``, ``.suggested_loss_scale``,
      ``.summary()``, ``.table()``, ``.to_dict()``, ``.to_json()`` and ``.plot(path)``.

    Raises:
      TypeError: ``loss_scale`` is not a number.
      ValueError: ``grads`` is empty or has no floating leaves, ``loss_scale`` is not positive
        and finite, ``headroom < 1`` or ``group_by`` is unknown.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> stats = jaxmp.gradient_stats({"w": jnp.array([1e-9, 1e-3, 0.0])}, loss_scale=1.0)
      >>> stats.total.underflow, stats.total.zeros  # 1e-9 < 2**-24 ~ 6e-8
      (1, 1)
    """
    scale = _as_scale(loss_scale)
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not headroom >= 1:
        raise ValueError(f"headroom must be a number >= 1, got {headroom!r}")
    if group_by not in ("top", "leaf", "all"):
        raise ValueError(f"group_by must be 'top', 'leaf' or 'all', got {group_by!r}")
    from jaxmp._dtypes import is_floating_array

    leaves, _ = jax.tree_util.tree_flatten_with_path(grads)
    if not leaves:
        raise ValueError("grads is empty: pass the gradient pytree (e.g. from jax.grad)")
    leaves = [(p, x) for p, x in leaves if is_floating_array(x)]
    if not leaves:
        raise ValueError("grads has no floating-point array leaves")

    if group_by == "all":
        depth = 0
    elif group_by == "leaf" or len(leaves) == 1:
        depth = None
    else:
        paths = [p for p, _ in leaves]
        common = 0
        while all(len(p) > common for p in paths) and len({p[common] for p in paths}) == 1:
            common += 1
        depth = common + 1

    grouped: dict[str, list[dict]] = {}
    for path, x in leaves:
        name = "all" if depth == 0 else _path_name(path if depth is None else path[:depth])
        grouped.setdefault(name, []).append(_leaf_stats(np.asarray(jax.device_get(x)), scale))
    groups = tuple(_merge(name, parts) for name, parts in grouped.items())
    total = _merge("all", [p for parts in grouped.values() for p in parts])
    if total.size == 0:
        raise ValueError("grads has no elements (every floating leaf is empty)")
    suggested = suggest_loss_scale(total.max_abs, float(headroom))
    under = total.underflow_at(int(math.log2(suggested))) / total.size
    return GradientStats(groups, total, scale, float(headroom), suggested, under)
