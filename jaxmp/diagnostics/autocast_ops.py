"""Which rule of [`jaxmp.autocast`][jaxmp.autocast] chose the dtype of each op ("explain").

While [`jaxmp.precision_report`][jaxmp.diagnostics.precision_report.precision_report] traces a step, autocast wraps every op it re-emits in a
``jaxmp.rule=<rule>`` name scope (``half list``, ``float32 list``, ``follow``, ``user cast``,
``as traced``, ``region float32`` ...). This module reads those scopes back off the jaxpr.
"""

from __future__ import annotations

from typing import NamedTuple

from jax.extend import core as _core

from jaxmp.diagnostics import _format

_RULE = "jaxmp.rule="


class AutocastOp(NamedTuple):
    """One op as autocast emitted it.

    Attributes:
      primitive: the primitive name.
      rule: the rule that chose its dtype (``"half list"``, ``"float32 list"``, ``"follow"`` ...).
      in_dtypes: short names of the input dtypes (``"bf16"``, ``"f32"`` ...).
      out_dtypes: short names of the output dtypes.
      name: the name stack without the rule scope (module path, ``jaxmp[...]`` regions).
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


def _subs(params) -> list:
    subs = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, _core.ClosedJaxpr):
                subs.append(v.jaxpr)
            elif isinstance(v, _core.Jaxpr):
                subs.append(v)
    return subs


def autocast_ops(jaxpr) -> tuple[AutocastOp, ...]:
    """The ops of ``jaxpr`` (sub-jaxprs included) that autocast emitted in explain mode.

    Args:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr`` traced while explain mode was on.

    Returns:
      One [`AutocastOp`][jaxmp.diagnostics.AutocastOp] per op, in program order (empty for code without autocast).

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp; from jaxmp.diagnostics.autocast_ops import autocast_ops
      >>> from jaxmp.engine.api import explaining
      >>> with explaining():
      ...     jx = jax.make_jaxpr(jaxmp.autocast(lambda a: jnp.exp(a @ a), "O1-bf16"))(jnp.ones((2, 2)))
      >>> [(op.primitive, op.rule) for op in autocast_ops(jx)]
      [('dot_general', 'half list'), ('exp', 'float32 list')]
    """
    if isinstance(jaxpr, _core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    out: list[AutocastOp] = []
    _walk(jaxpr, "", out)
    return tuple(out)


def _walk(jaxpr, outer: str, out: list) -> None:
    for eqn in jaxpr.eqns:
        name = str(eqn.source_info.name_stack)
        name = f"{outer}/{name}" if outer and name else (name or outer)
        parts = name.split("/")
        rules = [p[len(_RULE):] for p in parts if p.startswith(_RULE)]
        if rules:
            clean = "/".join(p for p in parts if not p.startswith(_RULE))
            # An fp8 layer's label outranks the rule the engine gave the ops inside it.
            rule = next((r for r in rules if "fp8" in r), rules[-1])
            out.append(AutocastOp(eqn.primitive.name, rule, _short(eqn.invars), _short(eqn.outvars), clean))
        for sub in _subs(eqn.params):
            _walk(sub, name, out)
