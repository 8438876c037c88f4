"""A float32 shadow run, ranked by module, and the override that fixes the top offender.

`compare_to_float32` re-evaluates the step's program twice in one jitted pass: as traced and as
its float32 shadow, and ranks ops by their share of the loss error (``<dL/dy_i, delta_i>``).
See docs/debugging.md#a-float32-shadow-run-ranked-by-module. The pass itself is in
`jaxmp.diagnostics._shadow_pass`, the k-step mode in `_shadow_steps`, the report in `_shadow_report`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable

import jax
import numpy as np

from jaxmp._typing import PolicyLike
from jaxmp.engine._seams import AutocastRules
from jaxmp.diagnostics._fix import Fix, suggest_fix

from jaxmp.diagnostics._shadow_report import NOISE_MARGIN, ModuleError, ShadowReport
from jaxmp.diagnostics._shadow_pass import ShadowProgram, half_dtype, rank_modules, relerr, scalar_first
from jaxmp.diagnostics._shadow_steps import ShadowTraining, loss_drift

if TYPE_CHECKING:  # optax is imported where it is used: the report alone does not need it
    import optax

__all__ = ["Fix", "ModuleError", "NOISE_MARGIN", "ShadowReport", "compare_to_float32"]


def compare_to_float32(fn: Callable, *args, policy: PolicyLike | None = None, steps: int = 0,
                       optimizer: optax.GradientTransformation | None = None,
                       per_op: bool = False, grad: bool | None = None, fix: bool = True,
                       rules: AutocastRules | None = None) -> ShadowReport:
    """Runs ``fn`` under a policy and as its float32 shadow on the same inputs; ranks modules by error.

    Both runs evaluate the same traced program, so any front door works: give ``policy`` to run
    float32 code under ``jaxmp.autocast``, or None when ``fn`` computes in its own precision.
    See docs/debugging.md#a-float32-shadow-run-ranked-by-module.

    Args:
      fn: ``fn(params, *batch) -> loss`` (a floating scalar first); any other function is
        compared on its outputs, without loss attribution or gradients. A jaxmp step
        (``make_sharded_train_step``, ``make_pmap_train_step``, the Flax steps) is replaced by
        the loss it wraps (``step.loss_fn`` on the step's arguments), and the report says so.
      *args: its inputs; ``args[0]`` are the parameters (differentiated, and trained with
        ``steps > 0``: their non-floating leaves, ints and PRNG keys, are held fixed).
        Non-array arguments (strings, Python numbers) are static.
      policy: a preset or policy for ``jaxmp.autocast``; None: ``fn`` runs its own precision.
      steps: 0 compares one step. ``k > 0`` first trains both runs ``k`` optimizer steps from the
        same parameters on the same inputs, then compares (some losses only show as drift).
      optimizer: the optax transformation for ``steps`` (default ``optax.adam(1e-3)``).
      per_op: also list every op with its error and loss impact.
      grad: compare gradients too (w.r.t. ``args[0]``). None: when ``fn`` returns a scalar loss.
      fix: for the top offender, write the override and measure it (under ``policy``).
      rules: `jaxmp.AutocastRules` for ``jaxmp.autocast`` (with ``policy``); the fix adds to them.

    Returns:
      A `ShadowReport` (``str()`` is the ranked table, the jump marked, and the fix).

    Raises:
      TypeError: ``fn`` is not callable or given no inputs, ``steps > 0`` without a scalar loss,
        an ``optimizer`` that is not an optax transformation, ``rules`` not AutocastRules.
      ValueError: ``steps < 0``, or an input already holds inf/NaN (named).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmp.diagnostics import compare_to_float32
      >>> def loss(p, x):
      ...     with jax.named_scope("sched"):
      ...         g = x @ p["w"] + p["b"]
      ...     return jnp.mean(jnp.exp(g - 13.0))
      >>> p = {"w": jnp.full((4, 1), 0.01), "b": jnp.full((1,), 13.3)}
      >>> rep = compare_to_float32(loss, p, jnp.ones((8, 4)), policy="O2-bf16", fix=False)
      >>> rep.top.path
      'sched'
    """
    from jaxmp._misuse import loss_scaled_grad

    # Every gradient the comparison takes (the shadow's, the fix's, the FLOP count's) is its own:
    # no "differentiated with no loss scale" warning for them.
    with loss_scaled_grad():
        return _compare(fn, args, policy, steps, optimizer, per_op, grad, fix, rules)


def _compare(fn, args, policy, steps, optimizer, per_op, grad, fix, rules) -> ShadowReport:
    t0 = time.perf_counter()
    from jaxmp.diagnostics import _inputs

    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    steps = int(steps)
    _inputs.check_optimizer("compare_to_float32", optimizer)
    _inputs.check_rules("compare_to_float32", rules)
    if rules is not None and policy is None:
        raise ValueError("compare_to_float32: rules= applies to jaxmp.autocast: give a policy too")
    prep = _inputs.prepare("compare_to_float32", fn, args, {})
    fn, args = _inputs.bind_non_floating_params(prep.fn, prep.args)
    run = fn
    if policy is not None:
        from jaxmp.engine._seams import autocast

        run = autocast(fn, policy, rules=rules)
    has_loss = scalar_first(jax.eval_shape(lambda *a: (run(*a),), *args)[0])
    if steps and not has_loss:
        raise TypeError("compare_to_float32(steps=k) trains on fn's loss: fn must return a floating scalar first")
    grad = has_loss if grad is None else bool(grad and has_loss)
    step = jax.value_and_grad(run) if grad else run
    prog = ShadowProgram(step, args, attribute=has_loss)
    losses, losses_f = (), ()
    eval_args = args
    noise = drift = float("nan")
    losses_noise = ()
    tx = None
    if steps:
        import optax

        tx = optax.adam(1e-3) if optimizer is None else optimizer
        rest = tuple(args[1:])
        half = half_dtype(prog.sites)
        training = ShadowTraining(prog, args[0], rest, steps, tx, half)
        ls = training.losses(0)
        losses, losses_f = tuple(ls[:steps, 0]), tuple(ls[:steps, 1])
        loss_f = float(ls[steps, 1])
        eval_args = (training.policy_params, *rest)
        drift = loss_drift(ls[:, 0], ls[:, 1])
    p, s, errs, contrib = prog.run(eval_args)
    loss = float(p[0]) if has_loss else float("nan")
    if not steps:
        loss_f = float(s[0]) if has_loss else float("nan")
    total = float(np.sum(contrib)) if has_loss else 0.0
    mods = rank_modules(prog.sites, errs, contrib, total)
    key = (lambda m: -abs(m.impact)) if has_loss else (lambda m: -m.activation_error)
    mods.sort(key=key)
    grads = ()
    if grad:
        g_tree = jax.tree_util.tree_unflatten(prog.out_tree, list(zip(p, s)))[1]
        rows = [(jax.tree_util.keystr(path), relerr(*pair))
                for path, pair in jax.tree_util.tree_leaves_with_path(g_tree, is_leaf=lambda x: isinstance(x, tuple))]
        grads = tuple(sorted(rows, key=lambda r: -r[1]))
    ops = ()
    if per_op:
        ops = tuple(sorted(((site, float(errs[site.index]), float(contrib[site.index])) for site in prog.sites.sites),
                           key=lambda r: (-abs(r[2]), -r[1])))
    report = ShadowReport(tuple(mods), loss, loss_f, grads, ops, steps, tuple(losses), tuple(losses_f),
                          None, 0.0, None if policy is None else str(policy), noise, drift, losses_noise,
                          note=prep.note)
    # The twins train while the fix's program compiles (`suggest_fix` calls this once it started it).
    twins = (lambda: training.lane(1)) if steps and half is not None else None
    if fix and has_loss and mods and mods[0].path and np.isfinite(loss):
        scoped = any(site.path == mods[0].path and not site.from_param for site in prog.sites.sites)
        report = dataclasses.replace(report, fix=suggest_fix(fn, args, policy, mods[0].path, report.loss_error,
                                                             report.loss_float32, steps, tx, scoped, meanwhile=twins,
                                                             rules=rules))
    if steps and half is not None:
        # How far rounding-size noise moves each training: the float32 twin from the float32
        # run, the policy twin from the policy run. Chaotic training moves both far.
        tw = training.losses(1)
        report = dataclasses.replace(report, noise_floor=max(loss_drift(tw[:, 1], ls[:, 1]), loss_drift(tw[:, 0], ls[:, 0])),
                                     losses_noise=(tuple(tw[:, 0]), tuple(tw[:, 1])))
    return dataclasses.replace(report, seconds=time.perf_counter() - t0)
