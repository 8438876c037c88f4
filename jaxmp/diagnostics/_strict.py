"""Strict mode: tracing raises where an op of the policy's float32 list runs in half precision.

For code outside ``jaxmp.autocast`` (``Policy.cast_to_compute``, ``dtype=bfloat16`` layers,
``half_inputs`` kernels, O3). Risky is `jaxmp.diagnostics._find_ops.classify_risk`'s definition,
shared with the precision report. See docs/debugging.md#strict-mode-the-policys-float32-list-enforced-outside-autocast.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import jax

from jaxmp import _jaxpr, _ops
from jaxmp.diagnostics import _format
from jaxmp._typing import PolicyLike
from jaxmp.diagnostics._evaluate import Sites, _inner
from jaxmp.diagnostics._find_ops import classify_risk
from jaxmp.diagnostics._locate import _with_gradient
from jaxmp._scaling._loss_view import find_view

if TYPE_CHECKING:  # imported in the functions that need them at run time (an import cycle otherwise)
    from jaxmp.engine._seams import AutocastRules

_DOCS = "docs/debugging.md"
#: The default float32 list (autocast's: ``jaxmp.engine.FLOAT32_OPS``, the op catalogue's).
_FLOAT32_OPS = _ops.of_class("float32")


class StrictPrecisionError(FloatingPointError):
    """Raised by `strict_precision` where a float32-list op runs in half precision."""


def _float32_ops(policy: Any, rules: Any) -> frozenset[str]:
    if rules is not None:
        return frozenset(rules.float32_ops)
    if policy is None:
        return _FLOAT32_OPS
    from jaxmp.engine._seams import resolve_config

    found = resolve_config(policy, None).rules.float32_ops
    # O3 and pure-half policies list nothing: strict mode checks against the mixed-precision list.
    return frozenset(found) or _FLOAT32_OPS


def _graph(jaxpr) -> tuple[dict, dict]:
    consumers: dict = {}
    producers: dict = {}
    todo = [jaxpr]
    while todo:
        j = todo.pop()
        for eqn in _jaxpr.equations(j):
            for v in eqn.invars:
                if _jaxpr.is_var(v):
                    consumers.setdefault(v, []).append(eqn)
            for v in eqn.outvars:
                producers[v] = eqn
            todo.extend(inner for inner, _ in _inner(eqn, maps=True))
    return consumers, producers


def _counts_a_mask(eqn, producers) -> bool:
    """A sum of values converted from booleans or integers: exact (a count), in any dtype up to 2**11."""
    src = eqn.invars[0]
    prod = producers.get(src) if _jaxpr.is_var(src) else None
    while prod is not None and prod.primitive.name in ("broadcast_in_dim", "reshape", "transpose", "squeeze"):
        src = prod.invars[0]
        prod = producers.get(src) if _jaxpr.is_var(src) else None
    if prod is None or prod.primitive.name != "convert_element_type":
        return False
    dtype = getattr(prod.invars[0].aval, "dtype", None)
    return dtype is not None and not _format.is_floating(dtype)


def violations(jaxpr, float32_ops: frozenset[str]) -> list[tuple[Any, str, str]]:
    """Every risky half op of ``jaxpr`` that the float32 list covers: ``(site, category, why)``.

    Args:
      jaxpr: an open jaxpr.
      float32_ops: the policy's float32 list.

    Returns:
      The violations in program order (empty when the program is clean).
    """
    consumers, producers = _graph(jaxpr)
    out = []
    for site in Sites(jaxpr, maps=True).sites:
        eqn = site.eqn
        if site.primitive not in float32_ops:
            continue
        found = classify_risk(eqn, consumers, reduction_threshold=1)
        if found is None:
            continue
        if found[0] == "reduction" and (_counts_a_mask(eqn, producers) or site.backward):
            continue
        out.append((site, *found))
    return out


def _message(site, category: str, why: str) -> str:
    # Wrapped at 88 columns: the message is read in a terminal, a log and on docs/debugging.md.
    return _format.wrap(
        f"strict precision: {site.primitive} runs in {site.in_dtypes[0]} although the policy's float32 "
        f"list covers it ({category}): {why}.\n  module path: {site.path or '(top level)'}"
        f"{' (backward pass)' if site.backward else ''}\n  source: {site.source or 'unknown'}\n"
        "  fix: upcast its input (x.astype(jnp.float32)), run the code under jaxmp.autocast (which keeps "
        f"the float32 list in float32), or mark the region with @jaxmp.float32_region; see {_DOCS}")


def strict_precision(fn: Callable, *, policy: PolicyLike | None = None, rules: AutocastRules | None = None) -> Callable:
    """Wraps ``fn`` so that tracing it raises where a float32-list op runs in half precision.

    Each new input signature is traced once to a jaxpr and checked before ``fn`` runs (under
    ``jit`` as well: the check happens while the outer function is traced, so a compiled step
    pays nothing afterwards). The forward and the backward pass are checked when the wrapped
    function computes a gradient (wrap the loss-and-gradient function, or the train step).

    Args:
      fn: the function (a loss, a train step, a model's apply). The bodies of ``shard_map`` and
        ``pmap`` are checked too; a jaxmp step (``make_sharded_train_step``,
        ``make_pmap_train_step``, the Flax steps) is checked on the loss it wraps
        (``step.loss_fn``, forward and backward, on the step's arguments).
      policy: the policy whose float32 list applies (a preset such as ``"O2"`` or a
        `jaxmp.Policy`); None, O3 and pure-half policies use the default mixed-precision
        list (`jaxmp.engine.FLOAT32_OPS`).
      rules: a `jaxmp.AutocastRules` whose ``float32_ops`` apply instead.

    Returns:
      The wrapped function (same signature and results).

    Raises:
      StrictPrecisionError: when the wrapped function is called (or traced) and an op of the
        float32 list runs in half: it names the op, its module path and source line.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmp.diagnostics import strict_precision
      >>> x = jnp.ones((4, 8), jnp.bfloat16)
      >>> jax.grad(lambda x: jnp.max(x).astype(jnp.float32))(x).dtype  # allowed: exact
      dtype(bfloat16)
      >>> strict_precision(lambda x: jax.lax.reduce_sum(x, (1,)))(x)
      Traceback (most recent call last):
      ...
      jaxmp.diagnostics._strict.StrictPrecisionError: strict precision:
      reduce_sum runs in bf16 ...
    """
    if not callable(fn):
        raise TypeError(f"strict_precision expects a callable, got {type(fn).__name__}: {fn!r}")
    from jaxmp.diagnostics._inputs import check_rules

    check_rules("strict_precision", rules)
    ops = _float32_ops(policy, rules)
    checked: set = set()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        try:
            key = (tree, tuple(jax.typeof(x) if hasattr(x, "dtype") else ("static", x) for x in leaves))
            hash(key)
        except TypeError:
            key = None
        if key is None or key not in checked:
            view = find_view(fn)
            if view is not None:
                # A jaxmp step: its loss runs in a shard_map or pmap (whose body the check enters,
                # but a pmap step checks its replicas on the host first): check the loss it wraps,
                # forward and backward, on the step's arguments.
                v = view(*args, **kwargs)
                closed = jax.make_jaxpr(_with_gradient(v.fn, 1.0))(*v.args)
            else:
                closed = jax.make_jaxpr(fn)(*args, **kwargs)
            found = violations(closed.jaxpr, ops)
            if found:
                raise StrictPrecisionError(_message(*found[0]) + (
                    f"\n  ({len(found) - 1} more such op(s) after it)" if len(found) > 1 else ""))
            if key is not None:
                checked.add(key)
        return fn(*args, **kwargs)

    return wrapper
