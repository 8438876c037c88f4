"""The debugger's view of block-scaled formats: which blocks saturate or underflow, by module path.

`block_report` runs a loss once under a block-scaled preset (forward and, by default, its
gradient) with the quantizer's watch open (`jaxmp.fp8._block_watch`) and sums, per module path,
matmul leg and operand, the blocks whose largest elements were clipped to the format's max
(*saturated*: only the E8M0 ``"floor"``/``"even"`` rules, or an E4M3 scale that rounds down,
allow it) and the nonzero blocks that quantized to all zeros (*underflowed*: e.g. NVFP4's
per-tensor scale leaving a small block's E4M3 scale at zero). Off the hot path: a training step
traced outside it pays nothing.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxmp._typing import PyTree
from jaxmp.diagnostics import _format
from jaxmp.engine._seams import AutocastRules, autocast
from jaxmp.fp8._seams import block_watch

#: The scopes that say which leg, not where: left out of the module path (the leg is a column).
_LEG_SCOPES = frozenset({"dgrad", "wgrad"})


#: One row of the report: the watch's record, summed per (path, leg, operand, format).
BlockRow = block_watch.BlockRow


class BlockReport(NamedTuple):
    """What `block_report` found: one `BlockRow` per (path, leg, operand), by leg, path, operand."""

    rows: tuple[BlockRow, ...]

    def flagged(self) -> tuple[BlockRow, ...]:
        """The rows with a saturated or underflowed block."""
        return tuple(r for r in self.rows if r.saturated or r.underflowed)

    def __str__(self) -> str:
        bad = self.flagged()
        if not self.rows:
            return "block_report: no block-scaled matmul ran (is the policy a block-scaled preset?)"
        if not bad:
            return f"block_report: no block saturated or underflowed ({len(self.rows)} quantized operands)"
        rows = [(_format.fold_path(r.path or "(top level)", 36), r.leg, r.operand, r.dtype, str(r.blocks),
                 str(r.saturated), str(r.underflowed)) for r in bad]
        return _format.render_table("block_report: blocks that saturate or underflow",
                                    ("module path", "leg", "operand", "format", "blocks", "saturated", "underflowed"),
                                    rows, width=_format.WIDTH, compact=True)


def _path(stack: tuple) -> str:
    own = _format._OWN_SCOPE
    return "/".join(i.name for i in stack if i.kind == "scope" and not own.match(i.name) and i.name not in _LEG_SCOPES)


def _floating_leaf(x: Any) -> bool:
    if isinstance(x, float):
        return True
    dtype = getattr(x, "dtype", None)
    return (dtype is not None and jnp.issubdtype(dtype, jnp.inexact)
            and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def _differentiable(f: Callable[..., Any], args: tuple) -> tuple[Callable[..., Any], tuple]:
    """``f`` and ``args`` ready for ``jax.grad``, or a TypeError saying what to pass instead of JAX's.

    The gradient is taken with respect to ``args[0]``: its non-floating leaves (ints, keys) are
    held fixed, as `compare_to_float32` holds them; a first argument with none is refused.
    """
    if not args:
        raise TypeError("block_report: fn was given no inputs, and the backward pass differentiates the first: "
                        "pass them, block_report(fn, params, batch), or run the forward pass alone with "
                        "backward=False")
    leaves = jax.tree_util.tree_leaves(args[0])
    if not any(_floating_leaf(x) for x in leaves):
        kinds = sorted({str(getattr(x, "dtype", type(x).__name__)) for x in leaves}) or ["no leaves"]
        raise TypeError(f"block_report: the backward pass differentiates fn with respect to its first argument, "
                        f"which holds no floating leaf ({', '.join(kinds)}): put the floating parameters first, "
                        "block_report(fn, params, batch), or pass backward=False")
    from jaxmp.diagnostics._inputs import bind_non_floating_params

    f, args = bind_non_floating_params(f, args)
    out = jax.eval_shape(f, *args)
    if not (isinstance(out, jax.ShapeDtypeStruct) and out.shape == () and jnp.issubdtype(out.dtype, jnp.floating)):
        got = (f"shape {out.shape} {out.dtype}" if isinstance(out, jax.ShapeDtypeStruct)
               else f"a {type(out).__name__}")
        raise TypeError(f"block_report: the backward pass differentiates fn, which returns {got}, not a floating "
                        "scalar: return the loss (e.g. jnp.mean(...)), or pass backward=False to report the forward "
                        "pass alone")
    return f, args


def block_report(fn: Callable[..., Any], *args: PyTree, policy: str = "O2-mxfp8", rules: AutocastRules | None = None,
                 backward: bool = True) -> BlockReport:
    """Runs ``fn`` once under a block-scaled policy and names the blocks that saturate or underflow.

    Args:
      fn: a loss (a scalar) or, with ``backward=False``, any function of arrays.
      *args: its inputs (the gradient is taken with respect to the first).
      policy: a block-scaled preset (``"O2-mxfp8"``, ``"O2-nvfp4"`` ...).
      rules: autocast rules (e.g. ``fp8_matmuls=`` a `jaxmp.fp8.CurrentScaling` of your own).
      backward: also run the gradient, whose dgrad and wgrad legs quantize too.

    Returns:
      A `BlockReport`.

    Raises:
      TypeError: ``fn`` is not callable; with ``backward``: no inputs, a first input with no
        floating leaf (its integer leaves alone are held fixed), or an output that is not a
        floating scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxmp import diagnostics
      >>> w, x = jnp.ones((32, 4)), jnp.ones((2, 32))
      >>> r = diagnostics.block_report(lambda w, x: jnp.sum(x @ w), w, x)
      >>> [(row.leg, row.operand, row.saturated, row.underflowed) for row in r.rows][:2]
      [('forward', 'lhs', 0, 0), ('forward', 'rhs', 0, 0)]
    """
    if not callable(fn):
        raise TypeError(f"block_report expects a callable (a loss), got {type(fn).__name__}: {fn!r}")
    f = autocast(fn, policy, rules=rules)
    if backward:
        f, args = _differentiable(f, args)
    run = jax.jit(jax.grad(f) if backward else f)
    with block_watch.watching(_path) as events:
        jax.block_until_ready(run(*args))
    rows: dict[tuple, list] = {}
    for e in events:
        key = (e.path, e.leg, e.operand, e.dtype)
        acc = rows.setdefault(key, [0, 0, 0])
        acc[0] += e.blocks
        acc[1] += e.saturated
        acc[2] += e.underflowed
    order = {"forward": 0, "dgrad": 1, "wgrad": 2}
    # callbacks arrive in the compiled program's order: sorted by leg, path and operand instead
    ranked = sorted(rows.items(), key=lambda kv: (order[kv[0][1]], kv[0][0], kv[0][2]))
    return BlockReport(tuple(BlockRow(*k, *v) for k, v in ranked))
