"""jaxmp chooses the precision: the cheapest matmul format per module that keeps training within
float32's noise, found by measurement (``compare_to_float32(..., choose=ladder)``).

The band is the debugger's k-step noise threshold (jaxmp/diagnostics/_noise.py): `NOISE_MARGIN`
times the drift of a float32 twin run from parameters perturbed by up to half an ulp of the
compute dtype, whose gradients are perturbed by up to half an ulp at every step (its twins'
machinery, `_perturb` and `_noisy`, sized by the compute dtype's rounding rather than by a policy
run's error, so that the band is float32's and a sensitive layer does not widen it). Each module (the name-scope
path of its matmuls) starts at the ladder's lowest rung; while the whole run's k-step drift against
float32 is outside the band, each module below the top is measured one rung up, and the one whose
promotion shrinks the drift most (its measured share of the drift) is promoted; the drift is
re-measured after each promotion; a promotion that does not shrink it is not kept, and a rung that
traces to the same program as the one below is skipped for that module. ``search="verified"``
runs the same promotion judged by float32's seed spread instead (jaxmp/diagnostics/_seeded.py).
See docs/precision-search.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _jaxpr
from jaxmp._typing import PyTree
from jaxmp.diagnostics import _cost, _format, _program, _seeded
from jaxmp.diagnostics._matmul import conv_gemm, dot_gemm
from jaxmp.diagnostics._noise import NOISE_MARGIN, drift
from jaxmp.diagnostics._shadow_steps import _noisy, _perturb
from jaxmp.diagnostics._verify import Verification

if TYPE_CHECKING:  # the engine and optax are imported where they are used (the diagnostics load them lazily)
    import optax

    from jaxmp.engine._seams import AutocastRules

#: The default ladder, cheapest first: NVFP4, MXFP8, bf16, float32.
DEFAULT_LADDER = ("O2-nvfp4", "O2-mxfp8", "O2-bf16", "float32")
#: Training steps per measurement when ``steps=0`` is given with ``choose``.
DEFAULT_STEPS = 8
#: The search strategies of ``compare_to_float32(choose=..., search=...)``.
SEARCHES = ("greedy", "program", "verified")
_MARKERS = ("jaxmp[", "jaxmp.rule=")


@dataclasses.dataclass(frozen=True)
class ModuleRung:
    """One module's place on the ladder.

    Attributes:
      path: the name-scope path of its matmuls (joined by ``"/"``).
      rung: the ladder rung it was given (a preset name, or ``"float32"``).
      flops: its forward matmul and convolution FLOPs per step (a scanned body's times its length).
      scanned: its matmuls are inside a ``lax.scan``: one path for every layer of the stack.
    """

    path: str
    rung: str
    flops: int
    scanned: bool = False


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """What ``compare_to_float32(..., choose=ladder)`` returns: each module's rung, as code.

    Attributes:
      modules: `ModuleRung` per module, in program order.
      ladder: the rungs, cheapest first.
      policy: the policy the rules go with (``jaxmp.autocast(fn, policy, rules=rules)``).
      rules: the chosen `jaxmp.AutocastRules` (None when the search gave up).
      code: the rules as code to paste (with the ``jaxmp.autocast`` call).
      flax_code: the same rules spelled for the Flax door (module paths as the scopes' paths).
      steps: training steps per measurement.
      noise: the float32 twin's drift (the noise the band is built from); with
        ``search="verified"``, float32's 3-seed spread of final losses over their mean.
      threshold: ``NOISE_MARGIN * noise``: the band; with ``search="verified"``,
        ``max(noise, 1%)``, the drift then being ``|mean final loss - float32's| / float32's``.
      drift_before: the drift with every module at the lowest rung.
      drift_after: the drift of the chosen rules (as measured for the last promotion).
      promotions: ``((path, from rung, to rung, drift after), ...)`` in order.
      cost_steps: training steps run in all (every measurement's ``steps``, the references' too).
      seconds: wall time of the search.
      unscoped_flops: matmul FLOPs outside any name scope (they run in ``policy``; a rule cannot
        reach them).
      gave_up: why no rules were chosen ("" when they were).
      search: the strategy, ``"greedy"``, ``"program"`` or ``"verified"``.
      contributions: ``((path, rung, drift), ...)``: with ``search="program"``, each module's drift
        measured at each rung below the top, every other module at the top.
      floor: with ``search="program"``, the drift with every module at the top rung.
      predicted_drift: with ``search="program"``, ``floor`` plus the chosen rungs' contributions
        (the program's prediction; ``drift_after`` is the measurement).
      verification: a `Verification` once `verify` ran (None before).
    """

    modules: tuple[ModuleRung, ...]
    ladder: tuple[str, ...]
    policy: str
    rules: AutocastRules | None
    code: str
    flax_code: str
    steps: int
    noise: float
    threshold: float
    drift_before: float
    drift_after: float
    promotions: tuple = ()
    cost_steps: int = 0
    seconds: float = 0.0
    unscoped_flops: int = 0
    gave_up: str = ""
    search: str = "greedy"
    contributions: tuple = ()
    floor: float = float("nan")
    predicted_drift: float = float("nan")
    verification: Verification | None = None
    # (fn, args, optimizer) of the search, for verify(): not part of the plan's value.
    source: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def within_band(self) -> bool:
        """The chosen rules' drift is within the band."""
        return not self.gave_up and bool(self.drift_after <= self.threshold)

    def flop_shares(self) -> dict[str, float]:
        """The share of matmul FLOPs at each rung (the unscoped ones at ``policy``)."""
        total = sum(m.flops for m in self.modules) + self.unscoped_flops
        out = {r: 0.0 for r in self.ladder}
        for m in self.modules:
            out[m.rung] = out.get(m.rung, 0.0) + m.flops / max(total, 1)
        if self.unscoped_flops:
            out[self.policy] = out.get(self.policy, 0.0) + self.unscoped_flops / max(total, 1)
        return out

    def verify(self, init_params: Callable[[int], PyTree] | PyTree | None = None,
               batches: Callable[[int], Iterable[Any]] | Sequence[Any] | None = None, *, seeds: Sequence[int] = (0, 1, 2),
               steps: int | None = None, optimizer: optax.GradientTransformation | None = None) -> PrecisionPlan:
        """Trains float32 and the chosen rules for the same steps per seed; returns the plan with `verification`.

        Each seed trains the loss the search measured twice, as given (float32) and under
        ``jaxmp.autocast(fn, policy, rules=rules)``, from the same parameters on the same batches;
        a run's final loss is the float32 loss of its trained parameters on its last batch. The
        rules are within when ``|mean(rules) - mean(float32)| <= max(float32's seed spread (max -
        min), 1% of |mean(float32)|)`` (benchmarks/fidelity.py's verdict). Deterministic for the
        given seeds.

        Args:
          init_params: ``seed -> params`` (e.g. ``lambda s: model.init(jax.random.key(s), x)["params"]``),
            or one set of parameters for every seed, or None: the search's.
          batches: ``seed -> iterable of batches``, or one sequence of batches for every seed, or
            None: the search's batch at every step. A batch is the arguments after the parameters:
            a tuple ``(x, y)``, or one array for ``fn(params, x)``. At least one of ``init_params``
            and ``batches`` must be a function of the seed, or the seeds would change nothing.
          seeds: at least two ints.
          steps: optimizer steps per run (default: the search's ``steps``).
          optimizer: an optax transformation (default: the search's).

        Returns:
          A copy of this plan with ``verification`` set; ``str()`` prints it.

        Raises:
          ValueError: the search gave up (no rules), no seed-dependent input, fewer than two
            seeds, ``steps < 1``, or fewer batches than ``steps``.
          TypeError: ``optimizer`` is not an optax transformation.

        Example:
          >>> import jax, jax.numpy as jnp, optax
          >>> from jaxmp.diagnostics import compare_to_float32
          >>> def loss(p, x):
          ...     with jax.named_scope("layer"):
          ...         return jnp.mean(jnp.square(x @ p["w"] - 1.0))
          >>> plan = compare_to_float32(
          ...     loss, {"w": jnp.zeros((4, 2))}, jnp.ones((8, 4)),
          ...     choose=("O2-bf16", "float32"), steps=2, optimizer=optax.sgd(0.1))
          >>> def init(seed):
          ...     return {"w": 0.1 * jax.random.normal(jax.random.key(seed), (4, 2))}
          >>> plan = plan.verify(init)
          >>> plan.verification.within
          True
        """
        from jaxmp.diagnostics import _inputs, _verify

        if self.rules is None or self.source is None:
            raise ValueError(f"PrecisionPlan.verify: the search chose no rules to verify ({self.gave_up or 'no source'})")
        _inputs.check_optimizer("PrecisionPlan.verify", optimizer)
        fn, args, tx = self.source
        record = _verify.verify(fn, self.policy, self.rules, args[0], tuple(args[1:]), init_params=init_params,
                                batches=batches, seeds=seeds, steps=self.steps if steps is None else steps,
                                optimizer=tx if optimizer is None else optimizer)
        return dataclasses.replace(self, verification=record)

    def predicted_speedup(self, device: str | jax.Device = "H100") -> _cost.SpeedupPrediction:
        """The chosen rungs' matmul time against all bf16 and all float32, predicted from datasheet peaks.

        Each module's matmul FLOPs run at the dense peak of its rung's format on ``device``
        (`jaxmp.diagnostics._cost.DATASHEET_TFLOPS`, sources cited there): ``"float32"`` as TF32
        (JAX's default matmul precision on NVIDIA GPUs; one bf16 pass on a TPU), a rung with no fp8
        recipe in the policy's half dtype, fp8/MXFP8/NVFP4 at the device's fp8/fp4 peak, and a
        format the device lacks at the half dtype's peak (jaxmp emulates it there). A prediction,
        not a measurement: memory traffic, quantize passes and non-matmul ops are not counted.

        Args:
          device: ``"H100"``, ``"H200"``, ``"B200"``, ``"TPU v5p"``, a ``device_kind`` naming one,
            or a ``jax.Device``.

        Returns:
          A `SpeedupPrediction` (``vs_bf16``, ``vs_float32``, ``priced_as``; ``str()`` says it is predicted).

        Raises:
          ValueError: a device with no datasheet entry.

        Example:
          >>> import jaxmp
          >>> from jaxmp.diagnostics import PrecisionPlan, ModuleRung
          >>> modules = (ModuleRung("mlp", "O2-nvfp4", 3000),
          ...            ModuleRung("head", "O2-bf16", 1000))
          >>> plan = PrecisionPlan(modules, ("O2-nvfp4", "O2-bf16", "float32"), "O2-bf16",
          ...                      jaxmp.AutocastRules(), "", "", 4, 0.0, 0.0, 0.0, 0.0)
          >>> # 4000/2250 / (3000/9000 + 1000/2250):
          >>> round(plan.predicted_speedup("B200").vs_bf16, 3)
          2.286
        """
        rows = [(m.rung, m.flops) for m in self.modules]
        if self.unscoped_flops:
            rows.append((self.policy, self.unscoped_flops))
        return _cost.predict(rows, _compute(self.policy), device)

    def table(self) -> str:
        """The report: verdict, modules with their rungs, FLOP shares, cost, the code, the predicted
        speed-ups and, once `verify` ran, the verification."""
        if self.search == "verified":
            band = (f"drift = |mean final loss - float32's| / float32's over {len(_seeded.SEEDS)} seeds, band = "
                    f"max(float32's seed spread {self.noise:.3g}, {_seeded.REL_FLOOR:g}) = {self.threshold:.3g}")
        else:
            band = f"band = {NOISE_MARGIN:g} x float32 twin drift {self.noise:.3g} = {self.threshold:.3g}"
        head = (f"choose precision ({' < '.join(self.ladder)}), {self.search} search, {self.steps} steps per "
                f"measurement: {band}")
        out = [_format.wrap(head)]
        verdict = f"({'within' if self.within_band else 'outside'} the band)"
        if self.gave_up:
            out.append(_format.wrap(f"gave up: {self.gave_up}"))
        elif self.search == "program":
            out.append(_format.wrap(f"drift vs float32: {self.floor:.3g} with every module at {self.ladder[-1]}; with "
                                    f"the chosen rules {self.predicted_drift:.3g} predicted (that plus the chosen "
                                    f"rungs' contributions), {self.drift_after:.3g} measured {verdict}"))
        else:
            out.append(_format.wrap(f"drift vs float32: {self.drift_before:.3g} with every module at "
                                    f"{self.ladder[0]}, {self.drift_after:.3g} with the chosen rules {verdict}"))
        total = sum(m.flops for m in self.modules) + self.unscoped_flops
        rows = [[_format.fold_path(m.path, 28), m.rung, _format.fmt_pct(m.flops / max(total, 1)),
                 "scanned: one path, every layer" if m.scanned else ""] for m in self.modules]
        if self.unscoped_flops:
            rows.append(["(no scope)", self.policy, _format.fmt_pct(self.unscoped_flops / max(total, 1)),
                         "add a jax.named_scope to place it"])
        out.append(_format.render_table("Modules", ["module", "rung", "FLOPs", ""], rows, None, _format.WIDTH))
        shares = ", ".join(f"{r} {_format.fmt_pct(s)}" for r, s in self.flop_shares().items())
        out.append(f"matmul FLOPs per rung: {shares}")
        by: dict[str, list[str]] = {}
        for path, rung, d in self.contributions:
            by.setdefault(path, []).append(f"{rung} {d:.3g}")
        for path, got in by.items():
            out.append(_format.wrap(f"  alone (the rest at {self.ladder[-1]}): {path}: {', '.join(got)}"))
        for i, (path, a, b, d) in enumerate(self.promotions):
            what = "the program missed; promotion" if self.search == "program" else "promotion"
            out.append(f"  {what} {i + 1}: {path} {a} -> {b}, drift {d:.3g}")
        out.append(_format.wrap(f"search cost: {self.cost_steps} training steps ({self.seconds:.1f} s)"))
        if self.code:
            out.append(self.code)
        if self.flax_code:
            out.append("# the Linen door (the scopes as module paths, the root's name dropped):\n" + self.flax_code)
        if self.rules is not None:
            out.append(f"matmul speed-up of the chosen rules, {_cost.NOTE}:")
            for device in _cost.DEVICES:
                pred = self.predicted_speedup(device)
                out.append(f"  {device:8s} {pred.vs_bf16:.2f}x vs bf16, {pred.vs_float32:.2f}x vs float32")
        if self.verification is not None:
            out.append(self.verification.table())
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


# -- the modules ------------------------------------------------------------------------------

def _module_flops(fn: Callable, args: tuple) -> tuple[dict[str, list], int]:
    """``{path: [flops, scanned, first position]}`` of the forward matmuls, and the unscoped FLOPs."""
    closed = jax.make_jaxpr(fn)(*args)
    found: dict[str, list] = {}
    loose = [0]
    order = [0]

    def walk(jaxpr, prefix: tuple, times: int, scanned: bool):
        for eqn in _jaxpr.equations(jaxpr):
            # jnp.einsum names a scope after its spec ("btd,bsd->bts"): not a module, its matmul is its caller's.
            comps = prefix + tuple(c for c in _jaxpr.scope_names(eqn) if not c.startswith(_MARKERS) and "->" not in c)
            name = eqn.primitive.name
            if name in ("dot_general", "conv_general_dilated"):
                lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
                if name == "dot_general":
                    gemm = dot_gemm(lhs, rhs, eqn.params["dimension_numbers"])
                else:
                    gemm = conv_gemm(lhs, rhs, eqn.outvars[0].aval.shape, eqn.params["dimension_numbers"],
                                     eqn.params.get("feature_group_count", 1), eqn.params.get("batch_group_count", 1))
                flops = gemm.flops * times
                if not comps:
                    loose[0] += flops
                else:
                    row = found.setdefault("/".join(comps), [0, False, order[0]])
                    row[0] += flops
                    row[1] = row[1] or scanned
                order[0] += 1
            for sub in _jaxpr.sub_jaxprs(eqn, opened=True):
                inner = name == "scan"
                walk(sub, comps, times * (int(eqn.params.get("length", 1)) if inner else 1), scanned or inner)

    walk(closed.jaxpr, (), 1, False)
    return found, loose[0]


# -- training ---------------------------------------------------------------------------------

class _Trainer:
    """k optimizer steps of a loss from fixed parameters on a fixed batch; counts the steps run."""

    def __init__(self, params, rest: tuple, steps: int, tx):
        self.params, self.rest, self.steps, self.tx = params, rest, steps, tx
        self.cost = 0

    def losses(self, loss_fn: Callable, params=None, sizes=None) -> np.ndarray:
        """``[steps + 1]`` losses (the last after the last step); ``sizes``: the twin's gradient noise."""
        import optax

        tx = self.tx

        @jax.jit
        def step(q, o, i, rest):
            loss, g = jax.value_and_grad(loss_fn)(q, *rest)
            if sizes is not None:
                g = _noisy(g, sizes, jax.random.fold_in(jax.random.key(1), i))
            u, o = tx.update(g, o, q)
            return jnp.asarray(loss, jnp.float32), optax.apply_updates(q, u), o

        q = self.params if params is None else params
        o = tx.init(q)
        out = []
        for i in range(self.steps + 1):
            loss, q2, o2 = step(q, o, np.int32(i), self.rest)
            out.append(loss)
            if i < self.steps:
                q, o = q2, o2
        self.cost += self.steps
        return np.asarray(jax.device_get(out), np.float64)


def _band(trainer: _Trainer, base: str, fn: Callable, ref: np.ndarray) -> float:
    """The float32 twin's drift: from parameters perturbed by up to half an ulp of the compute
    dtype, each step's gradient perturbed by up to half an ulp too: float32's own noise at the
    compute dtype's rounding, the same for every model (not sized by the policy run's error, which
    a sensitive layer would inflate, and the band with it)."""
    from jaxmp._precision._presets import resolve_policy

    half = np.dtype(resolve_policy(base)[0].compute_dtype)
    if half.itemsize >= 4:
        return 0.0
    rel = float(jnp.finfo(half).eps) / 2
    n = len(jax.tree_util.tree_leaves(trainer.params))
    # _noisy multiplies by 1 + sqrt(3) * size * uniform(-1, 1): size rel / sqrt(3) is up to half an ulp.
    sizes = np.full((max(n, 1),), rel / np.sqrt(3.0), np.float32)
    return drift(trainer.losses(fn, _perturb(trainer.params, rel, 1), sizes), ref)


# -- rules ------------------------------------------------------------------------------------

def _is_base(rung: str, base: str) -> bool:
    from jaxmp.engine._seams import matmul_format

    return rung == base or (rung != "float32" and matmul_format(rung)[1] is None)


def _rules_of(assign: dict[str, str], base: str):
    from jaxmp.engine._seams import AutocastRules

    rules = AutocastRules()
    for path, rung in assign.items():
        if not _is_base(rung, base):
            rules = rules.with_scope(path, rung)
    return rules


def _door_paths(paths: list[str]) -> dict[str, str]:
    """Scope paths as the Flax door's module paths: Linen names its scopes from the root module's
    class (``MLP/l1``) while the door's paths are relative to the wrapped model (``l1``), so a
    first component every path shares is dropped."""
    parts = [p.split("/") for p in paths]
    if parts and all(len(q) > 1 and q[0] == parts[0][0] for q in parts):
        return {p: "/".join(q[1:]) for p, q in zip(paths, parts)}
    return {p: p for p in paths}


def _code(assign: dict[str, str], base: str, method: str, wrap: str) -> str:
    names = _door_paths(list(assign)) if method == "with_path" else {p: p for p in assign}
    calls = [f".{method}({names[p]!r}, {r!r})" for p, r in assign.items() if not _is_base(r, base)]
    body = "rules = (jaxmp.AutocastRules()" + "".join(f"\n         {c}" for c in calls) + ")"
    return body + "\n" + wrap


def _check_ladder(choose: Any) -> tuple[str, ...]:
    from jaxmp.engine._seams import matmul_format

    ladder = DEFAULT_LADDER if choose is True else choose
    if isinstance(ladder, str) or not isinstance(ladder, (tuple, list)) or len(ladder) < 2:
        raise TypeError(f"compare_to_float32(choose=...): True (the ladder {DEFAULT_LADDER}) or a tuple of at least "
                        f"two rungs, cheapest first, got {choose!r}")
    for rung in ladder:
        if rung != "float32" and not (isinstance(rung, str) and matmul_format(rung)[0]):
            raise ValueError(f"compare_to_float32(choose=...): each rung is a preset name such as 'O2-nvfp4', "
                             f"'O2-mxfp8', 'O2-bf16', or 'float32', got {rung!r}")
    if len(set(ladder)) != len(ladder):
        raise ValueError(f"compare_to_float32(choose=...): a rung repeats in {tuple(ladder)!r}")
    return tuple(ladder)


# -- the search -------------------------------------------------------------------------------

def _compute(base: str) -> str:
    """The policy's half dtype as the cost model names it (``"bf16"``, ``"fp16"``)."""
    from jaxmp._precision._presets import resolve_policy

    d = np.dtype(resolve_policy(base)[0].compute_dtype)
    return "fp16" if d == np.dtype(np.float16) else "bf16"


def _check_search(search: Any) -> str:
    if search not in SEARCHES:
        raise ValueError(f"compare_to_float32(choose=..., search=...): one of {', '.join(map(repr, SEARCHES))}, "
                         f"got {search!r}")
    return str(search)


def choose_precision(fn: Callable, args: tuple, *, choose: Any, policy: Any, steps: int, optimizer: Any,
                     search: str = "greedy", source: tuple | None = None) -> PrecisionPlan:
    """The search behind ``compare_to_float32(fn, *args, choose=ladder, steps=k, search=...)`` (see there).

    ``source``: ``(fn, args)`` as the user gave them (non-floating leaves of ``args[0]`` included),
    kept on the plan for `PrecisionPlan.verify`."""
    import optax

    from jaxmp.engine._seams import autocast

    t0 = time.perf_counter()
    ladder = _check_ladder(choose)
    search = _check_search(search)
    base = "O2-bf16" if policy is None else policy
    if not isinstance(base, str):
        raise TypeError(f"compare_to_float32(choose=...): policy is the preset the rules go with, a name such as "
                        f"'O2-bf16', got {base!r}")
    steps = steps or DEFAULT_STEPS
    found, loose = _module_flops(fn, args)
    paths = sorted(found, key=lambda p: found[p][2])
    tx = optax.adam(1e-3) if optimizer is None else optimizer
    trainer = _Trainer(args[0], tuple(args[1:]), steps, tx)
    ref = trainer.losses(fn)
    extra: dict[str, Any] = {"search": search, "source": (*(source or (fn, args)), tx)}

    def plan(assign, noise, before, after, promotions, gave_up="", rules=None, threshold=None):
        mods = tuple(ModuleRung(p, assign[p], found[p][0], found[p][1]) for p in paths)
        call = f"step_loss = jaxmp.autocast(loss_fn, {base!r}, rules=rules)"
        door = f"model = jaxmp.flax.mixed_precision(model, {base!r}, rules=rules)"
        code = _code(assign, base, "with_scope", call) if rules is not None else ""
        flax_code = _code(assign, base, "with_path", door) if rules is not None else ""
        band = NOISE_MARGIN * noise if threshold is None else threshold
        return PrecisionPlan(mods, ladder, base, rules, code, flax_code, steps, noise, band, before,
                             after, tuple(promotions), trainer.cost, time.perf_counter() - t0, loose, gave_up, **extra)

    lowest = {p: ladder[0] for p in paths}
    if not np.all(np.isfinite(ref)):
        return plan(lowest, float("nan"), float("nan"), float("nan"), (),
                    f"the float32 run itself does not stay finite in {steps} steps (losses {ref[0]:.4g} -> "
                    f"{ref[-1]:.4g}): a diverging model is not a precision problem; lower the learning rate first")
    if not paths:
        return plan(lowest, float("nan"), float("nan"), float("nan"), (),
                    "no matmul is inside a name scope, so no rule can place one: wrap each layer in "
                    "`with jax.named_scope('layer_name'):` (Flax Linen modules name theirs; NNX and plain JAX need "
                    "it by hand)")
    if search == "verified":
        rests = _seeded.seed_batches(trainer.rest)
        if rests is None:
            return plan(lowest, float("nan"), float("nan"), float("nan"), (),
                        "search='verified' draws each seed's sample from the batch's leading axis, and no batch "
                        "argument has one of size >= 2: give a batch of examples, or use search='greedy'")
        check = _seeded.SeedCheck(trainer, fn, rests)
        noise, threshold = check.relative_spread, check.band

        def measure(assign) -> float:
            return check.gap(autocast(fn, base, rules=_rules_of(assign, base)))
    else:
        noise = _band(trainer, base, fn, ref)
        threshold = NOISE_MARGIN * noise

        def measure(assign) -> float:
            return drift(trainer.losses(autocast(fn, base, rules=_rules_of(assign, base))), ref)

    def finish(assign, before, current, promotions, gave_up=""):
        rules = None if gave_up else _rules_of(assign, base)
        return plan(assign, noise, before, current, promotions, gave_up, rules, threshold)

    def give_up(current: float) -> str:
        return (f"even {ladder[-1]} at every module leaves a drift of {current:.3g} > band {threshold:.3g}: what is "
                "left runs outside the modules (unscoped ops under the policy) or is not a precision problem")

    same = _SameProgram(fn, args, base)
    promotions: list[tuple[str, str, str, float]] = []
    top = {p: ladder[-1] for p in paths}
    if search == "program":
        floor = measure(top)
        if not floor <= threshold:
            return finish(top, float("nan"), floor, promotions, give_up(floor))
        rows: list[tuple[str, str, float]] = []
        options: list[list[tuple[float, float]]] = []
        cost = _rung_costs(ladder, base)
        for p in paths:
            opts: list[tuple[float, float]] = []
            for i, rung in enumerate(ladder[:-1]):
                if i and same({**top, p: rung}, {**top, p: ladder[i - 1]}):
                    d = rows[-1][2]  # compiles to the rung below's program: its measurement, not a new one
                else:
                    d = measure({**top, p: rung})
                rows.append((p, rung, d))
                opts.append((found[p][0] * cost[rung], max(d - floor, 0.0) if np.isfinite(d) else float("inf")))
            opts.append((found[p][0] * cost[ladder[-1]], 0.0))
            options.append(opts)
        pick = _program.solve(options, threshold - floor)
        assign = top if pick is None else {p: ladder[i] for p, i in zip(paths, pick)}
        predicted = floor + sum(options[k][ladder.index(assign[p])][1] for k, p in enumerate(paths))
        extra.update(contributions=tuple(rows), floor=floor, predicted_drift=predicted)
        before = float("nan")
        current = measure(assign) if assign != top else floor
    else:
        assign = dict(lowest)
        current = before = measure(assign)
    # greedy (and the verified search): from the lowest rungs, or from the program's choice when it missed
    while not current <= threshold:
        trials = []
        for p in paths:
            up = same.next_rung(assign, p, ladder)
            if up is not None:
                trials.append((measure({**assign, p: up}), p, up))
        best = _best(trials, paths)
        if best is None or not best[0] < current:
            # No single one-rung promotion shrinks the drift: try each module at the top rung at once
            # (a rung between may change nothing), and stop when that does not either.
            jumps = [(measure({**assign, p: ladder[-1]}), p, ladder[-1]) for p in paths
                     if assign[p] != ladder[-1] and not any(t[1] == p and t[2] == ladder[-1] for t in trials)]
            best = _best(jumps + trials, paths)
        if best is None or not best[0] < current:
            if assign == top:
                return finish(assign, before, current, promotions, give_up(current))
            everything = measure(top)
            if not everything <= threshold:
                return finish(top, before, everything, promotions, give_up(everything))
            what = "no module can move" if best is None else f"the best, {best[1]} to {best[2]}, gives {best[0]:.3g}"
            return finish(assign, before, current, promotions,
                          f"no single promotion shrinks the drift {current:.3g} ({what}) while {ladder[-1]} at every "
                          f"module is within the band ({everything:.3g}): the drift is no one module's; try "
                          "search='program' or more steps")
        d, p, up = best
        promotions.append((p, assign[p], up, d))
        assign[p] = up
        current = d
    return finish(assign, before, current, promotions)


def _best(trials: list, paths: list[str]):
    """The trial with the least measured drift (program order on ties), or None."""
    if not trials:
        return None
    return min(trials, key=lambda t: (t[0] if np.isfinite(t[0]) else np.inf, paths.index(t[1])))


class _SameProgram:
    """Whether two assignments trace to the same program (a rung that runs a module's ops exactly
    as the one below, e.g. convolutions under NVFP4 and MXFP8, both per-tensor E4M3): such a rung
    is one rung for that module, skipped rather than measured."""

    def __init__(self, fn: Callable, args: tuple, base: str):
        self.fn, self.args, self.base = fn, args, base
        self._text: dict[tuple, str] = {}

    def text(self, assign: dict[str, str]) -> str:
        from jaxmp.engine._seams import autocast

        key = tuple(sorted(assign.items()))
        if key not in self._text:
            self._text[key] = str(jax.make_jaxpr(autocast(self.fn, self.base, rules=_rules_of(assign, self.base)))(
                *self.args))
        return self._text[key]

    def __call__(self, a: dict[str, str], b: dict[str, str]) -> bool:
        return a == b or self.text(a) == self.text(b)

    def next_rung(self, assign: dict[str, str], path: str, ladder: tuple[str, ...]) -> str | None:
        """The next rung up for ``path`` that changes its program (None at the top)."""
        for rung in ladder[ladder.index(assign[path]) + 1:]:
            if not self(assign, {**assign, path: rung}):
                return rung
        return None


def _rung_costs(ladder: tuple[str, ...], base: str) -> dict[str, float]:
    """Seconds per TFLOP of each rung on the program's cost device (its datasheet peaks)."""
    compute = _compute(base)
    return {r: 1.0 / _cost.rate(_program.COST_DEVICE, _cost.rung_kind(r, compute), compute)[0] for r in ladder}
