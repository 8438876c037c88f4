"""Folds the gradient unscaling into the optimizer's own reductions (sums of squares, max norms).

`eval_folded` is ``jax.core.eval_jaxpr`` with ``sum((g * inv) ** 2)`` evaluated as
``sum(g ** 2) * inv * inv`` (and max norms likewise); bitwise the same for power-of-two scales.
See docs/design.md#folding-the-unscale-into-reductions.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax import lax

from jaxmp import _jaxpr, _ops

_ZERO = "zero"  # a value known to be all zeros: homogeneous of any degree
_ONE = "one"  # the base of the inverse scale itself

# The op catalogue's: ops of their operand's degree (neg, abs, the reductions), and the reductions
# the unscaling folds out of.
_SAME_DEGREE = _ops.having("fold_same")
_FOLDABLE = _ops.having("fold_into")
_FOLDED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _is_zero_literal(x) -> bool:
    return _jaxpr.is_literal(x) and np.ndim(x.val) == 0 and float(np.asarray(x.val)) == 0.0


def _is_one_literal(x) -> bool:
    return _jaxpr.is_literal(x) and np.ndim(x.val) == 0 and float(np.asarray(x.val)) == 1.0


class _Degrees:
    """Degree of each var in the inverse scale: 0 (independent), k >= 1, _ZERO, or None (not homogeneous)."""

    def __init__(self, jaxpr, scale_vars):
        self.deg: dict = {}
        self.defn: dict = {}
        scale_vars = set(scale_vars)
        for eqn in _jaxpr.equations(jaxpr):
            outs = eqn.outvars
            d = self._eqn_degree(eqn, scale_vars) if len(outs) == 1 else None
            for o in outs:
                self.defn[o] = eqn
                self.deg[o] = d if len(outs) == 1 else (0 if not self._depends(eqn) else None)

    def of(self, atom):
        if _jaxpr.is_literal(atom):
            return 0
        return self.deg.get(atom, 0)  # invars and constvars: independent (the scale itself is handled by div)

    def _depends(self, eqn) -> bool:
        return any(self.of(v) not in (0, _ZERO) for v in eqn.invars)

    def _eqn_degree(self, eqn, scale_vars):
        p, ins = eqn.primitive, eqn.invars
        if p is lax.div_p and len(ins) == 2 and not _jaxpr.is_literal(ins[1]) and ins[1] in scale_vars:
            if _is_one_literal(ins[0]):
                return 1
            d = self.of(ins[0])
            return None if d is None else (_ZERO if d == _ZERO else d + 1)
        degs = [self.of(v) for v in ins]
        if all(d == 0 for d in degs):
            if p is lax.broadcast_in_dim_p and _is_zero_literal(ins[0]):
                return _ZERO
            return 0
        if any(d is None for d in degs):
            return None
        if p is lax.mul_p:
            if _ZERO in degs or any(_is_zero_literal(v) for v in ins):
                return _ZERO
            return degs[0] + degs[1]
        if p is lax.square_p:
            return _ZERO if degs[0] == _ZERO else 2 * degs[0]
        if p is lax.integer_pow_p and eqn.params.get("y", 0) >= 1:
            return _ZERO if degs[0] == _ZERO else eqn.params["y"] * degs[0]
        if p in (lax.add_p, lax.sub_p):
            real = [d for d in degs if d != _ZERO]
            if not real:
                return _ZERO
            return real[0] if all(d == real[0] for d in real) else None
        if p.name in _SAME_DEGREE:
            return degs[0]
        return None


def _foldable(eqn, degs) -> bool:
    if eqn.primitive.name not in _FOLDABLE:
        return False
    d = degs.of(eqn.invars[0])
    return isinstance(d, int) and d >= 1 and np.dtype(eqn.invars[0].aval.dtype) in _FOLDED_DTYPES


def eval_folded(closed: Any, args: Sequence[Any], scale_positions: Sequence[int]) -> list:
    """``jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)`` with the unscaling folded out of reductions.

    Args:
      closed: a ClosedJaxpr whose invars include the loss scale.
      args: its flat arguments.
      scale_positions: indices (into the invars) of the floating loss-scale leaves; vars
        computed as ``1 / scale`` (or ``x / scale``) are the inverse scale.

    Returns:
      The flat outputs, as ``eval_jaxpr`` gives them (reductions folded as the module says).
    """
    jaxpr = closed.jaxpr
    scale_vars = [jaxpr.invars[i] for i in scale_positions]
    if len(scale_vars) != 1:
        return jax.core.eval_jaxpr(jaxpr, closed.consts, *args)
    degs = _Degrees(jaxpr, scale_vars)
    if not any(_foldable(eqn, degs) for eqn in _jaxpr.equations(jaxpr)):
        return jax.core.eval_jaxpr(jaxpr, closed.consts, *args)

    env: dict = {}
    for v, x in zip(jaxpr.constvars, closed.consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    scale = env[scale_vars[0]]
    bases: dict = {}

    def read(a):
        return a.val if _jaxpr.is_literal(a) else env[a]

    def bind(eqn, inputs):
        out = _jaxpr.bind(eqn, inputs)
        return out if eqn.primitive.multiple_results else out[0]

    def base(a):
        """The value of ``a`` with the inverse scale set to one (or _ONE for the inverse itself)."""
        d = degs.of(a)
        if d == 0 or d == _ZERO:
            return read(a)
        if a in bases:
            return bases[a]
        eqn = degs.defn[a]
        p, ins = eqn.primitive, eqn.invars
        if p is lax.div_p:  # 1 / scale, or x / scale
            out = _ONE if _is_one_literal(ins[0]) else base(ins[0])
        elif p is lax.mul_p:
            b0, b1 = base(ins[0]), base(ins[1])
            out = b1 if b0 is _ONE else b0 if b1 is _ONE else bind(eqn, [b0, b1])
        else:
            inputs = [base(v) for v in ins]
            if any(b is _ONE for b in inputs):  # e.g. square(1 / scale): no array to rebuild from
                raise _NotFoldable
            out = bind(eqn, inputs)
        bases[a] = out
        return out

    for eqn in _jaxpr.equations(jaxpr):
        out = None
        if _foldable(eqn, degs):
            try:
                b = base(eqn.invars[0])
                if b is not _ONE:
                    red = bind(eqn, [b])
                    inv = 1.0 / scale.astype(red.dtype)
                    # One factor of inv at a time, never inv**k: for a scale <= 2**-64, inv**2
                    # overflows float32 and 0 * inf would make a zero norm NaN, whereas
                    # (red * inv) * inv stays finite wherever the unfolded result is.
                    out = red
                    for _ in range(degs.of(eqn.invars[0])):
                        out = out * inv
            except _NotFoldable:
                out = None
        if out is None:
            out = bind(eqn, [read(v) for v in eqn.invars])
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, out):
                env[v] = x
        else:
            env[eqn.outvars[0]] = out
    return [read(v) for v in jaxpr.outvars]


class _NotFoldable(Exception):
    pass
