"""Keeps the gradient unscaling out of memory in the optimizer's own reductions (sums of squares, max norms).

The inner chain of :func:`jaxmp.loss_scaling` sees unscaled gradients ``u = g * (1/scale)``.
Elementwise consumers of ``u`` (Adam's moments, the clip's division) fuse the multiply into
their own pass, but a reduction such as ``clip_by_global_norm``'s ``sum(u**2)`` may not: XLA
computes ``u`` once for all its consumers, and on XLA:CPU the YNNPACK reduction takes that
operand from memory, so ``u`` is written out once more and read back (+7% bytes on the
overhead benchmark's MLP). Here the operand of every reduction that is a chain of elementwise
ops on ``g`` and the inverse scale is computed again, privately, from the scaled gradients and
an ``optimization_barrier`` copy of the scale, which XLA cannot identify with the shared ``u``:
the chain then fuses into the reduction's own pass.

The ops are the traced ones, on the same values: the result is bitwise the unfolded one for
any scale, including where a squared *scaled* gradient would leave float32's range. (An
earlier version evaluated ``sum(g**2) / scale**2``, which overflowed to inf there and made
``clip_by_global_norm`` zero the update.) Only float32/float64 reductions are taken;
half-precision arithmetic is left as traced.

:func:`eval_folded` is ``jax.core.eval_jaxpr`` with that rewrite; nothing else changes.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax import lax
from jax.extend.core import Literal

_ZERO = "zero"  # a value known to be all zeros: homogeneous of any degree

_ELEMENTWISE_SAME = {lax.neg_p, lax.abs_p}
_FOLDED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _is_zero_literal(x) -> bool:
    return isinstance(x, Literal) and np.ndim(x.val) == 0 and float(np.asarray(x.val)) == 0.0


def _is_one_literal(x) -> bool:
    return isinstance(x, Literal) and np.ndim(x.val) == 0 and float(np.asarray(x.val)) == 1.0


class _Degrees:
    """Degree of each var in the inverse scale: 0 (independent), k >= 1, _ZERO, or None (not homogeneous)."""

    def __init__(self, jaxpr, scale_vars):
        self.deg: dict = {}
        self.defn: dict = {}
        scale_vars = set(scale_vars)
        for eqn in jaxpr.eqns:
            outs = eqn.outvars
            d = self._eqn_degree(eqn, scale_vars) if len(outs) == 1 else None
            for o in outs:
                self.defn[o] = eqn
                self.deg[o] = d if len(outs) == 1 else (0 if not self._depends(eqn) else None)

    def of(self, atom):
        if isinstance(atom, Literal):
            return 0
        return self.deg.get(atom, 0)  # invars and constvars: independent (the scale itself is handled by div)

    def _depends(self, eqn) -> bool:
        return any(self.of(v) not in (0, _ZERO) for v in eqn.invars)

    def _eqn_degree(self, eqn, scale_vars):
        p, ins = eqn.primitive, eqn.invars
        if p is lax.div_p and len(ins) == 2 and not isinstance(ins[1], Literal) and ins[1] in scale_vars:
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
        if p in _ELEMENTWISE_SAME or p is lax.reduce_sum_p or p is lax.reduce_max_p:
            return degs[0]
        return None


def has_fold(closed: Any, scale_positions: Sequence[int]) -> bool:
    """Whether :func:`eval_folded` would rewrite any reduction of ``closed`` (cheap, no tracing)."""
    jaxpr = closed.jaxpr
    scale_vars = [jaxpr.invars[i] for i in scale_positions]
    if not scale_vars:
        return False
    degs = _Degrees(jaxpr, scale_vars)
    return any(_foldable(eqn, degs) for eqn in jaxpr.eqns)


def _foldable(eqn, degs) -> bool:
    if eqn.primitive not in (lax.reduce_sum_p, lax.reduce_max_p):
        return False
    d = degs.of(eqn.invars[0])
    return isinstance(d, int) and d >= 1 and np.dtype(eqn.invars[0].aval.dtype) in _FOLDED_DTYPES


def eval_folded(closed: Any, args: Sequence[Any], scale_positions: Sequence[int]) -> list:
    """``jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)``, each reduction of the unscaled
    gradients evaluated from the scaled ones in its own pass.

    Args:
      closed: a ClosedJaxpr whose invars include the loss scale.
      args: its flat arguments.
      scale_positions: indices (into the invars) of the floating loss-scale leaves; vars
        computed as ``1 / scale`` (or ``x / scale``) are the inverse scale.

    Returns:
      The flat outputs, the same numbers ``eval_jaxpr`` gives (see the module docstring).
    """
    jaxpr = closed.jaxpr
    scale_vars = [jaxpr.invars[i] for i in scale_positions]
    if len(scale_vars) != 1:
        return jax.core.eval_jaxpr(jaxpr, closed.consts, *args)
    degs = _Degrees(jaxpr, scale_vars)
    if not any(_foldable(eqn, degs) for eqn in jaxpr.eqns):
        return jax.core.eval_jaxpr(jaxpr, closed.consts, *args)

    env: dict = {}
    for v, x in zip(jaxpr.constvars, closed.consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    scale_var = scale_vars[0]
    # The same value, which XLA cannot identify with the scale: the unscaling recomputed from
    # it is not the shared ``g * (1/scale)`` that other consumers read from memory.
    private_scale = lax.optimization_barrier(env[scale_var])
    private: dict = {}

    def read(a):
        return a.val if isinstance(a, Literal) else env[a]

    def bind(eqn, inputs):
        params = eqn.primitive.get_bind_params(eqn.params)
        if isinstance(params, tuple):  # older JAX: (subfuns, params)
            subfuns, params = params
            return eqn.primitive.bind(*subfuns, *inputs, **params)
        return eqn.primitive.bind(*inputs, **params)

    def recompute(a):
        """``a`` computed again from the private scale: the same ops, so the same numbers."""
        if isinstance(a, Literal):
            return a.val
        if a is scale_var:
            return private_scale
        if degs.of(a) in (0, _ZERO):
            return env[a]
        if a not in private:
            eqn = degs.defn[a]
            private[a] = bind(eqn, [recompute(v) for v in eqn.invars])
        return private[a]

    for eqn in jaxpr.eqns:
        if _foldable(eqn, degs):
            out = bind(eqn, [recompute(eqn.invars[0])])
        else:
            out = bind(eqn, [read(v) for v in eqn.invars])
        if eqn.primitive.multiple_results:
            for v, x in zip(eqn.outvars, out):
                env[v] = x
        else:
            env[eqn.outvars[0]] = out
    return [read(v) for v in jaxpr.outvars]
