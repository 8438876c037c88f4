"""The fix written for the top offender of `jaxmp.diagnostics.compare_to_float32`, measured.

Under ``jaxmp.autocast`` the fix is a scope rule (``with_scope(name, "float32")``), applied and
measured against the same float32 shadow; for code that computes its own precision it is written
but not applied. See docs/debugging.md#the-fix-written-and-measured.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxmp._jaxpr import equations
from jaxmp.diagnostics import _format
from jaxmp.diagnostics._evaluate import StrictJit
from jaxmp.diagnostics._fix_code import (_FIT, door_path, module_class_at, own_precision_code, param_prefix, rules_code,
                                         with_param_scope)

@dataclasses.dataclass(frozen=True)
class Fix:
    """The override suggested for the top offender, measured.

    Attributes:
      path: the module it keeps in float32.
      code: the override, as code to paste.
      error_before, error_after: relative loss error against float32 without and with it
        (after ``steps`` optimizer steps when the comparison trained), NaN when not measured.
      gap_closed: ``1 - error_after / error_before``.
      matmul_flops_leaving_half: the share of matmul FLOPs the override moves out of half precision,
        of every matmul and convolution of the step (forward and backward, whatever their dtype).
      measured: False when the override could not be applied automatically (the code says how).
    """

    path: str
    code: str
    error_before: float = float("nan")
    error_after: float = float("nan")
    gap_closed: float = float("nan")
    matmul_flops_leaving_half: float = float("nan")
    measured: bool = False

    @property
    def closes(self) -> bool:
        """Measured, and it closes part of the gap (only then is it suggested)."""
        return self.measured and bool(self.gap_closed > 0)

    def __str__(self) -> str:
        if self.measured and not self.closes:
            # Never prescribed: a fix measured worse is reported as tried, without its code.
            return _format.wrap(f"tried: keeping {self.path!r} in float32 made it worse: loss error vs float32 "
                                f"{self.error_before:.3g} -> {self.error_after:.3g}; no fix to suggest")
        title = "suggested fix" if self.measured else "untested fix"
        lines = [f"{title}: keep {self.path!r} in float32", "    " + self.code.replace("\n", "\n    ")]
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


def train_step(loss_and_grad: Callable, tx) -> StrictJit:
    """One optimizer step of ``tx`` on ``loss_and_grad(params, *rest) -> (loss, grads)``, one program.

    Called as ``step(params, opt_state, rest) -> (loss, new params, new opt_state)``; compiled
    once per input shapes with the debugger's options (`StrictJit`).
    """
    from jaxmp.diagnostics._inputs import scaled_like_the_step

    def one(params, state, rest):
        loss, grads = loss_and_grad(params, *rest)
        updates, state = tx.update(scaled_like_the_step(grads, state), state, params)
        return jnp.asarray(loss, jnp.float32), apply_updates(params, updates), state

    return StrictJit(one)


def train(loss_and_grad: Callable, params, rest, steps: int, tx,
          step: StrictJit | None = None) -> tuple[Any, list[float]]:
    """``steps`` optimizer steps of ``tx`` on ``loss_and_grad(params, *rest) -> (loss, grads)``.

    The step and the optimizer update are one program (`train_step`, or ``step`` when given,
    e.g. one whose compile was started earlier), compiled once and called ``steps + 1`` times:
    the last call's loss is the loss after the last step (its update is dropped). The calls are
    dispatched without waiting; the losses are read at the end. A Python loop, not a
    ``lax.scan``: at XLA's backend optimization level 0 (the debugger's fast compile)
    convolutions inside a loop run an order of magnitude slower, and the loop saves no compile.

    Returns:
      ``(params after steps, losses)``: ``losses[i]`` is the loss before step ``i``;
      ``losses[steps]`` the loss after the last step.
    """
    step = train_step(loss_and_grad, tx) if step is None else step
    state, rest, losses = tx.init(params), tuple(rest), []
    for i in range(steps + 1):
        loss, new_params, new_state = step(params, state, rest)
        losses.append(loss)
        if i < steps:
            params, state = new_params, new_state
    return params, [float(x) for x in jax.device_get(losses)]


def flops_leaving_half(before: Callable, after: Callable, args: Sequence[Any]) -> float:
    """The share of matmul/conv FLOPs that run in half precision in ``before`` and not in ``after``.

    Both are traced (nothing compiles) on ``args``; the denominator is every matmul and
    convolution of ``before`` whatever dtype it runs in, so the share is the model's (the same
    module is the same share under bf16 and fp16), not the policy's count of half ops.
    """
    from jaxmp.diagnostics._precision_report import precision_report

    rep_b, rep_a = precision_report(before, *args), precision_report(after, *args)
    total = rep_b.total_flops
    return (rep_b.low_precision_flops - rep_a.low_precision_flops) / total if total else 0.0


def _own_precision_fix(fn: Callable, args: Sequence[Any], path: str) -> str:
    """The override for code that computes its own precision: the Flax door's path rule when ``fn``
    runs through the door, else (plain JAX with its own casts) leaving the module out of the casts,
    or running under ``jaxmp.autocast`` with its lines in a float32 named scope."""
    from jaxmp.diagnostics import _locate_fix

    with _locate_fix.doors() as met:  # the doors fn runs through (a trace, nothing compiles)
        closed = jax.make_jaxpr(fn)(*args)
    if met:
        return own_precision_code(path, args[0] if args else None)
    half = any(getattr(getattr(v, "aval", None), "dtype", None) == jnp.float16
               for eqn in equations(closed.jaxpr) for v in eqn.outvars)
    # The module as its params spell it (a Linen scope path starts with the root class: not a key).
    return _locate_fix.own_code([_locate_fix.Unit("own", door_path(path))], args, "O1-fp16" if half else "O1-bf16")


def suggest_fix(fn: Callable, args: Sequence[Any], policy: Any, path: str, loss_error: float, loss_float32: float,
                steps: int, tx: Any, scoped: bool = True, meanwhile: Callable[[], Any] | None = None,
                rules: Any = None, paths: Sequence[str] = (), wraps: str = "fn") -> Fix:
    """The override keeping module ``path`` in float32, measured when ``policy`` is an autocast policy.

    Under ``jaxmp.autocast`` the override is a scope rule for the module's name-stack component,
    or, for a module that emits no instance scope (NNX, Equinox: ``scoped`` False), a class rule
    for its class, found in ``args[0]`` (the model). It is applied, trained as long as the
    comparison and measured. Without a policy (or without the model object), it is written only.

    Args:
      fn: the float32 function compared.
      args: its inputs (``args[0]``: the parameters, or the NNX/Equinox model).
      policy: the autocast policy, or None (``fn`` runs its own precision: not measured).
      path: the module path of the top offender.
      loss_error: the comparison's relative loss error (the "before").
      loss_float32: the float32 shadow's loss (after ``steps`` steps).
      steps: optimizer steps of the comparison (the fix is trained as long).
      tx: the optax transformation those steps used.
      scoped: ``path`` is a name scope of the program (False: named after a parameter).
      meanwhile: called once the fixed run's program compiles in the background (other work of
        the caller that can overlap it), before its result is awaited; not called when the fix
        is written but not measured.
      rules: the user's `jaxmp.AutocastRules` the comparison ran with (None: the policy's).
      paths: every module path of the program: a scope rule matches the name in each of them
        (Linen's ``Conv_0`` in every block), which the code then says.
      wraps: what the code wraps in ``jaxmp.autocast``: ``"fn"``, or ``"fn.__wrapped__"`` when
        the user's ``fn`` is a ``jaxmp.autocast`` function already.

    Returns:
      A `Fix`.
    """
    component = path.rsplit("/", 1)[-1]
    if policy is None:
        return Fix(path, _own_precision_fix(fn, args, path))
    from jaxmp.engine._seams import resolve_config
    from jaxmp.engine._seams import autocast

    # promote=None: the code passes the same policy, which gives the preset's promotion back
    rules = dataclasses.replace(resolve_config(policy, None).rules, promote=None) if rules is None else rules
    call = f"\nfn = jaxmp.autocast({wraps}, {str(policy)!r}, rules=rules)"
    target = fn
    cls = None if scoped else module_class_at(args[0], path)
    if scoped:
        fixed_rules = rules.with_scope(component, "float32")
        code = rules_code(rules, component) + call
        others = sorted({p for p in paths if p != path and component in p.split("/")})
        if others:  # measured as printed: the rule keeps them all in float32
            more = f" and {len(others) - 3} more" if len(others) > 3 else ""
            note = (f"# with_scope({component!r}) matches that name in every module: it also keeps "
                    f"{', '.join(map(repr, others[:3]))}{more} in float32")
            code = "\n".join(textwrap.wrap(note, _FIT, subsequent_indent="# ")) + "\n" + code
    elif cls is None:
        # Plain JAX (or NNX state, Equinox leaves): no scope and no module object. The user puts
        # the ops that read the parameters in a named scope; measured here by running ``fn``
        # with exactly those ops in that scope (`with_param_scope`).
        where = param_prefix(args[0], path)
        fixed_rules = rules.with_scope(component, "float32")
        target = with_param_scope(fn, args, path, component)
        code = "\n".join([
            f"# the ops that read params{where} carry no name scope: put them in one,",
            f"#     with jax.named_scope({component!r}):",
            f"#         ...  # the lines that use params{where}",
            "# and keep it in float32 (or decorate those lines' function with",
            "# @jaxmp.float32_region):",
            rules_code(rules, component)]) + call
    else:
        fixed_rules = rules.with_class(cls, "float32")
        note = (f"# {path!r} emits no name scope (NNX, Equinox): a class rule, every {cls.__name__} "
                "in float32")
        code = "\n".join(textwrap.wrap(note, _FIT, subsequent_indent="# ")) + "\n" \
            + rules_code(rules, component, cls) + call
    fixed = autocast(target, policy, rules=fixed_rules)
    # The fixed run's program compiles in the background while the FLOP counts trace.
    if steps:
        step = train_step(jax.value_and_grad(fixed), tx)
        step.prepare(args[0], jax.eval_shape(tx.init, args[0]), tuple(args[1:]))
    else:
        forward = StrictJit(fixed).prepare(*args)
    if meanwhile is not None:
        meanwhile()
    leaving = flops_leaving_half(jax.value_and_grad(autocast(fn, policy, rules=rules)),
                                 jax.value_and_grad(fixed), args)
    if steps:
        loss_fix = train(None, args[0], args[1:], steps, tx, step)[1][-1]
    else:
        loss_fix = float(forward(*args))
    ref = max(abs(loss_float32), 1e-30)
    before, after = loss_error, abs(loss_fix - loss_float32) / ref
    closed = 1.0 - after / before if before > 0 else float("nan")
    if wraps != "fn":
        head = f"# fn: your jaxmp.autocast function; the rule goes on the function it wraps, {wraps}"
        code = "\n".join(textwrap.wrap(head, _FIT, subsequent_indent="# ")) + "\n" + code
    return dataclasses.replace(Fix(path, code), error_before=before, error_after=after, gap_closed=closed,
                               matmul_flops_leaving_half=leaving, measured=True)


