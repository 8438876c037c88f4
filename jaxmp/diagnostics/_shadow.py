"""A float32 shadow run, ranked by module, and the override that fixes the top offender.

`compare_to_float32` re-evaluates the step's program twice in one jitted pass: as traced and as
its float32 shadow, and ranks ops by their share of the loss error (``<dL/dy_i, delta_i>``).
See docs/debugging.md#a-float32-shadow-run-ranked-by-module.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _ops
from jaxmp.diagnostics import _format
from jaxmp._typing import PolicyLike
from jaxmp.engine._seams import internals
from jaxmp.engine._seams import AutocastRules
from jaxmp.diagnostics._fix import suggest_fix
from jaxmp.diagnostics._shadow_report import ModuleError, ShadowReport
from jaxmp.diagnostics._shadow_steps import _floating, _perturb, _Training  # noqa: F401 - _perturb: tests reach it here
from jaxmp.diagnostics._evaluate import Hooks, Site, Sites, StrictJit, bind, evaluate, leaf_paths, trace
from jaxmp.diagnostics._noise import NOISE_MARGIN, NOISE_SEEDS  # noqa: F401 - NOISE_SEEDS: documented here
from jaxmp.diagnostics._noise import EXACT as _EXACT
from jaxmp.diagnostics._noise import drift as _drift
from jaxmp.diagnostics._noise import gradient_errors as _gradient_errors
from jaxmp.diagnostics._noise import noisy_site as _noisy_site
from jaxmp.diagnostics._noise import one_step_noise as _one_step_noise
from jaxmp.diagnostics._noise import relerr as _relerr
from jaxmp.diagnostics._noise import window as _window

if TYPE_CHECKING:  # optax is imported where it is used: the report alone does not need it
    import optax

    from jaxmp.diagnostics._choose import PrecisionPlan

_F32 = np.dtype(np.float32)

#: First-order ops with a combiner jaxpr (the op catalogue's).
_COMBINER_OPS = _ops.of_class("combiner")
#: Per-device programs (``shard_map``, ``pmap``) the evaluator runs as one op, in both runs.
_MAPPED = _ops.having("mapped")


def _up(x):
    return x.astype(jnp.float32) if _floating(x) and np.dtype(x.dtype) != _F32 else x


def _f32_params(eqn) -> dict:
    p = dict(eqn.params)
    for name in ("new_dtype", "preferred_element_type", "dtype"):
        d = p.get(name)
        if d is not None and _format.is_floating(d) and np.dtype(d).itemsize < 4:
            p[name] = _F32
    return p


def _shadow_bind(eqn, xs: list) -> list:
    """``eqn`` on float32 operands, as float32 (a narrowing is the identity there)."""
    name = eqn.primitive.name
    if name == "reduce_precision" or (name == "convert_element_type" and _floating(xs[0])
                                      and _format.is_floating(eqn.params["new_dtype"])):
        return [_up(xs[0])]
    if name not in _COMBINER_OPS and not internals.sub_jaxprs(eqn):
        try:
            return [_up(o) for o in bind(eqn, xs, _f32_params(eqn))]
        except (TypeError, ValueError):  # an op whose parameters pin its dtypes: run as traced, below
            pass
    # Ops that carry a combiner typed for their traced dtypes (scatter-add, reduce, sort) run in
    # those dtypes: their shadow is as precise as the policy run there.
    traced = [getattr(getattr(a, "aval", None), "dtype", None) for a in eqn.invars]
    args = [x.astype(d) if _floating(x) and d is not None and _format.is_floating(d) else x
            for x, d in zip(xs, traced)]
    return [_up(o) for o in bind(eqn, args)]


class _Shadow(Hooks):
    """Values are (policy array, float32 twin); the state is the max relative error per site."""

    def __init__(self, n: int, attribute: bool, record: bool = True):
        self.n, self.attribute, self.record, self.t = n, attribute, record, None
        self.noise = None  # (scale, seed): the shadow's half ops' results perturbed (see `_Program.noise`)
        self._frame: list = []

    def lift(self, x, aval):
        return (x, _up(jnp.asarray(x)) if _floating(x) else x)

    def literal(self, atom):
        x = np.asarray(atom.val, atom.aval.dtype)
        return (x, x.astype(np.float32) if _format.is_floating(x.dtype) else x)

    def index(self, value):
        return value[0]

    def barrier(self, values):
        return [(p, jax.lax.stop_gradient(s)) for p, s in values]

    def first_order(self, site: Site, eqn, ins, state):
        ps, ss = [v[0] for v in ins], [v[1] for v in ins]
        p_out = bind(eqn, ps)
        s_out = _shadow_bind(eqn, ss)
        k = next((i for i, o in enumerate(p_out) if _floating(o)), None)
        if k is None:
            return list(zip(p_out, s_out)), state
        if self.attribute and self.t is not None and site.half and not site.backward \
                and site.primitive not in _EXACT:
            s_out[k] = s_out[k] + self.t[site.index] * jax.lax.stop_gradient(self._rounding(eqn, ss, k))
        if self.noise is not None and _noisy_site(site):
            s_out[k] = s_out[k] * _window(self.noise, jnp.shape(s_out[k]), site.index)
        if self.record:
            self._frame.append((site.index, p_out[k], s_out[k]))
        return list(zip(p_out, s_out)), state

    @staticmethod
    def _rounding(eqn, ss, k):
        """Op ``eqn``'s own rounding: as traced on its (rounded) exact inputs, minus float32 on the same."""
        traced = [getattr(getattr(a, "aval", None), "dtype", None) for a in eqn.invars]
        rounded = [x.astype(d) if _floating(x) and d is not None and _format.is_floating(d) else x
                   for x, d in zip(ss, traced)]
        out = bind(eqn, rounded)[k]
        local = _up(out)
        if np.dtype(out.dtype).itemsize < 4:
            # XLA may keep a half result in float32 inside a fusion (xla_allow_excess_precision);
            # reduce_precision is never elided, so the op's rounding is measured as the dtype has it.
            fi = jnp.finfo(out.dtype)
            local = jax.lax.reduce_precision(local, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
        exact = _shadow_bind(eqn, [_up(x) for x in rounded])[k]
        return local - exact

    def flush(self, errs):
        if not self._frame:
            return errs
        frame, self._frame = self._frame, []
        sizes = [int(np.size(p)) for _, p, _ in frame]
        p = jnp.concatenate([jnp.ravel(p).astype(jnp.float32) for _, p, _ in frame])
        s = jax.lax.stop_gradient(jnp.concatenate([jnp.ravel(s).astype(jnp.float32) for _, _, s in frame]))
        p, s = jax.lax.optimization_barrier((p, s))  # no constant folding through the scatter
        seg = jnp.asarray(np.repeat(np.arange(len(frame), dtype=np.int32), sizes))
        num = jax.ops.segment_sum(jnp.square(p - s), seg, len(frame), indices_are_sorted=True)
        den = jax.ops.segment_sum(jnp.square(s), seg, len(frame), indices_are_sorted=True)
        err = jnp.sqrt(num) / jnp.maximum(jnp.sqrt(den), jnp.finfo(jnp.float32).tiny)
        err = jnp.where((num == 0) & (den == 0), 0.0, err)
        ids = jnp.asarray(np.array([f[0] for f in frame], np.int32))
        # Row 0: each op's relative error; rows 1-2: its squared error and squared float32 norm,
        # summed (a module's backward error is read over all its ops' results, see _modules).
        return errs.at[0, ids].max(err).at[1, ids].add(num).at[2, ids].add(den)


# -- running ---------------------------------------------------------------------------------

def _scalar_first(shape_tree) -> bool:
    leaves = jax.tree_util.tree_leaves(shape_tree)
    return bool(leaves) and getattr(leaves[0], "shape", None) == () and _floating(leaves[0])




def _mapped_note(sites: Sites, note: str) -> str:
    """``note``, and a word on each ``shard_map``/``pmap`` the program runs as one op: its body runs
    in the policy's precision in both runs, so it adds no error to the comparison."""
    mapped = sorted({f"{s.primitive} at {s.path or '(top level)'}" for s in sites.sites if s.primitive in _MAPPED})
    if not mapped:
        return note
    word = (f"{', '.join(mapped)} ran as one op, the same in both runs: its body is not compared (pass the "
            "function it maps, or the jaxmp step itself)")
    return f"{note}; {word}" if note else word


class _Program:
    """One traced step, its sites, and jitted runners (policy+shadow with attribution; shadow only)."""

    def __init__(self, run: Callable, args: Sequence[Any], attribute: bool):
        self.closed, self.out_tree = trace(run, tuple(args), {})
        self.sites = Sites(self.closed.jaxpr, leaf_paths(args, {}))
        self.attribute = attribute
        n = len(self.sites)

        # The noise buffer: twice the largest result that gets noise, so windows differ per op.
        self.noise_len = 2 * max([int(np.prod(v.aval.shape)) for s in self.sites.sites if _noisy_site(s)
                                  for v in s.eqn.outvars if hasattr(getattr(v, "aval", None), "shape")] or [0]) + 1

        def both(t, noise, consts, leaves):
            hooks = _Shadow(n, attribute)
            hooks.t, hooks.noise = t, noise
            lifted = [hooks.lift(x, None) for x in leaves]
            outs, errs = evaluate(self.closed.jaxpr, [hooks.lift(c, None) for c in consts], lifted,
                                  jnp.zeros((3, n), jnp.float32), hooks, self.sites)
            loss = outs[0][1] if attribute else jnp.zeros((), jnp.float32)
            return jnp.asarray(loss, jnp.float32).reshape(()), ([o[0] for o in outs], [o[1] for o in outs], errs)

        self._both = both
        if attribute:
            analyse = jax.value_and_grad(both, has_aux=True)
        else:
            def analyse(t, noise, c, l):
                return both(t, noise, c, l), jnp.zeros(n, jnp.float32)
        # Compiled once per input shapes: the k-step mode runs it on the first and the last step.
        self.analyse = StrictJit(analyse)

        def shadow_only(consts, leaves):
            hooks = _Shadow(n, False, record=False)
            outs, _ = evaluate(self.closed.jaxpr, [hooks.lift(c, None) for c in consts],
                               [hooks.lift(x, None) for x in leaves], jnp.zeros((3, n), jnp.float32), hooks,
                               self.sites)
            return [o[1] for o in outs]

        self.shadow_fn = shadow_only
        self.shadow = StrictJit(shadow_only)

    def prepare(self, args) -> None:
        """Starts compiling the analysis for inputs shaped as ``args`` in the background (see `run`)."""
        self.analyse.prepare(np.zeros(len(self.sites), np.float32), np.ones(self.noise_len, np.float32),
                             list(self.closed.consts), jax.tree_util.tree_leaves(tuple(args)))

    def run(self, args):
        leaves = jax.tree_util.tree_leaves(tuple(args))
        t = np.zeros(len(self.sites), np.float32)
        (_, (p, s, errs)), contrib = self.analyse(t, np.ones(self.noise_len, np.float32), list(self.closed.consts),
                                                  leaves)
        return p, s, np.asarray(errs), np.asarray(contrib)

    def noise(self, args, scale: float, seed: int):
        """The float32 shadow's outputs with every half op's result (forward, not exact) times
        ``1 + scale * uniform(-1, 1)``: the policy run's roundings as random noise, same program."""
        leaves = jax.tree_util.tree_leaves(tuple(args))
        t = np.zeros(len(self.sites), np.float32)
        u = np.random.default_rng(seed).uniform(-1.0, 1.0, self.noise_len)
        (_, (_, s, _)), _ = self.analyse(t, (1.0 + scale * u).astype(np.float32), list(self.closed.consts), leaves)
        return s

    def shadow_outputs(self, args):
        return self.shadow(list(self.closed.consts), jax.tree_util.tree_leaves(tuple(args)))


def _modules(sites: Sites, errs, contrib, total: float) -> list[ModuleError]:
    """The modules' rows; ``errs``: per op, its relative error, squared error and squared norm."""
    by: dict[str, dict] = {}
    for site in sites.sites:
        m = by.setdefault(site.path, {"impact": 0.0, "act": 0.0, "grad": [0.0, 0.0, 0], "half": 0,
                                      "first": site.index})
        e = float(errs[0, site.index])
        if site.backward:
            # Over all the module's backward results at once: a near-zero cotangent (BatchNorm's
            # scale at init) with a large relative error of its own weighs by its size.
            m["grad"][0] += float(errs[1, site.index])
            m["grad"][1] += float(errs[2, site.index])
            m["grad"][2] += 1
        else:
            m["impact"] += float(contrib[site.index])
            m["act"] = max(m["act"], e)
        m["half"] += int(site.half)
    # The share of the gross impact (the sum of |impact|), signed: impacts of opposite signs
    # cancel in the loss, and a share of the net would read 392% and -252% then.
    gross = sum(abs(d["impact"]) for d in by.values())
    sign = -1.0 if total < 0 else 1.0  # positive: the module moves the loss the way the run's error goes
    mods = [ModuleError(p, d["impact"], sign * d["impact"] / gross if gross and total == total else float("nan"), d["act"],
                        _ratio(*d["grad"]), d["half"], d["first"]) for p, d in by.items()]
    # The jump: in program order, the forward op whose error rises most over every op before it
    # (at least 4x); its module is marked.
    best, best_ratio, prev = None, 4.0, 0.0
    for site in sites.sites:
        if site.backward:
            continue
        e = float(errs[0, site.index])
        if prev > 0 and np.isfinite(e) and e / prev > best_ratio:
            best, best_ratio = site.path, e / prev
        if np.isfinite(e):
            prev = max(prev, e)
    return [dataclasses.replace(m, jump=m.path == best) for m in mods]


def _ratio(num: float, den: float, ops: int) -> float:
    if not ops:
        return float("nan")  # no backward op: "-"
    return 0.0 if num == 0 else float(np.sqrt(num) / max(np.sqrt(den), float(np.finfo(np.float32).tiny)))


def _half_dtype(sites: Sites):
    """The coarsest half dtype the program computes in (its rounding sets the noise floor), or None."""
    found = {np.dtype(d) for site in sites.sites for d in _dtypes_of(site.eqn) if _format.is_low_precision(d)}
    return max(found, key=lambda d: float(jnp.finfo(d).eps)) if found else None


def _dtypes_of(eqn) -> list:
    return [a.aval.dtype for a in (*eqn.invars, *eqn.outvars)
            if getattr(getattr(a, "aval", None), "dtype", None) is not None and _floating(a.aval)]


def _without_floating(params: Any) -> str | None:
    """The dtypes of ``params``' leaves when none is floating (nothing to train), else None."""
    from jaxmp.diagnostics._inputs import _floating

    leaves = jax.tree_util.tree_leaves(params)
    if any(_floating(x) for x in leaves):
        return None
    kinds = {str(x.dtype) if hasattr(x, "dtype") else f"a Python {type(x).__name__}, static" for x in leaves}
    return ", ".join(sorted(kinds)) or "no leaves"


def compare_to_float32(fn: Callable, *args, policy: PolicyLike | None = None, steps: int = 0,
                       optimizer: optax.GradientTransformation | None = None,
                       per_op: bool = False, grad: bool | None = None, fix: bool = True,
                       rules: AutocastRules | None = None,
                       choose: bool | Sequence[str] | None = None,
                       search: str = "greedy") -> "ShadowReport | PrecisionPlan":
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
      policy: a preset or policy for ``jaxmp.autocast``; None: ``fn`` runs its own precision
        (a ``jaxmp.autocast`` function is read as its policy and rules: its fix re-wraps
        ``fn.__wrapped__``).
      steps: 0 compares one step. ``k > 0`` first trains both runs ``k`` optimizer steps from the
        same parameters on the same inputs, then compares (some losses only show as drift).
      optimizer: the optax transformation for ``steps`` (default ``optax.adam(1e-3)``).
      per_op: also list every op with its error and loss impact.
      grad: compare gradients too (w.r.t. ``args[0]``). None: when ``fn`` returns a scalar loss.
      fix: under an alarm, write the override for the top offender and measure it (under
        ``policy``); printed only when it closes part of the gap (else "tried: ... made it worse").
      rules: `jaxmp.AutocastRules` for ``jaxmp.autocast`` (with ``policy``); the fix adds to them.
      choose: the precision search instead of one comparison: True (the ladder ``("O2-nvfp4",
        "O2-mxfp8", "O2-bf16", "float32")``) or a ladder of preset names and ``"float32"``,
        cheapest first. Each module (name-scope path) gets the lowest rung that keeps the
        ``steps``-step drift against float32 (default 8 steps) within the debugger's noise band;
        ``policy`` is the preset the rules go with (default ``"O2-bf16"``). See
        docs/precision-search.md.
      search: with ``choose``, the strategy: ``"greedy"`` promotes, from the lowest rungs, the
        module whose promotion shrinks the measured drift most until it is within the band;
        ``"program"`` measures each module at each rung alone and solves an integer program (least
        predicted matmul cost whose summed drift contributions fit the band), then measures that
        choice and promotes greedily from it if it misses (both judge by the twin-run band: the
        strict default); ``"verified"`` judges as ``PrecisionPlan.verify`` and the issue's table
        do: from the lowest rung everywhere, it promotes greedily only while the 3-seed final
        loss (each seed on its own sample of the batch's rows) is outside float32's seed spread
        (at least 1%) at ``steps`` steps. Greedy keeps no promotion that does not shrink the
        drift, and skips a rung that runs a module as the rung below does.

    Returns:
      A `ShadowReport`: ``str()`` starts with the verdict (nothing to fix, or an alarm, with its
      threshold and formula), then the ranked table and, under an alarm, the jump and the fix.
      With ``choose``, a `PrecisionPlan` instead: each module's rung, the matmul FLOPs per rung,
      the drift before and after against the band, the search's cost in training steps, and the
      rules as code (``.rules``, ``.code``, ``.flax_code``).

    Raises:
      TypeError: ``fn`` is not callable or given no inputs, ``steps > 0`` without a scalar loss,
        an ``optimizer`` that is not an optax transformation, ``rules`` not AutocastRules.
      ValueError: ``steps < 0``; ``steps > 0`` or ``grad=True`` when ``args[0]`` holds no floating
        leaf (with ``steps=0`` the report then says no gradient was compared); or an input
        already holds inf/NaN (named).

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
        if choose is not None and choose is not False:
            return _choose(fn, args, policy=policy, steps=steps, optimizer=optimizer, rules=rules, choose=choose, search=search)
        if search != "greedy":
            raise ValueError(f"compare_to_float32: search={search!r} is the precision search's strategy: give choose= too")
        return _compare(fn, args, policy=policy, steps=steps, optimizer=optimizer, per_op=per_op, grad=grad, fix=fix,
                        rules=rules)


def _choose(fn, args, *, policy, steps, optimizer, rules, choose, search):
    from jaxmp.diagnostics import _inputs
    from jaxmp.diagnostics._choose import choose_precision

    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    _inputs.check_optimizer("compare_to_float32", optimizer)
    if rules is not None:
        raise ValueError("compare_to_float32(choose=...) writes the rules itself: drop rules= (give the preset the "
                         "rules go with as policy=)")
    prep = _inputs.prepare("compare_to_float32", fn, args, {})
    fn, args = _inputs.bind_non_floating_params(prep.fn, prep.args)
    source = (prep.fn, tuple(prep.args))
    if _without_floating(args[0] if args else None) is not None or not args:
        raise ValueError("compare_to_float32(choose=...) trains args[0]: pass the floating parameters first, "
                         "compare_to_float32(loss_fn, params, *batch, choose=True)")
    if not _scalar_first(jax.eval_shape(lambda *a: (fn(*a),), *args)[0]):
        raise TypeError("compare_to_float32(choose=...) trains on fn's loss: fn must return a floating scalar first")
    return choose_precision(fn, tuple(args), choose=choose, policy=policy, steps=int(steps), optimizer=optimizer,
                            search=search, source=source)


def _compare(fn, args, *, policy, steps, optimizer, per_op, grad, fix, rules) -> ShadowReport:
    t0 = time.perf_counter()
    from jaxmp.diagnostics import _inputs

    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    steps = int(steps)
    _inputs.check_optimizer("compare_to_float32", optimizer)
    _inputs.check_rules("compare_to_float32", rules)
    if rules is not None and policy is None:
        raise ValueError("compare_to_float32: rules= applies to jaxmp.autocast: give a policy too")
    given = args  # as the user gave them: a Python number in args[0] is static after `prepare`
    prep = _inputs.prepare("compare_to_float32", fn, args, {})
    fn, rewrap = prep.fn, "fn"
    if policy is None:
        from jaxmp.engine._seams import autocast_given

        # A jaxmp.autocast function: the same program as policy= on what it wraps, and its fix is
        # autocast's rule, re-wrapping that function (``fn.__wrapped__``) as the user wrapped it.
        wrapped = autocast_given(fn)
        if wrapped is not None:
            fn, policy, rules = wrapped
            rewrap = "fn.__wrapped__"
    fn, args = _inputs.bind_non_floating_params(fn, prep.args)
    run = fn
    if policy is not None:
        from jaxmp.engine._seams import autocast

        run = autocast(fn, policy, rules=rules)
    has_loss = _scalar_first(jax.eval_shape(lambda *a: (run(*a),), *args)[0])
    if steps and not has_loss:
        raise TypeError("compare_to_float32(steps=k) trains on fn's loss: fn must return a floating scalar first")
    note = prep.note
    fixed = _without_floating((prep.args if prep.note else given)[0]) if given else "no arguments"
    if fixed is not None and (steps or grad):
        # Nothing to train or differentiate: the runs would never move, and every gradient
        # error and trained share would be NaN.
        what = f"steps={steps} trains" if steps else "grad=True differentiates"
        raise ValueError(f"compare_to_float32: {what} args[0], which holds no floating leaf ({fixed}). Pass the "
                         f"floating parameters first, compare_to_float32(fn, params, *batch, ...), or compare one "
                         "forward pass with steps=0, grad=False")
    if fixed is not None and has_loss:
        note = "; ".join(n for n in (note, f"the loss alone (no gradient: args[0] holds no floating leaf, {fixed})")
                         if n)
    grad = has_loss if grad is None else bool(grad and has_loss)
    grad = grad and fixed is None
    step = jax.value_and_grad(run) if grad else run
    prog = _Program(step, args, attribute=has_loss)
    losses, losses_f = (), ()
    half = _half_dtype(prog.sites)
    eval_args = args
    noise = drift = float("nan")
    losses_noise = ()
    tx = None
    if steps:
        import optax

        tx = optax.adam(1e-3) if optimizer is None else optimizer
        rest = tuple(args[1:])
        training = _Training(prog, args[0], rest, steps, tx, half)
        ls = training.losses(0)
        losses, losses_f = tuple(ls[:steps, 0]), tuple(ls[:steps, 1])
        loss_f = float(ls[steps, 1])
        eval_args = (training.policy_params, *rest)
        drift = _drift(ls[:, 0], ls[:, 1])
    p, s, errs, contrib = prog.run(eval_args)
    loss = float(p[0]) if has_loss else float("nan")
    if not steps:
        loss_f = float(s[0]) if has_loss else float("nan")
    total = float(np.sum(contrib)) if has_loss else 0.0
    mods = _modules(prog.sites, errs, contrib, total)
    key = (lambda m: -abs(m.impact)) if has_loss else (lambda m: -m.activation_error)
    mods.sort(key=key)
    grads = ()
    if grad:
        grads = _gradient_errors(jax.tree_util.tree_unflatten(prog.out_tree, list(zip(p, s)))[1])
    ops = ()
    if per_op:
        ops = tuple(sorted(((site, float(errs[0, site.index]), float(contrib[site.index])) for site in prog.sites.sites),
                           key=lambda r: (-abs(r[2]), -r[1])))
    report = ShadowReport(tuple(mods), loss, loss_f, grads, ops, steps, tuple(losses), tuple(losses_f),
                          None, 0.0, None if policy is None else str(policy), noise, drift, losses_noise,
                          note=_mapped_note(prog.sites, note))
    if steps:
        noise, formula = 0.0, "nothing computes in half precision (the policy run is the float32 run)"
        if half is not None:
            # How far rounding-size noise moves each training: the float32 twin from the float32
            # run, the policy twin from the policy run. Chaotic training moves both far.
            tw = training.losses(1)
            noise = max(_drift(tw[:, 1], ls[:, 1]), _drift(tw[:, 0], ls[:, 0]))
            report = dataclasses.replace(report, noise_floor=noise, losses_noise=(tuple(tw[:, 0]), tuple(tw[:, 1])))
            formula = (f"how far twin runs from parameters perturbed by half a {_format.short_dtype(half)} ulp "
                       f"drift in {steps} steps (the noise floor)")
        error = drift
    else:
        noise, formula = _one_step_noise(prog, eval_args, s[0], half)
        error = report.loss_error if has_loss else _relerr(p[0], s[0])
    report = dataclasses.replace(report, error=error, noise=noise, threshold=NOISE_MARGIN * noise,
                                 noise_formula=formula)
    # A fix only for an alarm: within rounding noise there is nothing to fix, and a fix measured
    # there would be measured against noise.
    if fix and has_loss and mods and mods[0].path and np.isfinite(loss) and not report.within_noise:
        scoped = any(site.path == mods[0].path and not site.from_param for site in prog.sites.sites)
        suggested = suggest_fix(fn, args, policy, mods[0].path, report.loss_error, report.loss_float32,
                                steps, tx, scoped, rules=rules, paths=[m.path for m in mods], wraps=rewrap)
        report = dataclasses.replace(report, fix=suggested)
    return dataclasses.replace(report, seconds=time.perf_counter() - t0)
