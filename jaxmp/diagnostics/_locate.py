"""A culprit for a non-finite step: the first op whose output is inf/NaN while its inputs are finite.

`locate_non_finite` re-runs a step once, off the hot path, on the inputs that overflowed:
it traces the function (and, for a scalar loss, its gradient) and re-evaluates the program op by
op (`jaxmp.diagnostics._evaluate`) in one jitted pass that carries "the first op so far"
through every loop. Nothing of this runs unless it is called: a training step pays nothing.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _ops
from jaxmp.diagnostics import _format, _locate_fix
from jaxmp._scaling._loss_scale import LossScale
from jaxmp._typing import PolicyLike
from jaxmp.engine._seams import AutocastRules
from jaxmp.diagnostics._evaluate import Hooks, Site, Sites, StrictJit, bind, evaluate, leaf_paths, trace

if TYPE_CHECKING:  # annotation only: the engine is imported where it is used
    from jaxmp.engine._seams import AutocastRules

_MAX_INPUTS = 4
#: Mapped programs the evaluator runs as one op (their bodies are per-device programs).
_MAPS = _ops.having("mapped")  # the op catalogue's per-device programs
_DOCS = "docs/debugging.md"


@dataclasses.dataclass(frozen=True)
class NonFiniteCulprit:
    """What `locate_non_finite` found.

    Attributes:
      found: whether an op produced inf/NaN from finite inputs (False: the step is finite on
        these inputs, or the inputs themselves hold inf/NaN; see ``bad_input``).
      primitive: the op (``"dot_general"``, ``"exp"`` ...).
      path: its module path (Flax/Equinox/Haiku scopes, ``jax.named_scope`` names).
      source: ``file:line (function)`` of the code that emitted it.
      backward: the op belongs to the gradient (backward pass).
      in_dtypes, out_dtypes: short dtype names of its operands and results.
      input_absmax: max |x| of each floating operand (up to four).
      dtype_max: the largest finite value of the op's result dtype.
      kind: ``"inf"`` or ``"nan"``.
      rule: the autocast rule that chose the dtype (``"half list"`` ...), or a note when the
        program does not run under autocast.
      context: enclosing loops (``"scan x12"``).
      bad_input: the path of an argument that already held inf/NaN, if any.
      note: what the locator ran instead of ``fn`` (a jaxmp step: the loss it wraps), or "".
      fix_code: the override that keeps the module in float32, as code that runs as printed in the
        spelling of the door the step came through (``fn = jaxmp.autocast(fn, ...)``, the Flax door's
        ``model = jaxmp.flax.mixed_precision(...)``), or "" (no module to keep: see `advice`).
      fix_effect: the override's measured effect: the step re-run op by op with it applied, on the
        same inputs (no inf/NaN, or where the first one moves to and what holds it), or why it was
        not measured.
      fix_module: the module the fix keeps in float32, as the fix's rule spells it (the Flax door's
        path, a scope path, a class), or "".
      loss_scale: the cotangent the backward pass was seeded with (the run's loss scale), or
        None when no backward pass ran.
      fits_scale: for a backward culprit seeded with a scale above 1, the largest power of two
        in ``[1, loss_scale]`` at which the same step is finite (the same program re-run, the
        backward linear in the scale), 0.0 when it overflows at a scale of 1 too (the scale is
        not the cause); None when not measured.
    """

    found: bool
    primitive: str = ""
    path: str = ""
    source: str = ""
    backward: bool = False
    in_dtypes: tuple[str, ...] = ()
    out_dtypes: tuple[str, ...] = ()
    input_absmax: tuple[float, ...] = ()
    dtype_max: float = float("nan")
    kind: str = ""
    rule: str = ""
    context: str = ""
    bad_input: str | None = None
    note: str = ""
    fix_code: str = ""
    fix_effect: str = ""
    fix_module: str = ""
    loss_scale: float | None = None
    fits_scale: float | None = None

    def summary(self) -> str:
        """One line, for error messages."""
        if self.bad_input is not None:
            return f"the input {self.bad_input} already holds inf/NaN"
        if not self.found:
            return "no op produced inf/NaN from finite inputs on these inputs"
        where = self.path or "(top level)"
        mags = ", ".join(f"{m:.3g}" for m in self.input_absmax) or "-"
        return (f"first {self.kind} from finite inputs: {self.primitive} in {where} "
                f"({'backward' if self.backward else 'forward'}, {','.join(self.in_dtypes)} -> "
                f"{','.join(self.out_dtypes)}, inputs max|x| {mags} vs {self.out_dtypes[0] if self.out_dtypes else ''} "
                f"max {self.dtype_max:.5g}) at {self.source or 'unknown source'}"
                + (f": {self._optimizer_advice()}" if self.source == _OPTIMIZER else ""))

    def __str__(self) -> str:
        ran = [_format.wrap(f"  ran         : {self.note}", hang=14)] if self.note else []
        if not self.found:
            return "\n".join(["locate_non_finite: " + self.summary(), *ran])
        mags = ", ".join(f"{m:.4g}" for m in self.input_absmax) or "-"
        lines = [
            f"locate_non_finite: the first {self.kind} comes from {self.primitive} "
            f"in the {'backward' if self.backward else 'forward'} pass",
            f"  module path : {self.path or '(top level)'}",
            f"  source      : {self.source or 'unknown'}",
            f"  dtypes      : {', '.join(self.in_dtypes)} -> {', '.join(self.out_dtypes)}",
            f"  inputs      : max|x| = {mags}; finite max of {self.out_dtypes[0] if self.out_dtypes else '?'} "
            f"is {self.dtype_max:.6g}",
            f"  dtype chosen: {self.rule}",
        ]
        if self.context:
            lines.append(f"  inside      : {self.context}")
        if self.note:
            lines.append(f"  ran         : {self.note}")
        lines.append(f"  fix         : {self.advice()}")
        # Fields continue under their value, so the report reads at 88 columns (a log, a docs page);
        # code is laid out to fit already, and is never re-wrapped (it runs as printed).
        text = [_format.wrap(line, hang=14) for line in lines]
        if self.fix_code:
            text.append(_indent(self.fix_code))
        if self.fix_effect:
            prose, _, code = self.fix_effect.partition("\n")
            text.append(_format.wrap(f"  measured    : {prose}", hang=14))
            if code:
                text.append("\n".join(line if line.startswith("  ") and not line.startswith("    ")
                                      else _indent(line) for line in code.split("\n")))
        return "\n".join(text)

    def advice(self) -> str:
        """What usually fixes this kind of overflow."""
        if self.primitive in _MAPS:
            return (f"this op is a whole {self.primitive}, which the locator runs as one op: call it on the jaxmp "
                    "step itself (it runs the loss the step wraps, step.loss_fn) or on the loss function")
        halves = any(d in ("f16", "bf16") for d in self.in_dtypes + self.out_dtypes)
        if not halves:
            return ("the op runs in float32 here: the values themselves diverge (learning rate, data, "
                    "an unguarded log/div); see " + _DOCS)
        if self.source == _OPTIMIZER:
            return self._optimizer_advice()
        where = repr(self.fix_module or self.path) if self.path else "this op"
        code = ", as code:" if self.fix_code else ""
        if self.backward and self.fits_scale:
            return self.scale_advice()
        if self.backward and self.fits_scale == 0.0:  # measured: it overflows unscaled too
            return (f"the gradient overflows the half dtype in {where} even at a loss scale of 1: train in "
                    f"bfloat16, or keep {where} in float32{code}" + ("" if code else f" (see {_DOCS})"))
        if self.backward:
            return (f"the gradient overflows the half dtype in {where}: lower the loss scale (a dynamic scale "
                    f"backs off by itself), train in bfloat16, or keep {where} in float32{code}"
                    + ("" if code else f" (see {_DOCS})"))
        return (f"normalise the input of {where}, train in bfloat16 (float32's range), or keep {where} in "
                f"float32{code}" + ("" if code else f" (see {_DOCS})"))

    def scale_advice(self, current: LossScale | None = None) -> str:
        """What to pass instead when the loss scale itself overflowed this op (``fits_scale`` > 0), or "".

        Code that runs as printed, ``tx`` being the optimizer ``jaxmp.loss_scaling`` wraps
        (`jaxmp._scaling._opt_state.scale_overflow_fix`); ``current``, the run's loss-scale
        object when known (a dynamic one is told where to start).
        """
        if not self.fits_scale or self.loss_scale is None:
            return ""
        from jaxmp._scaling._opt_state import scale_overflow_fix

        return scale_overflow_fix(self.loss_scale, self.fits_scale, self._half_name(), current)

    def _half_name(self) -> str:
        half = next((d for d in self.out_dtypes + self.in_dtypes if d in ("f16", "bf16")),
                    self.out_dtypes[0] if self.out_dtypes else "")
        return {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}.get(half, half)

    def _optimizer_advice(self) -> str:
        half = next((d for d in self.out_dtypes + self.in_dtypes if d in ("f16", "bf16")), "half")
        name = {"f16": "float16", "bf16": "bfloat16"}.get(half, half)
        eps = (" Adam's eps (1e-8) is below float16's smallest subnormal (6e-8) and rounds to 0, so "
               "mu / (sqrt(nu) + eps) divides by zero where nu underflows." if half == "f16" and self.primitive == "div"
               else "")
        return (f"the optimizer's arithmetic runs in {name}: the params and optimizer state are {name} "
                f"(no float32 masters, as O3 does).{eps} Use master_weights=True (O2: float32 masters and "
                "optimizer state), or keep the optimizer state in float32; see " + _DOCS)


class _Locate(Hooks):
    """Values are arrays; the state is (site, input max|x|, output is NaN) of the first bad op.

    Ops only record which values they read and wrote; `flush` (before a loop, at the end
    of a body) measures every new value of the frame in one concatenated segment reduction and
    decides for all the frame's ops at once. One reduction per value would be one kernel per
    value, and XLA takes seconds to compile a few hundred of them.
    """

    def __init__(self):
        self._mag: dict[int, tuple[Any, Any, Any]] = {}  # id -> (value, max|x| (inf if non-finite), has NaN)
        self._frame: list = []

    def first_order(self, site: Site, eqn, ins, state):
        outs = bind(eqn, ins)
        out_f = [o for o in outs if _floating(o)]
        if out_f:
            self._frame.append((site.index, [x for x in ins if _floating(x)], out_f))
        return outs, state

    def _measure(self, values: list) -> tuple[dict, Any, Any]:
        """Positions of ``values`` in two vectors: max|x| (inf where non-finite) and has-NaN."""
        new: dict = {}
        old: dict = {}
        for x in values:
            hit = self._mag.get(id(x))
            if hit is not None and hit[0] is x:
                old.setdefault(id(x), hit)
            else:
                new.setdefault(id(x), x)
        parts_m, parts_n, pos = [jnp.zeros(1, jnp.float32)], [jnp.zeros(1, bool)], {}
        if old:
            parts_m.append(jnp.stack([h[1] for h in old.values()]))
            parts_n.append(jnp.stack([h[2] for h in old.values()]))
            pos.update({k: 1 + i for i, k in enumerate(old)})
        if new:
            xs = list(new.values())
            sizes = [int(np.size(x)) for x in xs]
            flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in xs])
            seg = jnp.asarray(np.repeat(np.arange(len(xs), dtype=np.int32), sizes))
            # A barrier: values computed from constants only would otherwise be constant-folded
            # through the scatter below, which XLA does slowly (seconds per op).
            flat = jax.lax.optimization_barrier(flat)
            a = jnp.abs(flat)
            mags = jax.ops.segment_max(jnp.where(jnp.isnan(a), jnp.inf, a), seg, len(xs), indices_are_sorted=True)
            nans = jax.ops.segment_max(jnp.isnan(a).astype(jnp.int32), seg, len(xs), indices_are_sorted=True) > 0
            mags = jnp.where(np.array(sizes) == 0, 0.0, mags)
            start = 1 + len(old)
            for i, (k, x) in enumerate(new.items()):
                self._mag[k] = (x, mags[i], nans[i])
                pos[k] = start + i
            parts_m.append(mags)
            parts_n.append(nans)
        return pos, jnp.concatenate(parts_m), jnp.concatenate(parts_n)

    def flush(self, state):
        if not self._frame:
            return state
        frame, self._frame = self._frame, []
        pos, mag, nan_of = self._measure([x for _, ins, outs in frame for x in (*ins, *outs)])
        k_in = max(1, max(len(ins) for _, ins, _ in frame))
        k_out = max(len(outs) for _, _, outs in frame)
        # Index 0 is a zero entry: padding that is finite and not NaN.
        in_idx = np.array([[pos[id(x)] for x in ins] + [0] * (k_in - len(ins)) for _, ins, _ in frame], np.int32)
        out_idx = np.array([[pos[id(o)] for o in outs] + [pos[id(outs[0])]] * (k_out - len(outs))
                            for _, _, outs in frame], np.int32)
        flags = jnp.all(jnp.isfinite(mag[in_idx]), axis=1) & ~jnp.all(jnp.isfinite(mag[out_idx]), axis=1)
        i = jnp.argmax(flags)
        first, mags, nan = state
        new = (first < 0) & flags[i]
        head = np.pad(in_idx[:, :_MAX_INPUTS], ((0, 0), (0, max(0, _MAX_INPUTS - k_in))))
        ids = jnp.asarray(np.array([f[0] for f in frame], np.int32))
        return (jnp.where(new, ids[i], first), jnp.where(new, mag[jnp.asarray(head)[i]], mags),
                jnp.where(new, jnp.any(nan_of[jnp.asarray(out_idx)[i]]), nan))


def _indent(code: str) -> str:
    return "\n".join("    " + line for line in code.split("\n"))


def _floating(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and _format.is_floating(dtype)


def _with_gradient(fn: Callable, loss_scale: float | None) -> Callable:
    """``fn`` and its gradient (w.r.t. every floating argument), the cotangent seeded with ``loss_scale``.

    ``loss_scale=None``: the scale is the returned function's first argument (a traced float32
    scalar), so one compiled program runs the step at several scales.
    """

    def both(*args, **kwargs):
        scale = loss_scale
        if scale is None:
            scale, args = args[0], args[1:]
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        diff = [i for i, x in enumerate(flat) if _floating(x)]

        def of(*xs):
            full = list(flat)
            for i, x in zip(diff, xs):
                full[i] = x
            a, k = jax.tree_util.tree_unflatten(tree, full)
            return fn(*a, **k)

        out, vjp = jax.vjp(of, *[flat[i] for i in diff])
        cts = jax.tree_util.tree_map(lambda o: jnp.full(jnp.shape(o), scale).astype(o.dtype) if _floating(o)
                                     else np.zeros(jnp.shape(o), jax.dtypes.float0), out)
        return out, vjp(cts)

    return both


def _largest_finite_scale(finite_at: Callable[[float], bool], loss_scale: float) -> float:
    """The largest power of two in ``[1, loss_scale]`` at which ``finite_at`` holds; 0.0 if not at 1.

    ``finite_at(loss_scale)`` is known False. The backward pass is linear in its seed, so
    finiteness is monotone in the scale: a bisection over the exponents (at most 7 runs).
    """
    if not finite_at(1.0):
        return 0.0
    lo, hi = 0, int(np.floor(np.log2(loss_scale))) + 1  # finite at 2**lo; 2**hi > loss_scale is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if finite_at(2.0 ** mid) else (lo, mid)
    return 2.0 ** lo


def _scalar_float(shape_tree) -> bool:
    leaves = jax.tree_util.tree_leaves(shape_tree)
    return len(leaves) >= 1 and getattr(leaves[0], "shape", None) == () and _floating(leaves[0])


def locate_non_finite(fn: Callable, *args, policy: PolicyLike | None = None, grad: bool | None = None,
                      loss_scale: float | jax.Array | None = None, rules: AutocastRules | None = None,
                      **kwargs) -> NonFiniteCulprit:
    """Names the first op, forward or backward, whose output is inf/NaN while its inputs are finite.

    Re-runs ``fn`` once on these inputs, op by op (one jitted re-evaluation of its jaxpr; loops,
    conds, remat and nested jits are entered), and reports the op: primitive, module path,
    source line, dtypes, its inputs' magnitudes against the dtype's largest finite value, and
    the autocast rule that chose the dtype. Call it off the hot path, when a run keeps skipping
    steps (``jaxmp.check_health(..., locate=...)`` does): a step that does not call it pays nothing.

    Args:
      fn: a loss function (``fn(params, batch) -> scalar``), a forward pass, or a whole train
        step (its gradient is inside it already). A jaxmp step (``make_sharded_train_step``,
        ``make_pmap_train_step``, the Flax steps) is replaced by the loss it wraps
        (``step.loss_fn``, run on the step's arguments; its ``shard_map``/``pmap`` is one op to
        the locator), and the report says so (``note``).
      *args: the inputs of the step that overflowed.
      policy: run ``fn`` under ``jaxmp.autocast(fn, policy)`` (a preset such as ``"O1-fp16"``);
        None: ``fn`` already runs in its precision (Flax door, ``Policy.cast_to_compute``, or
        a ``jaxmp.autocast`` function, read as its policy and rules: its fix re-wraps
        ``fn.__wrapped__``).
      grad: also run the backward pass (``jax.vjp`` of ``fn``). None: when ``fn`` returns a
        floating scalar first (a loss).
      loss_scale: the cotangent the backward pass is seeded with (the run's loss scale: float16
        gradients overflow at the scale, not at 1): a number or a one-element array such as
        ``jaxmp.get_loss_scale(opt_state).loss_scale``; finite and positive. None: 1, or for a
        jaxmp step the scale in its optimizer state. When the culprit is in the backward pass at
        a scale above 1, the same compiled program re-runs at smaller powers of two (a few runs,
        no new compile) to tell whether the scale is the cause (``fits_scale``).
      rules: `jaxmp.AutocastRules` for ``jaxmp.autocast`` (with ``policy``).
      **kwargs: keyword arguments of ``fn``.

    Returns:
      A `NonFiniteCulprit` (``str()`` is a readable report; ``.summary()`` one line).

    Raises:
      TypeError: ``fn`` is not callable, or ``rules`` is not an AutocastRules.
      ValueError: ``loss_scale`` is not finite and positive.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxmp.diagnostics import locate_non_finite
      >>> def loss(w, x):
      ...     with jax.named_scope("encoder"):
      ...         h = (x @ w).astype(jnp.float16) * 1000.0
      ...     return jnp.mean(h.astype(jnp.float32))
      >>> found = locate_non_finite(loss, jnp.full((4, 4), 30.0), jnp.ones((2, 4)))
      >>> found.primitive, found.path, found.backward
      ('mul', 'encoder', False)
    """
    from jaxmp.diagnostics import _inputs

    _inputs.check_rules("locate_non_finite", rules)
    from jaxmp._scaling._opt_state import first_non_finite

    if not callable(fn):
        raise TypeError(f"locate_non_finite expects a callable (a loss function or train step), got "
                        f"{type(fn).__name__}: {fn!r}")
    if loss_scale is not None:
        loss_scale = _inputs.check_loss_scale("locate_non_finite", loss_scale)
    bad = first_non_finite((args, kwargs) if kwargs else tuple(args))  # "[1]": the argument's position
    if bad is not None:
        return NonFiniteCulprit(False, bad_input=bad)
    prep = _inputs.prepare("locate_non_finite", fn, args, kwargs, need_args=False)
    fn, args, kwargs = prep.fn, prep.args, prep.kwargs
    if loss_scale is None:
        loss_scale = prep.loss_scale if prep.loss_scale is not None else 1.0
    rewrap = None
    if policy is None:
        from jaxmp.engine._seams import autocast_given

        # A jaxmp.autocast function: the same program as policy= on what it wraps, and its fix is
        # autocast's rule, re-wrapping that function (``fn.__wrapped__``) as the user wrapped it.
        given = autocast_given(fn)
        if given is not None:
            fn, policy, rules = given
            rewrap = "fn.__wrapped__"
    run = fn
    if policy is not None:
        from jaxmp.engine._seams import autocast

        run = autocast(fn, policy, rules=rules)
    if grad is None:
        _, shape = jax.eval_shape(lambda *a, **k: (0, run(*a, **k)), *args, **kwargs)
        grad = _scalar_float(shape)
    with _locate_fix.doors() as met:  # the Flax doors the step runs through (their fix is a path rule)
        found, site, sites = _run_once(run, args, kwargs, grad, float(loss_scale))
    if found is None:
        return NonFiniteCulprit(False, note=prep.note, loss_scale=float(loss_scale) if grad else None)
    found = dataclasses.replace(found, note=prep.note)
    if not _fixable(found) or found.fits_scale:  # a scale that fits is the fix (`advice`), not a rule
        return found
    paths = frozenset(s.path for s in sites.sites if s.path)
    half = "O1-fp16" if "f16" in found.in_dtypes + found.out_dtypes else "O1-bf16"
    door = met[0] if met else None
    step = _locate_fix.Step(fn, tuple(args), kwargs, policy, rules, door, paths, half,
                            target=rewrap or "fn")
    return _with_fix(found, site, step, grad, float(loss_scale))


def _run_once(run: Callable, args, kwargs, grad: bool, loss_scale: float, scale_cause: bool = True):
    """``(culprit, its site, the program's sites)`` of one op-by-op run (culprit and site None: all finite).

    ``scale_cause``: for a backward culprit at a scale above 1, re-run the same program at smaller
    scales to measure ``fits_scale`` (the fix's re-runs skip it).
    """
    seed = float(loss_scale) if grad else None
    if grad:
        # The seed is the program's first input: the same compiled program re-runs at other scales.
        run = _with_gradient(run, None)
        args = (jnp.float32(seed), *args)
    closed, _ = trace(run, args, kwargs)
    paths = ["<loss scale>", *leaf_paths(args[1:], kwargs)] if grad else leaf_paths(args, kwargs)
    sites = Sites(closed.jaxpr, paths)
    hooks = _Locate()

    def program(consts, leaves):
        state = (jnp.int32(-1), jnp.zeros(_MAX_INPUTS, jnp.float32), jnp.array(False))
        _, state = evaluate(closed.jaxpr, consts, leaves, state, hooks, sites)
        return state

    located = StrictJit(program)
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    first, mags, nan = jax.device_get(located(list(closed.consts), leaves))
    if int(first) < 0:
        return None, None, sites
    site = sites.sites[int(first)]
    found = dataclasses.replace(culprit(site, mags, bool(nan)), loss_scale=seed)
    if scale_cause and found.backward and seed is not None and seed > 1:
        # Is the scale the cause? The same step at other seeds: finite unscaled, up to which scale.
        def finite_at(scale: float) -> bool:
            again = located(list(closed.consts), [jnp.float32(scale), *leaves[1:]])
            return int(jax.device_get(again[0])) < 0

        found = dataclasses.replace(found, fits_scale=_largest_finite_scale(finite_at, seed))
    return found, site, sites


def _fixable(found: NonFiniteCulprit) -> bool:
    """A half-precision op of a module (not a whole mapped program, not the optimizer's arithmetic)."""
    halves = any(d in ("f16", "bf16") for d in found.in_dtypes + found.out_dtypes)
    return halves and found.primitive not in _MAPS and found.source != _OPTIMIZER


def _with_fix(found: NonFiniteCulprit, site: Site, step: "_locate_fix.Step", grad: bool,
              loss_scale: float) -> NonFiniteCulprit:
    """``found`` with the override keeping its module in float32, as code, and its measured effect."""
    unit = step.unit(site.path, site.from_param)
    if unit is None:
        return found
    return dataclasses.replace(found, fix_code=step.code([unit]), fix_module=str(unit),
                               fix_effect=_measure(step, [unit], found, grad, loss_scale))


def _located_with(step: "_locate_fix.Step", units: list, grad: bool, loss_scale: float):
    """The step re-run with ``units`` in float32: ``(culprit, site)``, or None when it cannot be rebuilt."""
    runner = step.runner(units)
    if runner is None:
        return None
    run, context = runner
    with context():
        found, site, _ = _run_once(run, step.args, step.kwargs, grad, loss_scale, scale_cause=False)
    return found, site


def _measure(step: "_locate_fix.Step", units: list, found: NonFiniteCulprit, grad: bool, loss_scale: float) -> str:
    """What the override does, re-run on the same inputs: the first line prose, then code to paste."""
    after = _located_with(step, units, grad, loss_scale)
    if after is None:
        return ("not measured: the step computes its own precision, which the locator cannot rebuild; apply it "
                "and run locate_non_finite again")
    if after[0] is None:
        return "with the fix, no op makes inf/NaN on these inputs (re-run op by op)"
    moved, site = after
    nxt = step.unit(site.path, site.from_param)
    twin = step.bfloat16_code()
    bf16 = ["  or train in bfloat16 (float32's range):", twin] if twin else []
    where = _locate_fix.describe(moved)
    if nxt in units:
        return "\n".join([f"with the fix, the first {moved.kind} is still {where}: the rule does not reach that op; "
                          "train in bfloat16 (float32's range)" + (":" if twin else ""), *bf16[1:]])
    if nxt is None:
        return "\n".join([f"with the fix, the first {moved.kind} moves to {where}, outside any module: the values "
                          f"grow past {found.out_dtypes[0]}'s range after {str(units[-1])!r}; keep what follows it "
                          "in float32 too, or train in bfloat16 (float32's range)" + (":" if twin else ""),
                          *bf16[1:]])
    held = _located_with(step, [*units, nxt], grad, loss_scale)
    head = f"with the fix, the first {moved.kind} moves to the next module: {where}; keeping {str(nxt)!r} in float32 too"
    if held is not None and held[0] is not None:  # it moves on: the values outgrow the half dtype from here
        return "\n".join([f"{head} moves it on to {_locate_fix.describe(held[0])}: the values outgrow "
                          f"{found.out_dtypes[0]} past {str(units[-1])!r}; train in bfloat16 (float32's range)"
                          + (":" if twin else ""), *bf16[1:]])
    verdict = "is not measured" if held is None else "holds it: no op makes inf/NaN on these inputs"
    return "\n".join([f"{head} {verdict}:", step.code([*units, nxt]), *bf16])


# jaxmp's own files that run the user's optimizer: an op located there is the wrapped optax
# transformation's arithmetic, which JAX's traceback cannot attribute further (optax is traced
# inside jaxmp's step and its frames count as library frames).
_OPTIMIZER_FILES = ("_scaling/_transform.py", "lean/_bf16.py", "lean/_remainders.py", "lean/_widening.py",
                    "lean/_quantized.py", "_scaling/_fold.py", "_scaling/_skip.py")
_OPTIMIZER = "the optimizer update (the optax transformation inside jaxmp.loss_scaling)"
_JAXMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _user_facing_source(source: str) -> str:
    """``source``, or what runs there when it is a line of jaxmp's own optimizer wrapper."""
    if source.startswith(_JAXMP_DIR) and source[len(_JAXMP_DIR):].split(":")[0].replace(os.sep, "/") in _OPTIMIZER_FILES:
        return _OPTIMIZER
    return source


def culprit(site: Site, mags, nan: bool) -> NonFiniteCulprit:
    """The `NonFiniteCulprit` of ``site`` with the recorded magnitudes."""
    n_in = sum(1 for a in site.eqn.invars if _floating(getattr(a, "aval", None)))
    out_dtype = next((a.aval.dtype for a in site.eqn.outvars if _floating(a.aval)), np.float32)
    rule = site.rule or ("region " + site.region if site.region else
                         "as written (not under jaxmp.autocast: the code or its policy casts chose it)")
    return NonFiniteCulprit(
        True, site.primitive, site.path, _user_facing_source(site.source), site.backward, site.in_dtypes,
        site.out_dtypes,
        tuple(float(m) for m in np.asarray(mags)[:min(n_in, _MAX_INPUTS)]),
        float(jnp.finfo(out_dtype).max), "nan" if nan else "inf", rule, site.context)
