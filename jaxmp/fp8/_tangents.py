"""Forward-mode rules for the quantized matmuls: each is a ``jax.custom_jvp`` whose tangent map,
transposed by reverse mode, is the quantized backward pass.

JAX gives a function either a custom JVP or a custom VJP, never both, and forward mode
(``jvp``, ``linearize``, ``jacfwd``, ``hessian``) refuses a custom VJP. The quantized matmuls
need both: a forward pass on quantized operands and a backward pass that also quantizes the
incoming cotangent (a nonlinear step no ordinary linear op transposes to). So the tangent map is
written with ordinary ops (each leg's dot on the operands that leg quantizes, so that second
derivatives through them are JAX's own) and one custom piece, `rounded_cotangent`: the identity
on a tangent (or the Hadamard transform's transpose) whose transpose rounds the cotangent to the
gradient format. That piece is a ``lax.custom_linear_solve`` with no constants: the public
primitive whose solve and transpose solve are given separately, with batching, jit, remat and
transposition rules of its own (``jax.custom_derivatives.linear_call`` has no batching rule).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.custom_derivatives import SymbolicZero


def rounded_cotangent(t: jax.Array, transpose: Callable[[jax.Array], jax.Array],
                      forward: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """``forward(t)`` (default: ``t``) as a linear map whose transpose is ``transpose``.

    ``transpose`` is what reverse mode applies to the cotangent (the gradient's rounding): it
    must close over no traced value of the program (only constants), so that no derivative is
    lost through it. ``forward`` is the linear part of ``transpose``, transposed.
    """
    forward = (lambda x: x) if forward is None else forward
    return jax.lax.custom_linear_solve(lambda x: x, t, lambda _, x: forward(x), lambda _, x: transpose(x))


def is_zero(t: Any) -> bool:
    """Whether a tangent given to a ``symbolic_zeros=True`` JVP rule is a symbolic zero."""
    return isinstance(t, SymbolicZero)


def tangent_sum(parts: list, like: jax.Array) -> jax.Array:
    """The sum of a rule's tangent parts (zeros shaped like ``like`` when there are none)."""
    if not parts:
        return jax.numpy.zeros_like(like)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


def straight_through(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``fn(x)`` (a quantize-dequantize, same shape and dtype) whose derivative is the identity.

    The rules pass quantization straight through in the first derivative; the operand copies
    they keep for the tangent map go through this so that a second derivative (``hessian``,
    ``jacfwd`` of a gradient) does too, instead of differentiating a cast to fp8, whose tangent
    is cast to fp8 as well and overflows to NaN.
    """
    f = jax.custom_jvp(fn)
    f.defjvp(lambda primals, tangents: (f(*primals), tangents[0]))
    return f(x)
