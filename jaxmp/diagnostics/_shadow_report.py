"""What `compare_to_float32` returns: `ShadowReport`, its verdict and its `ModuleError` rows.

The report of the float32 shadow run (jaxmp/diagnostics/_shadow.py): the verdict against the
measured rounding noise first, the modules ranked by their share of the loss error, the fix when
one was measured. See docs/debugging.md#a-float32-shadow-run-ranked-by-module.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxmp.diagnostics import _format
from jaxmp.diagnostics._fix import Fix
from jaxmp.diagnostics._noise import NOISE_MARGIN

#: Module paths fold at "/" to this width in the tables (never mid-name).
_PATH_COLUMN = 28


@dataclasses.dataclass(frozen=True)
class ModuleError:
    """The error of one module (name-scope path) of the policy run against its float32 shadow.

    Attributes:
      path: the module path.
      impact: the loss error its ops' own rounding causes (first-order estimate; signed).
      share: ``impact`` over the sum of every module's ``|impact|``, positive when it moves the
        loss the way the run's error goes (modules of the other sign cancel part of it; the
        shares' magnitudes add up to 100%; NaN without a loss).
      activation_error: the largest relative error of its forward ops' results.
      gradient_error: the relative error of its backward ops' results taken together (the RMS of
        their errors over the RMS of their float32 values; NaN: none).
      half_ops: how many of its ops compute or round in half precision.
      first_site: its first op's position in the program (program order).
      jump: the point where the error jumps (the largest rise over the modules before it).
    """

    path: str
    impact: float
    share: float
    activation_error: float
    gradient_error: float
    half_ops: int
    first_site: int
    jump: bool = False


@dataclasses.dataclass(frozen=True)
class ShadowReport:
    """What `compare_to_float32` returns.

    Attributes:
      modules: per-module errors, ranked (largest loss impact first; by activation error when
        the function has no scalar loss).
      loss: the policy run's loss (first output), NaN without one.
      loss_float32: the float32 shadow's loss.
      gradient_errors: ``((param path, error), ...)`` of the gradients, largest first: the RMS of
        the leaf's error over the RMS of the whole float32 gradient (a near-zero gradient's
        relative error is no alarm).
      ops: per-op rows ``(site, relative error, impact)`` when ``per_op=True``, else ().
      steps: optimizer steps both runs took before the comparison (0: one step).
      losses, losses_float32: the loss at each of those steps (policy, float32).
      fix: the `Fix` for the top offender, measured, under an alarm only (None within noise).
      seconds: wall time of the comparison.
      policy: the policy it ran under (str), or None when ``fn`` runs its own precision.
      noise_floor: for ``steps=k``, the `drift` of float32 runs whose gradients get, at every
        step, random noise as large as the policy run's gradient error on the first step (the larger
        of the two twins' drifts): how far noise of the policy's size, without its bias,
        moves training in ``k`` steps (NaN for one step).
      drift: for ``steps=k``, the relative gap of the policy run's mean loss to the float32
        shadow's over the last half of the steps (``k//2 .. k``, the loss after the last step
        included); NaN for one step.
      losses_noise: the noisy float32 runs' losses (one tuple per seed, ``k+1`` each).
      note: what was compared instead of ``fn`` (a jaxmp step: the loss it wraps), or "".
      error: what the verdict reads: the loss's relative error (one step; the first output's
        without a loss) or `drift` (``steps=k``).
      noise: the rounding noise it is compared with: one step, the RMS relative change of the
        float32 shadow's loss over `NOISE_SEEDS` runs whose half-precision ops' results are
        perturbed by up to half an ulp of the half dtype; ``steps=k``, `noise_floor`; 0 when
        nothing computes in half precision.
      threshold: ``NOISE_MARGIN * noise``: an error above it is an alarm.
      noise_formula: how ``noise`` was measured, in words.
    """

    modules: tuple[ModuleError, ...]
    loss: float
    loss_float32: float
    gradient_errors: tuple[tuple[str, float], ...]
    ops: tuple = ()
    steps: int = 0
    losses: tuple[float, ...] = ()
    losses_float32: tuple[float, ...] = ()
    fix: Fix | None = None
    seconds: float = 0.0
    policy: str | None = None
    noise_floor: float = float("nan")
    drift: float = float("nan")
    losses_noise: tuple[tuple[float, ...], ...] = ()
    note: str = ""
    error: float = float("nan")
    noise: float = float("nan")
    threshold: float = float("nan")
    noise_formula: str = ""

    @property
    def within_noise(self) -> bool:
        """The verdict: the error is within ``NOISE_MARGIN`` times the rounding noise (nothing to fix)."""
        return bool(np.isfinite(self.error) and np.isfinite(self.threshold) and self.error <= self.threshold)

    @property
    def verdict(self) -> str:
        """The report's first line: nothing to fix, or an alarm, with the threshold and its formula."""
        what = "drift" if self.steps else ("loss error" if np.isfinite(self.loss) else "output error")
        if not np.isfinite(self.threshold):
            return f"verdict: no verdict: {what} {self.error:.3g}"
        head = "nothing to fix (within rounding noise)" if self.within_noise else "ALARM: beyond rounding noise"
        sign = "<=" if self.within_noise else ">"
        if self.noise == 0:
            return f"verdict: {head}: {what} {self.error:.3g} {sign} threshold 0: {self.noise_formula}"
        return (f"verdict: {head}: {what} {self.error:.3g} {sign} threshold {self.threshold:.3g} = "
                f"{NOISE_MARGIN:g} x {self.noise:.3g}, {self.noise_formula}")

    @property
    def loss_error(self) -> float:
        """``|loss - loss_float32| / |loss_float32|``."""
        return abs(self.loss - self.loss_float32) / max(abs(self.loss_float32), 1e-30)

    @property
    def top(self) -> ModuleError | None:
        """The top offender (first of `modules`), or None."""
        return self.modules[0] if self.modules else None

    def clean(self, tolerance: float | None = None) -> bool:
        """No alarm. ``tolerance`` None: the `verdict` (`within_noise`); else the loss is within
        ``tolerance`` (relative) of float32's.

        After ``k`` training steps two runs drift apart by rounding alone (trajectories that
        overfit a batch at a high learning rate oscillate and diverge chaotically), so the k-step
        verdict reads the `drift` (mean loss over the last half of the steps, not one step's
        loss) and allows ``NOISE_MARGIN * noise_floor`` too: a drift the size that
        half-precision rounding noise gives float32 runs is not an alarm; a systematic loss (a
        narrowed bias) stays far above it.
        """
        if tolerance is None:
            return self.within_noise
        if not np.isfinite(self.loss):
            return False
        if self.steps and np.isfinite(self.drift):
            allowed = max(tolerance, NOISE_MARGIN * self.noise_floor) if np.isfinite(self.noise_floor) else tolerance
            return self.drift <= allowed
        return self.loss_error <= tolerance

    def table(self, max_rows: int = 12) -> str:
        """The ranked modules, gradient errors and the fix, as text."""
        verdict = _format.wrap(self.verdict)
        head = _format.wrap(f"compare_to_float32{f' ({self.policy})' if self.policy else ''}"
                f"{f' after {self.steps} steps' if self.steps else ''}: loss {self.loss:.6g} vs float32 "
                f"{self.loss_float32:.6g} (relative error {self.loss_error:.3g}"
                f"{f'; mean over the last {self.steps - self.steps // 2 + 1} steps {self.drift:.3g}' if np.isfinite(self.drift) else ''}"
                f"{f', rounding noise alone {self.noise_floor:.3g}' if np.isfinite(self.noise_floor) else ''})")
        # Every table fits 88 columns (a terminal, a log, a docs page): long module paths fold.
        if self.note:
            head += "\n" + _format.wrap(f"compared: {self.note}")
        rows = []
        for i, m in enumerate(self.modules[:max_rows]):
            # Within noise, where the error "jumps" is noise too: not marked.
            rows.append([str(i + 1), _format.fold_path(m.path or "(top level)", _PATH_COLUMN), f"{m.impact:+.3g}",
                         _format.fmt_pct(m.share) if np.isfinite(m.share) else "-",
                         f"{m.activation_error:.3g}", "-" if np.isnan(m.gradient_error) else f"{m.gradient_error:.3g}",
                         str(m.half_ops), "<- jump" if m.jump and not self.within_noise else ""])
        notes = [] if len(self.modules) <= max_rows else [f"... {len(self.modules) - max_rows} more modules"]
        gross = sum(abs(m.impact) for m in self.modules)
        if gross > 0 and np.isfinite(self.loss):
            net = sum(m.impact for m in self.modules)
            notes.append(f"share: impact / sum of |impact| ({gross:.3g}), negative against the net {net:+.3g}"
                         + (" (opposite signs cancel)" if abs(net) < 0.5 * gross else ""))
        notes.append("act err: worst forward result; grad err: RMS error / RMS of all backward results")
        footer = "\n".join(notes) or None
        out = [verdict, head, _format.render_table("Modules ranked by the loss error their rounding causes",
                                          ["#", "module", "loss impact", "share", "act err", "grad err",
                                           "half", ""], rows, footer, _format.WIDTH)]
        if self.gradient_errors:
            grows = [[_format.fold_path(p, _PATH_COLUMN), f"{e:.3g}"] for p, e in self.gradient_errors[:max_rows]]
            out.append(_format.render_table("Gradient error per parameter", ["param", "error"], grows,
                                            "error: RMS of the leaf's error / RMS of the whole float32 gradient",
                                            _format.WIDTH))
        if self.ops:
            orows = [[str(s.index), s.primitive, s.path, ",".join(s.in_dtypes) + "->" + ",".join(s.out_dtypes),
                      f"{e:.3g}", f"{c:+.3g}", s.rule] for s, e, c in self.ops[:max_rows * 3]]
            out.append(_format.render_table("Ops", ["#", "op", "module", "dtypes", "rel err", "loss impact", "rule"],
                                            orows, None, _format.WIDTH))
        if self.fix is not None and not self.within_noise:
            out.append(str(self.fix))
        out.append(f"({self.seconds:.2f} s)")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()
