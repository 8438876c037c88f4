"""Precision report: which matmuls and convolutions of a step run in which dtype.

Read off the jaxpr, so ``jax.ShapeDtypeStruct`` arguments are enough: dtypes, FLOPs and
Tensor-Core eligibility per matmul, risky and missed half-precision ops, an Amdahl bound.
See docs/diagnostics.md#does-the-step-actually-compute-in-half-precision-on-shapes-tensor-cores-like.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmp import _jaxpr
from jaxmp.diagnostics import _format
from jaxmp._typing import PolicyLike
from jaxmp.diagnostics._autocast_ops import AutocastOp, autocast_ops
from jaxmp.diagnostics._find_ops import MatmulOp, RiskyOp, walk_jaxpr


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What [`precision_report`][jaxmp.diagnostics._precision_report.precision_report] returns.

    Attributes:
      ops: every matmul/conv found, in program order.
      risky: half-precision ops that commonly lose range or precision.
      policy: the policy the step was checked against (``str``), or None.
      tensor_core_speedup: assumed speed-up of a Tensor-Core op over float32 (Amdahl input).
      unknown_trip_counts: number of ``while`` loops whose body was counted once.
      tc_multiple: the dimension multiple the Tensor-Core rule asks for.
      decisions: for a step that runs [`jaxmp.autocast`][jaxmp.autocast], every op it emitted with the
        rule that chose its dtype (see [`explain`][jaxmp.diagnostics.PrecisionReport.explain]); empty otherwise.
    """

    ops: tuple[MatmulOp, ...]
    risky: tuple[RiskyOp, ...]
    policy: str | None
    tensor_core_speedup: float
    unknown_trip_counts: int
    tc_multiple: int
    decisions: tuple[AutocastOp, ...] = ()

    # -- totals -------------------------------------------------------------------------------
    @property
    def total_flops(self) -> int:
        """Matmul + conv FLOPs of one call (counted ops only)."""
        return sum(op.flops for op in self.ops if op.counted)

    @property
    def low_precision_flops(self) -> int:
        return sum(op.flops for op in self.ops if op.counted and op.low_precision)

    @property
    def tensor_core_flops(self) -> int:
        return sum(op.flops for op in self.ops if op.counted and op.tensor_core_eligible)

    @property
    def low_precision_share(self) -> float:
        """Fraction of matmul FLOPs whose operands are half precision (0.0 if no FLOPs)."""
        total = self.total_flops
        return self.low_precision_flops / total if total else 0.0

    @property
    def tensor_core_share(self) -> float:
        """Fraction of matmul FLOPs that are Tensor-Core eligible (dtype and shapes)."""
        total = self.total_flops
        return self.tensor_core_flops / total if total else 0.0

    @property
    def amdahl_bound(self) -> float:
        """Speed-up bound from the low-precision share: ``1 / ((1 - p) + p / s)``.

        ``p`` = [`low_precision_share`][jaxmp.diagnostics.PrecisionReport.low_precision_share],
        ``s`` = `tensor_core_speedup`. An upper bound on the matmul part only: it assumes time proportional to FLOPs and ignores everything
        that is not a matmul (data loading, element-wise ops, communication).
        """
        return amdahl(self.low_precision_share, self.tensor_core_speedup)

    @property
    def amdahl_bound_tensor_core(self) -> float:
        """As [`amdahl_bound`][jaxmp.diagnostics.PrecisionReport.amdahl_bound], from the
        Tensor-Core-eligible share (shape rule included)."""
        return amdahl(self.tensor_core_share, self.tensor_core_speedup)

    # -- flagged ops --------------------------------------------------------------------------
    @property
    def shape_ineligible(self) -> tuple[MatmulOp, ...]:
        """Floating ops with a dimension that is not a multiple of `tc_multiple`."""
        return tuple(op for op in self.ops if op.shape_problems)

    @property
    def missed(self) -> tuple[MatmulOp, ...]:
        """Float32 matmuls in a step whose policy asks for half-precision compute."""
        return tuple(op for op in self.ops if op.missed)

    # -- output -------------------------------------------------------------------------------
    def summary(self) -> str:
        """One line for logs, e.g. ``precision: 6 matmul/conv, 1.2 GFLOP, 97.0% low precision ...``."""
        parts = [
            f"precision: {len(self.ops)} matmul/conv, {_format.fmt_count(self.total_flops)}FLOP",
            f"{_format.fmt_pct(self.low_precision_share)} low precision "
            f"({_format.fmt_pct(self.tensor_core_share)} Tensor-Core eligible)",
            f"Amdahl bound {self.amdahl_bound:.2f}x ({self.amdahl_bound_tensor_core:.2f}x eligible) "
            f"at {self.tensor_core_speedup:g}x/op",
            f"{len(self.shape_ineligible)} not multiple-of-{self.tc_multiple}",
            f"{len(self.missed)} missed",
            f"{len(self.risky)} risky" + (f" ({self._risky_names()})" if self.risky else ""),
        ]
        if self.policy:
            parts.append(f"policy {self.policy}")
        if self.unknown_trip_counts:
            parts.append(f"{self.unknown_trip_counts} while loop(s) counted once")
        if self.decisions:
            parts.append(f"{len(self.decisions)} autocast ops")
        return "; ".join(parts)

    def _risky_names(self, most: int = 3) -> str:
        """The risky ops named in the summary: ``"narrowed add in sched, exp in head, 2 more"``."""
        names = [f"{r.category + ' ' if r.category == 'narrowed' else ''}{r.primitive} in {r.name or 'the top level'}"
                 for r in self.risky[:most]]
        more = len(self.risky) - most
        return ", ".join(names + ([f"{more} more"] if more > 0 else []))

    def explain(self, max_rows: int = 60, width: int = 160) -> str:
        """The autocast decisions: each op, its dtypes and the rule that chose them.

        Args:
          max_rows: at most this many rows.
          width: characters per line.

        Returns:
          A text table (empty string when the step does not use [`jaxmp.autocast`][jaxmp.autocast]).
        """
        if not self.decisions:
            return ""
        rows = [[op.primitive, ",".join(op.in_dtypes), ",".join(op.out_dtypes), op.rule, op.name]
                for op in self.decisions[:max_rows]]
        footer = None if len(self.decisions) <= max_rows else f"... {len(self.decisions) - max_rows} more ops"
        return _format.render_table("Autocast decisions", ["op", "in", "out", "rule", "where"], rows, footer, width)

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-serialisable dict: totals, ``ops`` and ``risky`` as lists of dicts."""
        return {
            "policy": self.policy,
            "tensor_core_speedup": self.tensor_core_speedup,
            "tc_multiple": self.tc_multiple,
            "total_flops": self.total_flops,
            "low_precision_flops": self.low_precision_flops,
            "tensor_core_flops": self.tensor_core_flops,
            "low_precision_share": self.low_precision_share,
            "tensor_core_share": self.tensor_core_share,
            "amdahl_bound": self.amdahl_bound,
            "amdahl_bound_tensor_core": self.amdahl_bound_tensor_core,
            "unknown_trip_counts": self.unknown_trip_counts,
            "num_shape_ineligible": len(self.shape_ineligible),
            "num_missed": len(self.missed),
            "num_risky": len(self.risky),
            "ops": [_jsonable(op._asdict()) for op in self.ops],
            "risky": [_jsonable(r._asdict()) for r in self.risky],
            "autocast_decisions": [_jsonable(d._asdict()) for d in self.decisions],
            "summary": self.summary(),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Returns [`to_dict`][jaxmp.diagnostics.PrecisionReport.to_dict] as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def table(self, max_rows: int = 40, width: int = _format.WIDTH) -> str:
        """Returns the report as text tables (rich if installed, else plain).

        Flagged ops (missed, shape problems) come first, then the rest by FLOPs. The matmul
        table has one dtype column (``f16`` where both operands and the accumulation share it,
        else ``lhs,rhs->accumulation``) and the GEMM's ``MxNxK``, not
        the operand shapes, and module paths too long for their column keep their end after
        ``...``: [`to_dict`][jaxmp.diagnostics.PrecisionReport.to_dict] has every field whole.

        Args:
          max_rows: at most this many rows per table; the rest is summarised in one line.
          width: characters per line the tables wrap to (88 by default: a docs page or a
            terminal shows it without scrolling).

        Returns:
          Two tables (matmuls/convs and risky ops) and the summary line.
        """
        order = sorted(range(len(self.ops)), key=lambda i: (
            not (self.ops[i].missed or self.ops[i].shape_problems), -self.ops[i].flops, i))
        rows = []
        for i in order[:max_rows]:
            op = self.ops[i]
            flags = []
            if op.missed:
                flags.append("MISSED (f32 under half policy)")
            if op.shape_problems:
                flags.append("not x%d: %s" % (self.tc_multiple, " ".join(op.shape_problems)))
            if not op.counted:
                flags.append("untaken cond branch")
            gemm = f"{op.m}x{op.n}x{op.k}" + (f" (B={op.batch})" if op.batch > 1 else "")
            rows.append([
                str(i), "dot" if op.primitive == "dot_general" else "conv",
                _dtypes(op), gemm,
                _format.fmt_count(op.flops) + (f" (x{op.calls})" if op.calls > 1 else ""),
                "yes" if op.tensor_core_eligible else "no",
                "; ".join(flags), _where(op, width // 3),
            ])
        footer = None if len(order) <= max_rows else f"... {len(order) - max_rows} more ops"
        out = [_format.render_table(
            "Matmuls and convolutions", ["#", "op", "dtypes", "MxNxK", "FLOPs", "TC", "flags", "where"],
            rows, footer, width, compact=True)]
        if self.risky:
            rrows = [[r.primitive, _shape(r.dtype, r.shape), r.detail, _where(r, width // 3)]
                     for r in self.risky[:max_rows]]
            footer = None if len(self.risky) <= max_rows else f"... {len(self.risky) - max_rows} more risky ops"
            out.append(_format.render_table("Risky half-precision ops", ["op", "input", "why", "where"],
                                            rrows, footer, width, compact=True))
        if self.decisions:
            out.append(self.explain(max_rows, width))
        out.append(_format.wrap(self.summary(), width))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


def _shape(dtype: str, shape) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def _dtypes(op) -> str:
    dtypes = (op.lhs_dtype, op.rhs_dtype, op.accum_dtype)
    return dtypes[0] if len(set(dtypes)) == 1 else f"{op.lhs_dtype},{op.rhs_dtype}->{op.accum_dtype}"


def _where(op, path_width: int) -> str:
    """The module path (its end, broken at ``/``) over the source line, to fit a narrow column.

    The table shows the file's base name, and the function only where no module path names
    the op; to_dict() keeps every field whole."""
    loc = " | ".join(b for b in (op.context, op.name) if b)
    source = op.source.rsplit("/", 1)[-1]
    if loc:
        source = source.split(" (", 1)[0]   # "file.py:12:20 (CNN.__call__)": the module says it
        loc = _format.fold_path(_format.clip_left(loc, 2 * path_width), path_width)
    return "\n".join(b for b in (loc, source) if b)


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def amdahl(share: float, speedup: float) -> float:
    """Amdahl's law: overall speed-up when a ``share`` of the time gets ``speedup`` times faster.

    Args:
      share: fraction of the time that is accelerated, in [0, 1].
      speedup: how much faster that fraction gets (> 0).

    Returns:
      ``1 / ((1 - share) + share / speedup)``.
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    if not speedup > 0:
        raise ValueError(f"speedup must be positive, got {speedup}")
    return 1.0 / ((1.0 - share) + share / speedup)




def analyze_jaxpr(closed_jaxpr, *, policy: PolicyLike | None = None, tensor_core_speedup: float = 8.0,
                  tc_multiple: int = 8, reduction_threshold: int = 1024,
                  values: Sequence[jax.Array] | None = None) -> PrecisionReport:
    """Builds a [`PrecisionReport`][jaxmp.diagnostics.PrecisionReport] from an already traced jaxpr.

    Args:
      closed_jaxpr: a ``ClosedJaxpr`` (``jax.make_jaxpr(f)(*args)``) or a ``Jaxpr``.
      policy: a [`jaxmp.Policy`][jaxmp.Policy], ``jmp.Policy`` or policy string; when its compute dtype
        is half precision, float32 matmuls are reported as *missed*. None: no missed check.
      tensor_core_speedup: assumed speed-up of one Tensor-Core op over float32 (the slides' 8x).
      tc_multiple: the multiple the Tensor-Core shape rule asks for (8 for fp16/bf16; 16 is
        the safer choice for fp8).
      reduction_threshold: half-precision sums over at least this many elements are risky
        (fp16's 11-bit significand: past ~2**10 addends each new term is below the sum's ulp).
      values: the concrete input arrays, one per jaxpr input, or None: a float32 input narrowed
        to half by an elementwise op is then reported with its magnitude and the half ulp there.

    Returns:
      A [`PrecisionReport`][jaxmp.diagnostics.PrecisionReport].
    """
    if _jaxpr.is_jaxpr(closed_jaxpr):
        jaxpr = _jaxpr.open_jaxpr(closed_jaxpr)
    else:
        raise TypeError(f"analyze_jaxpr expects a ClosedJaxpr or Jaxpr, got {type(closed_jaxpr).__name__}")
    if isinstance(tensor_core_speedup, bool) or not isinstance(tensor_core_speedup, (int, float)) \
            or not tensor_core_speedup > 0:
        raise ValueError(f"tensor_core_speedup must be a positive number, got {tensor_core_speedup!r}")
    if isinstance(tc_multiple, bool) or not isinstance(tc_multiple, int) or tc_multiple < 1:
        raise ValueError(f"tc_multiple must be a positive int, got {tc_multiple!r}")
    if isinstance(reduction_threshold, bool) or not isinstance(reduction_threshold, int) or reduction_threshold < 1:
        raise ValueError(f"reduction_threshold must be a positive int, got {reduction_threshold!r}")
    pol = None
    if policy is not None:
        from jaxmp._precision._presets import resolve_policy

        pol = resolve_policy(policy)[0]  # an fp8 preset's name labels the report with its dtypes
    ops, risky, unknown = walk_jaxpr(
        jaxpr, compute_half=pol is not None and _format.is_low_precision(pol.compute_dtype),
        tc_multiple=tc_multiple, reduction_threshold=reduction_threshold, values=values)
    return PrecisionReport(ops, risky, None if pol is None else str(pol), float(tensor_core_speedup),
                           unknown, tc_multiple, autocast_ops(jaxpr))


def precision_report(fn: Callable, *args, policy: PolicyLike | None = None, tensor_core_speedup: float = 8.0,
                     tc_multiple: int = 8, reduction_threshold: int = 1024, **kwargs) -> PrecisionReport:
    """Traces ``fn(*args, **kwargs)`` and reports the precision of every matmul and convolution.

    Nothing is compiled or run: ``fn`` is traced to a jaxpr (for a ``jax.jit``-wrapped function
    through ``fn.trace``, so its ``static_argnums`` are honoured), so arguments may be
    ``jax.ShapeDtypeStruct`` placeholders and no GPU is needed.

    Args:
      fn: the function to inspect, typically a (jitted) train step. A ``ClosedJaxpr`` is
        accepted too.
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      policy: the mixed-precision policy the step is meant to follow ([`jaxmp.Policy`][jaxmp.Policy],
        ``jmp.Policy`` or a string such as ``"O2"``); enables the *missed* check.
      tensor_core_speedup: assumed per-op speed-up of Tensor Cores over float32, the input of
        the Amdahl bound (8x, from NVIDIA's Volta figures).
      tc_multiple: the multiple the Tensor-Core shape rule asks for.
      reduction_threshold: element count from which a half-precision sum is risky.
      **kwargs: keyword arguments of ``fn`` (names above are taken by this function).

    Returns:
      A [`PrecisionReport`][jaxmp.diagnostics.PrecisionReport]: ``.table()`` / ``str()``, ``.summary()``, ``.to_dict()``,
      ``.to_json()``, and the totals as properties.

    Raises:
      TypeError: ``fn`` is not callable.
      ValueError: a non-positive ``tensor_core_speedup``, ``tc_multiple`` or ``reduction_threshold``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> x = jax.ShapeDtypeStruct((64, 30), jnp.float16)
      >>> w = jax.ShapeDtypeStruct((30, 64), jnp.float16)
      >>> rep = jaxmp.precision_report(lambda x, w: x @ w, x, w, policy="O2")
      >>> rep.ops[0].shape_problems, rep.total_flops  # 2 * 64 * 64 * 30
      (('K=30',), 245760)
      >>> print(rep.summary())
      precision: 1 matmul/conv, ...
    """
    if _jaxpr.is_jaxpr(fn):
        jaxpr = fn
    elif not callable(fn):
        raise TypeError(f"precision_report expects a callable (e.g. a train step), got {type(fn).__name__}: {fn!r}")
    else:
        from jaxmp.engine._seams import explaining

        with explaining():  # autocast steps record which rule chose each op's dtype
            jaxpr = fn.trace(*args, **kwargs).jaxpr if hasattr(fn, "trace") else jax.make_jaxpr(fn)(*args, **kwargs)
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    concrete = all(isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, jax.core.Tracer) for x in leaves)
    return analyze_jaxpr(jaxpr, policy=policy, tensor_core_speedup=tensor_core_speedup,
                         tc_multiple=tc_multiple, reduction_threshold=reduction_threshold,
                         values=leaves if concrete and leaves else None)
