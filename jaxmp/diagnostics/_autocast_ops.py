"""Which rule of [`jaxmp.autocast`][jaxmp.autocast] chose the dtype of each op ("explain").

While [`jaxmp.precision_report`][jaxmp.diagnostics._precision_report.precision_report] traces a step,
autocast wraps every op it re-emits in a ``jaxmp.rule=<rule>`` name scope (``half list``, ``float32 list``, ``follow``, ``user cast``,
``as traced``, ``region float32`` ...). This module reads those scopes back off the jaxpr.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxmp import _jaxpr
from jaxmp.diagnostics import _format

_RULE = "jaxmp.rule="


class AutocastOp(NamedTuple):
    """One op as autocast emitted it.

    Attributes:
      primitive: the primitive name.
      rule: the rule that chose its dtype (``"half list"``, ``"float32 list"``, ``"follow"`` ...).
      in_dtypes: short names of the input dtypes (``"bf16"``, ``"f32"`` ...).
      out_dtypes: short names of the output dtypes.
      name: the name stack without jaxmp's own scopes (module path, ``jaxmp[float32]`` regions).
    """

    primitive: str
    rule: str
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    name: str


def _short(vs) -> tuple[str, ...]:
    out = []
    for v in vs:
        dtype = getattr(getattr(v, "aval", None), "dtype", None)
        if dtype is not None:
            try:
                out.append(_format.short_dtype(dtype))
            except TypeError:
                out.append(str(dtype))
    return tuple(out)


def autocast_ops(jaxpr) -> tuple[AutocastOp, ...]:
    """The ops of ``jaxpr`` (sub-jaxprs included) that autocast emitted in explain mode.

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr`` traced while explain mode was on.

    Returns:
      One [`AutocastOp`][jaxmp.diagnostics.AutocastOp] per op, in program order (empty for code without autocast).
    """
    out: list[AutocastOp] = []
    for e in _jaxpr.walk(jaxpr):
        rules = [s[len(_RULE):] for s in e.scopes if s.startswith(_RULE)]
        if rules:
            clean = _format.user_path(e.stack)
            # An fp8 layer's label outranks the rule the engine gave the ops inside it.
            rule = next((r for r in rules if "fp8" in r), rules[-1])
            out.append(AutocastOp(e.primitive, rule, _short(e.invars), _short(e.outvars), clean))
    return tuple(out)
