"""The fix written for the top offender of `jaxmp.diagnostics.compare_to_float32`, measured.

Under ``jaxmp.autocast`` the fix is a scope rule that keeps the module's ops in float32
(``AutocastRules.with_scope(name, "float32")``, which matches the module's name-stack component
whatever the framework: Flax, Equinox, Haiku scopes or ``jax.named_scope``). It is applied,
re-run (and re-trained for a k-step comparison) and its error measured against the same float32
shadow, with the share of matmul FLOPs it moves out of half precision. For code that computes
its own precision (the Flax door, ``Policy.cast_to_compute``), the override is written but not
applied: the function cannot be rebuilt from outside.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.diagnostics import _format
from jaxmp.diagnostics._evaluate import StrictJit

#: The fix's code is printed indented by 4: lines of 84 fit a docs page's 88 columns.
_FIT = _format.WIDTH - 4


@dataclasses.dataclass(frozen=True)
class Fix:
    """The override suggested for the top offender, measured.

    Attributes:
      path: the module it keeps in float32.
      code: the override, as code to paste.
      error_before, error_after: relative loss error against float32 without and with it
        (after ``steps`` optimizer steps when the comparison trained), NaN when not measured.
      gap_closed: ``1 - error_after / error_before``.
      matmul_flops_leaving_half: the share of matmul FLOPs the override moves out of half precision.
      measured: False when the override could not be applied automatically (the code says how).
    """

    path: str
    code: str
    error_before: float = float("nan")
    error_after: float = float("nan")
    gap_closed: float = float("nan")
    matmul_flops_leaving_half: float = float("nan")
    measured: bool = False

    def __str__(self) -> str:
        lines = [f"suggested fix: keep {self.path!r} in float32", "    " + self.code.replace("\n", "\n    ")]
        if self.measured:
            lines.append(f"  measured: loss error vs float32 {self.error_before:.3g} -> {self.error_after:.3g} "
                         f"({_format.fmt_pct(self.gap_closed)} of the gap closed); "
                         f"{_format.fmt_pct(self.matmul_flops_leaving_half)} of matmul FLOPs leave half precision")
        else:
            lines.append("  not measured here: apply it and run compare_to_float32 again to see the error after it")
        # The code is laid out to fit already (`rules_code`); the prose wraps at 88 columns.
        return "\n".join(lines[:2] + [_format.wrap(line) for line in lines[2:]])


def apply_updates(params, updates, keep=True):
    """``params + updates`` in each leaf's dtype; where ``keep`` is False, ``params`` unchanged."""
    return jax.tree_util.tree_map(lambda p, u: jnp.where(keep, (p + u).astype(p.dtype), p), params, updates)


def train(loss_and_grad: Callable, params, rest, steps: int, tx) -> tuple[Any, list[float]]:
    """``steps`` optimizer steps of ``tx`` on ``loss_and_grad(params, *rest) -> (loss, grads)``.

    The step and the optimizer update are one program, compiled once (with the debugger's
    options) and called ``steps + 1`` times: the last call's loss is the loss after the last step
    (its update is dropped). A Python loop, not a ``lax.scan``: at XLA's backend optimization
    level 0 (the debugger's fast compile) convolutions inside a loop run an order of magnitude
    slower, and the loop saves no compile.

    Returns:
      ``(params after steps, losses)``: ``losses[i]`` is the loss before step ``i``;
      ``losses[steps]`` the loss after the last step.
    """
    def one(params, state, rest):
        loss, grads = loss_and_grad(params, *rest)
        updates, state = tx.update(grads, state, params)
        return jnp.asarray(loss, jnp.float32), apply_updates(params, updates), state

    step = StrictJit(one)
    state, rest, losses = tx.init(params), tuple(rest), []
    for i in range(steps + 1):
        loss, new_params, new_state = step(params, state, rest)
        losses.append(float(loss))
        if i < steps:
            params, state = new_params, new_state
    return params, losses


def rules_code(rules, component: str) -> str:
    """``rules`` plus a float32 scope rule for ``component``, spelled as code to paste.

    One line when it fits 84 columns (the fix is printed indented by 4), else one call per line.
    """
    from jaxmp.engine.rules import AutocastRules

    default = AutocastRules()
    kw = []
    if rules.float32_ops != default.float32_ops:
        kw.append("float32_ops=frozenset()" if not rules.float32_ops else
                  f"float32_ops=frozenset({sorted(rules.float32_ops)!r})")
    if rules.half_ops != default.half_ops:
        kw.append(f"half_ops=frozenset({sorted(rules.half_ops)!r})")
    if rules.promote != default.promote:
        kw.append(f"promote={rules.promote!r}")
    if rules.matmul_output != default.matmul_output:
        kw.append(f"matmul_output={rules.matmul_output!r}")
    calls = [f"jaxmp.AutocastRules({', '.join(kw)})"]
    calls += [f".with_scope({pattern!r}, {dtype!r})" for pattern, dtype in rules.scope_rules]
    calls.append(f".with_scope({component!r}, \"float32\")")
    one = "rules = " + "".join(calls)
    if len(one) <= _FIT:
        return one
    return "rules = (" + ("\n         ".join(calls)) + ")"


def _matmul_low_flops(run: Callable, args: Sequence[Any]) -> tuple[int, int]:
    from jaxmp.diagnostics.precision_report import precision_report

    rep = precision_report(run, *args)
    return rep.low_precision_flops, rep.total_flops


def suggest_fix(fn: Callable, args: Sequence[Any], policy: Any, path: str, loss_error: float, loss_float32: float,
                steps: int, tx: Any) -> Fix:
    """The override keeping module ``path`` in float32, measured when ``policy`` is an autocast policy.

    Args:
      fn: the float32 function compared.
      args: its inputs (``args[0]``: the parameters).
      policy: the autocast policy, or None (``fn`` runs its own precision: not measured).
      path: the module path of the top offender.
      loss_error: the comparison's relative loss error (the "before").
      loss_float32: the float32 shadow's loss (after ``steps`` steps).
      steps: optimizer steps of the comparison (the fix is trained as long).
      tx: the optax transformation those steps used.

    Returns:
      A `Fix`.
    """
    component = path.rsplit("/", 1)[-1]
    if policy is None:
        code = "\n".join([
            "# Flax door: jaxmp.flax.mixed_precision(model, policy, overrides=",
            f"#     jaxmp.flax.PrecisionOverrides().with_fp32_paths({component!r}))",
            *textwrap.wrap(f"your own casts (Policy.cast_to_compute, dtype=bfloat16): compute {path!r} on "
                           "float32 params and inputs, or run the function under jaxmp.autocast with", _FIT - 2,
                           initial_indent="# ", subsequent_indent="# ", break_long_words=False),
            f"#     rules=jaxmp.AutocastRules().with_scope({component!r}, \"float32\")"])
        return Fix(path, code)
    from jaxmp.engine.config import resolve_config
    from jaxmp.engine.entry import autocast

    rules = resolve_config(policy, None).rules
    fixed_rules = rules.with_scope(component, "float32")
    code = rules_code(rules, component) + f"\nfn = jaxmp.autocast(fn, {str(policy)!r}, rules=rules)"
    fixed = autocast(fn, policy, rules=fixed_rules)
    if steps:
        loss_fix = train(jax.value_and_grad(fixed), args[0], args[1:], steps, tx)[1][-1]
    else:
        loss_fix = float(StrictJit(fixed)(*args))
    ref = max(abs(loss_float32), 1e-30)
    before, after = loss_error, abs(loss_fix - loss_float32) / ref
    low_b, total = _matmul_low_flops(jax.value_and_grad(autocast(fn, policy)), args)
    low_a, _ = _matmul_low_flops(jax.value_and_grad(fixed), args)
    leaving = (low_b - low_a) / total if total else 0.0
    closed = 1.0 - after / before if before > 0 else float("nan")
    return dataclasses.replace(Fix(path, code), error_before=before, error_after=after, gap_closed=closed,
                               matmul_flops_leaving_half=leaving, measured=True)
