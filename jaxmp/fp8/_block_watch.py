"""An opt-in watch on the block quantizer: per quantized operand, how many blocks saturate and
how many underflow, with the module path it was traced under.

A block *saturates* when its amax over its decode scale is above the element format's largest
value by more than rounding would absorb (half the spacing there), so its largest elements are
clipped (only the E8M0 ``"floor"`` and ``"even"`` rules allow
it, and an E4M3 scale that rounds down); it *underflows* when it holds a nonzero value and every
element quantizes to zero. Nothing is recorded, and nothing is added to the program, unless the
code is traced inside `watching` (the debugger's ``block_report`` does; a training step pays
nothing): the counts come back through ``jax.debug.callback``, so they also work under ``jit``
and in the backward legs.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp

from jaxmp import _jaxpr
from jaxmp._formats import element_format
from jaxmp._formats._block_scaled import Quantized, blocked, decode_scale


class BlockRow(NamedTuple):
    """Blocks of one operand of one matmul leg: one quantized operand as the watch records it, or
    (in `jaxmp.diagnostics.block_report`) the sum over the calls at one module path.

    Attributes:
      path: the module path (Flax/Equinox/Haiku scopes, ``jax.named_scope`` names), as the
        ``path`` function given to `watching` spells the name stack.
      leg: ``"forward"``, ``"dgrad"`` or ``"wgrad"``.
      operand: ``"lhs"``, ``"rhs"`` (the kernel of ``x @ w``) or ``"gradient"``.
      dtype: the element format.
      blocks: blocks quantized.
      saturated: blocks whose largest elements were clipped to the format's max.
      underflowed: nonzero blocks that quantized to all zeros.
    """

    path: str
    leg: str
    operand: str
    dtype: str
    blocks: int
    saturated: int
    underflowed: int


_RECORDS: contextvars.ContextVar[tuple[list, Callable[[tuple], str]] | None] = contextvars.ContextVar(
    "jaxmp_block_watch", default=None)


@contextlib.contextmanager
def watching(path: Callable[[tuple], str]) -> Iterator[list]:
    """Records a `BlockRow` per quantized operand of what is traced (and run) inside.

    Args:
      path: spells a name stack (`jaxmp._jaxpr.StackItem`s, at trace time) as the row's module path.

    Returns:
      A context manager yielding the list the rows are appended to.
    """
    records: list = []
    token = _RECORDS.set((records, path))
    try:
        yield records
    finally:
        _RECORDS.reset(token)


def counts(x2: jax.Array, qx: Quantized) -> tuple[jax.Array, jax.Array]:
    """``(saturated, underflowed)`` block counts (int32 scalars) of ``x2`` quantized as ``qx``."""
    elem = element_format(qx.q.dtype)
    a, b = qx.block
    amax = jnp.max(jnp.abs(blocked(x2.astype(jnp.float32), a, b)), axis=(1, 3))
    scale = decode_scale(qx) * (1.0 if qx.global_scale is None else qx.global_scale)
    # Clipped beyond rounding: amax / scale above the max plus half the spacing there (E4M3: 464,
    # E2M1: 7), without the division (exact for power-of-two scales). An NVFP4 block scale rounded
    # down to E4M3 maps its amax a little above 6, which rounding alone brings back to 6.
    top = elem.max + 2.0 ** (elem.emax - elem.mbits - 1)
    saturated = jnp.isfinite(amax) & (scale > 0) & (amax > jnp.float32(top) * scale)  # a 0 scale: underflow
    qmax = jnp.max(jnp.abs(blocked(qx.q.astype(jnp.float32), a, b)), axis=(1, 3))
    underflowed = (amax > 0) & (qmax == 0)
    return jnp.sum(saturated, dtype=jnp.int32), jnp.sum(underflowed, dtype=jnp.int32)


def watched_stack() -> tuple | None:
    """The current name stack if a `watching` is open (at trace time), else None."""
    return None if _RECORDS.get() is None else _jaxpr.current_stack()


def watch(x2: jax.Array, qx: Quantized, leg: str, operand: str, stack: tuple) -> None:
    """Records ``x2``'s block counts if a `watching` is open (at trace time; else nothing)."""
    watch_ = _RECORDS.get()
    if watch_ is None:
        return
    records, path = watch_
    sat, under = counts(x2, qx)
    n = int(qx.scale.size)
    name = str(qx.q.dtype)
    where = path(stack)

    def record(s: Any, u: Any) -> None:
        records.append(BlockRow(where, leg, operand, name, n, int(s), int(u)))

    jax.debug.callback(record, sat, under)
