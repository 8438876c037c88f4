"""GEMM geometry of ``dot_general`` and ``conv_general_dilated``: M/N/K, FLOPs, Tensor-Core shape rule.

Pure functions of shapes and dimension numbers: FLOPs are ``2 * B * M * N * K`` (a convolution as
its implicit GEMM), and Tensor-Core eligible means multiples of 8. The formulas are in
docs/diagnostics.md#does-the-step-actually-compute-in-half-precision-on-shapes-tensor-cores-like.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence


class Gemm(NamedTuple):
    """The GEMM a matmul-like op amounts to.

    Attributes:
      batch: number of independent GEMMs (dot batch dims; 1 for convolutions).
      m: rows of the output (lhs free size; conv: batch x output spatial).
      n: columns of the output (rhs free size; conv: output channels).
      k: contraction length (conv: input channels per group x kernel spatial size).
      flops: ``2 * batch * m * n * k``.
      tc_dims: the sizes the Tensor-Core rule checks, as ``(label, size)`` pairs.
    """

    batch: int
    m: int
    n: int
    k: int
    flops: int
    tc_dims: tuple[tuple[str, int], ...]


def _prod(xs) -> int:
    return int(math.prod(int(x) for x in xs))


def dot_gemm(lhs_shape: Sequence[int], rhs_shape: Sequence[int], dimension_numbers) -> Gemm:
    """GEMM view of ``lax.dot_general``.

    Args:
      lhs_shape: shape of the left operand.
      rhs_shape: shape of the right operand.
      dimension_numbers: ``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``.

    Returns:
      A `Gemm`; ``tc_dims`` are ``M``, ``N`` and ``K``.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lc, lb, rb, rc = tuple(lc), tuple(lb), tuple(rb), tuple(rc)
    batch = _prod(lhs_shape[d] for d in lb)
    k = _prod(lhs_shape[d] for d in lc)
    m = _prod(s for d, s in enumerate(lhs_shape) if d not in lc and d not in lb)
    n = _prod(s for d, s in enumerate(rhs_shape) if d not in rc and d not in rb)
    return Gemm(batch, m, n, k, 2 * batch * m * n * k, (("M", m), ("N", n), ("K", k)))


def conv_gemm(lhs_shape: Sequence[int], rhs_shape: Sequence[int], out_shape: Sequence[int],
              dimension_numbers, feature_group_count: int = 1, batch_group_count: int = 1) -> Gemm:
    """Implicit-GEMM view of ``lax.conv_general_dilated``.

    Args:
      lhs_shape: input shape.
      rhs_shape: kernel shape.
      out_shape: output shape.
      dimension_numbers: a ``ConvDimensionNumbers`` (``lhs_spec``, ``rhs_spec``, ``out_spec``;
        each spec lists batch/feature dim first, then spatial dims).
      feature_group_count: grouped-convolution count (depthwise: = input channels).
      batch_group_count: batch grouping (appears in weight gradients of grouped convs).

    Returns:
      A `Gemm` with ``batch=1``; ``tc_dims`` are the input and output channels per group.
    """
    rhs_spec, out_spec = dimension_numbers.rhs_spec, dimension_numbers.out_spec
    c_out = int(rhs_shape[rhs_spec[0]])
    c_in_per_group = int(rhs_shape[rhs_spec[1]])
    kernel = _prod(rhs_shape[d] for d in rhs_spec[2:])
    # Each output element is one dot product of length (input channels per group) x kernel.
    m = int(out_shape[out_spec[0]]) * _prod(out_shape[d] for d in out_spec[2:])
    k = c_in_per_group * kernel
    groups = max(int(feature_group_count), 1) * max(int(batch_group_count), 1)
    c_out_per_group = c_out // groups
    return Gemm(1, m, c_out, k, 2 * m * c_out * k,
                (("C_in", c_in_per_group), ("C_out", c_out_per_group)))


def tc_shape_problems(gemm: Gemm, multiple: int = 8) -> tuple[str, ...]:
    """Names the dimensions that break the multiple-of-``multiple`` rule, e.g. ``("K=30",)``."""
    return tuple(f"{label}={size}" for label, size in gemm.tc_dims if size % multiple)
