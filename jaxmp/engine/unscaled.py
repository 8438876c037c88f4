"""A warning for float16 regions differentiated with no loss scale.

float16's smallest subnormal is 6e-8: the gradients of a float16 region flush to zero unless the
loss is multiplied by a loss scale first (often every one of them, with no error). A float16
autocast program passes its floating inputs through an identity with a custom JVP rule
(`watch`); JAX runs the rule only when it differentiates the program, whichever way (``grad``
outside or inside ``jit``, a ``scan`` body), and the rule tags the tangents with `_tap_p`, a
linear identity whose transpose rule runs when the gradient is traced, after the whole forward
pass (the loss included) has been. That rule warns (`jaxmp.traps.unscaled_fp16_grad`) unless
the loss was scaled:

* `jaxmp.value_and_grad` is the one differentiating (nothing is tagged then), or
* a loss scale's ``scale`` ran between the region's forward pass and its backward pass: a loss
  scaled by hand, ``jax.grad(lambda p: scale.scale(loss(p)))`` (`jaxmp.traps.scales_so_far`).

A loss multiplied by a bare number (``loss * 1024.0``) still warns: a constant factor may as well
be a sum-over-mean or a loss weight, and under ``jit`` its value is not known when the gradient
is traced; ``jaxmp.StaticLossScale(1024.0).scale(loss)`` says which it is. Forward-mode use
(``jax.jvp``, ``jax.linearize`` without a transpose) computes no gradient and never warns.
Under ``jit`` the identity and the tag cost nothing; they are installed for float16 only.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Sequence

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxmp import traps
from jaxmp.engine import internals
from jaxmp.engine.values import dtype_of, is_float

#: The traces whose first float16 region was tagged, held weakly: a model with many autocast
#: regions warns once per differentiation, not once per region.
_WATCHED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def watch(xs: Sequence[Any], where: str) -> list[Any]:
    """``xs`` unchanged, but differentiating through their floating leaves warns (see the module).

    Args:
      xs: a program's inputs (arrays or tracers).
      where: the program, for the warning (e.g. ``"loss under 'O1-fp16'"``).

    Returns:
      ``xs`` as a list, the floating ones passed through the watching identity.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp.engine.unscaled import watch
      >>> watch([jnp.ones(2), 3], "f")[1]
      3
    """
    xs = list(xs)
    floating = [i for i, x in enumerate(xs) if is_float(dtype_of(x))]
    if floating:
        for i, y in zip(floating, _identity(where, *[xs[i] for i in floating])):
            xs[i] = y
    return xs


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _identity(where, *xs):
    return xs


@_identity.defjvp
def _identity_jvp(where, primals, tangents):
    if traps.in_loss_scaled_grad():
        return primals, tangents
    # Eager grad: concrete primals, the tangents are the linearization's tracers.
    trace = internals.trace_of(primals) or internals.trace_of(tangents)
    if trace is not None:
        if trace in _WATCHED:
            return primals, tangents
        _WATCHED.add(trace)
    scales = traps.scales_so_far()
    return primals, tuple(_tap_p.bind(*tangents, where=where, scales=scales))


#: ``_tap_p(*ts, where, scales) = ts``: the tangent tag; its transpose is where the warning is decided.
_tap_p = Primitive("jaxmp_unscaled_fp16_tap")
_tap_p.multiple_results = True
_tap_p.def_impl(lambda *ts, **_: ts)
_tap_p.def_abstract_eval(lambda *avals, **_: avals)
mlir.register_lowering(_tap_p, mlir.lower_fun(lambda *ts, **_: ts, multiple_results=True))
batching.primitive_batchers[_tap_p] = lambda args, dims, **params: (_tap_p.bind(*args, **params), dims)


def _tap_jvp(primals, tangents, **params):
    # Linear: the tangent of the tag is the tag of the tangents.
    return _tap_p.bind(*primals, **params), _tap_p.bind(*map(ad.instantiate_zeros, tangents), **params)


ad.primitive_jvps[_tap_p] = _tap_jvp


def _tap_transpose(cts, *ts, where: str, scales: int):
    # Runs while the gradient is traced, after the whole forward pass (loss scaling included).
    if traps.scales_so_far() == scales:  # no loss scale ran since the forward pass
        traps.unscaled_fp16_grad(where)
    return [ct if ad.is_undefined_primal(t) else None for ct, t in zip(cts, ts)]


ad.primitive_transposes[_tap_p] = _tap_transpose
