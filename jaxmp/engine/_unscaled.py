"""A warning for float16 regions differentiated with no loss scale.

A float16 autocast program passes its floating inputs through an identity with a custom JVP
(`watch`) that warns when JAX differentiates it, unless `jaxmp.value_and_grad` is the one
differentiating (float16 gradients below 6e-8 flush to zero).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Sequence

import jax

from jaxmp import _traps as traps
from jaxmp.engine import _internals as internals
from jaxmp.engine._values import dtype_of, is_float

#: The traces a warning was given in, held weakly: a model with many autocast regions warns
#: once per trace, not once per region.
_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()


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


@_identity.defjvp
def _identity_jvp(where, primals, tangents):
    trace = internals.trace_of(primals)
    if trace is None or trace not in _WARNED:
        if traps.unscaled_fp16_grad(where) and trace is not None:
            _WARNED.add(trace)
    return primals, tangents
