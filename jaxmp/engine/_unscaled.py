"""A warning for float16 regions differentiated with no loss scale.

A float16 autocast program passes its floating inputs through an identity with a custom JVP
(`watch`) that tags the tangents; the tag's transpose, traced after the whole forward pass, warns
unless `jaxmp.value_and_grad` is differentiating or a loss scale's ``scale`` ran in between (a
loss scaled by hand). float16 gradients below 6e-8 flush to zero. See docs/reliability.md.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Sequence

import jax
from jax.interpreters import ad, batching, mlir

from jaxmp import _jaxpr, _misuse as misuse
from jaxmp.engine import _internals as internals
from jaxmp.engine._values import dtype_of, is_float

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


def _identity_jvp(where, primals, tangents):
    if misuse.in_loss_scaled_grad():
        return primals, tangents
    # Eager grad: concrete primals, the tangents are the linearization's tracers.
    nonzero = [i for i, t in enumerate(tangents) if not internals.is_zero(t)]
    trace = internals.trace_of(primals) or internals.trace_of([tangents[i] for i in nonzero])
    if trace is not None:
        if trace in _WATCHED:
            return primals, tangents
        _WATCHED.add(trace)
    scales = misuse.scales_so_far()
    out = list(tangents)
    for i, t in zip(nonzero, _tap_p.bind(*[tangents[i] for i in nonzero], where=where, scales=scales)):
        out[i] = t
    return primals, tuple(out)


# Symbolic zeros: an input not differentiated keeps its zero tangent symbolic, so a custom
# derivative rule downstream still sees it undifferentiated (Equinox's filter_custom_vjp asserts it).
_identity.defjvp(_identity_jvp, symbolic_zeros=True)


#: ``_tap_p(*ts, where, scales) = ts``: the tangent tag; its transpose is where the warning is decided.
_tap_p = _jaxpr.Primitive("jaxmp_unscaled_fp16_tap")
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
    if misuse.scales_so_far() == scales:  # no loss scale ran since the forward pass
        misuse.unscaled_fp16_grad(where)
    return [ct if ad.is_undefined_primal(t) else None for ct, t in zip(cts, ts)]


ad.primitive_transposes[_tap_p] = _tap_transpose
