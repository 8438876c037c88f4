"""What `jaxmp.diagnostics.compare_to_float32` returns: `ShadowReport` and its `ModuleError` rows.

See docs/debugging.md#a-float32-shadow-run-ranked-by-module.
"""

from __future__ import annotations

import dataclasses
import numpy as np

from jaxmp.diagnostics import _format
from jaxmp.diagnostics._fix import Fix


_F32 = np.dtype(np.float32)
#: A k-step drift up to this multiple of the rounding-noise drift is not an alarm (see `ShadowReport.clean`).
NOISE_MARGIN = 3.0


@dataclasses.dataclass(frozen=True)
class ModuleError:
    """The error of one module (name-scope path) of the policy run against its float32 shadow.

    Attributes:
      path: the module path.
      impact: the loss error its ops' own rounding causes (first-order estimate; signed).
      share: ``impact`` as a fraction of the loss error of the whole run (NaN without a loss).
      activation_error: the largest relative error of its forward ops' results.
      gradient_error: the largest relative error of its backward ops' results (NaN: none).
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
      gradient_errors: ``((param path, relative error), ...)`` of the gradients, largest first.
      ops: per-op rows ``(site, relative error, impact)`` when ``per_op=True``, else ().
      steps: optimizer steps both runs took before the comparison (0: one step).
      losses, losses_float32: the loss at each of those steps (policy, float32).
      fix: the `Fix` for the top offender, or None.
      seconds: wall time of the comparison.
      policy: the policy it ran under (str), or None when ``fn`` runs its own precision.
      noise_floor: for ``steps=k``, the `drift` of float32 runs whose gradients get, at every
        step, random noise as large as the policy run's gradient error on the first step (the
        largest of `NOISE_RUNS` seeds): how far noise of the policy's size, without its bias,
        moves training in ``k`` steps (NaN for one step).
      drift: for ``steps=k``, the relative gap of the policy run's mean loss to the float32
        shadow's over the last half of the steps (``k//2 .. k``, the loss after the last step
        included); NaN for one step.
      losses_noise: the noisy float32 runs' losses (one tuple per seed, ``k+1`` each).
      note: what was compared instead of ``fn`` (a jaxmp step: the loss it wraps), or "".
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

    @property
    def loss_error(self) -> float:
        """``|loss - loss_float32| / |loss_float32|``."""
        return abs(self.loss - self.loss_float32) / max(abs(self.loss_float32), 1e-30)

    @property
    def top(self) -> ModuleError | None:
        """The top offender (first of `modules`), or None."""
        return self.modules[0] if self.modules else None

    def clean(self, tolerance: float = 0.05) -> bool:
        """No alarm: the loss is within ``tolerance`` (relative) of float32's.

        After ``k`` training steps two runs drift apart by rounding alone (trajectories that
        overfit a batch at a high learning rate oscillate and diverge chaotically), so the k-step
        verdict reads the `drift` (mean loss over the last half of the steps, not one step's
        loss) and allows ``NOISE_MARGIN * noise_floor`` too: a drift the size that
        half-precision rounding noise gives float32 runs is not an alarm; a systematic loss (a
        narrowed bias) stays far above it.
        """
        if not np.isfinite(self.loss):
            return False
        if self.steps and np.isfinite(self.drift):
            allowed = max(tolerance, NOISE_MARGIN * self.noise_floor) if np.isfinite(self.noise_floor) else tolerance
            return self.drift <= allowed
        return self.loss_error <= tolerance

    def table(self, max_rows: int = 12) -> str:
        """The ranked modules, gradient errors and the fix, as text."""
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
            rows.append([str(i + 1), m.path or "(top level)", f"{m.impact:+.3g}",
                         _format.fmt_pct(m.share) if np.isfinite(m.share) else "-",
                         f"{m.activation_error:.3g}", "-" if np.isnan(m.gradient_error) else f"{m.gradient_error:.3g}",
                         str(m.half_ops), "<- jump" if m.jump else ""])
        footer = None if len(self.modules) <= max_rows else f"... {len(self.modules) - max_rows} more modules"
        out = [head, _format.render_table("Modules ranked by the loss error their rounding causes",
                                          ["#", "module", "loss impact", "share", "act err", "grad err",
                                           "half", ""], rows, footer, _format.WIDTH)]
        if self.gradient_errors:
            grows = [[p, f"{e:.3g}"] for p, e in self.gradient_errors[:max_rows]]
            out.append(_format.render_table("Gradient relative error per parameter", ["param", "rel err"], grows,
                                            None, _format.WIDTH))
        if self.ops:
            orows = [[str(s.index), s.primitive, s.path, ",".join(s.in_dtypes) + "->" + ",".join(s.out_dtypes),
                      f"{e:.3g}", f"{c:+.3g}", s.rule] for s, e, c in self.ops[:max_rows * 3]]
            out.append(_format.render_table("Ops", ["#", "op", "module", "dtypes", "rel err", "loss impact", "rule"],
                                            orows, None, _format.WIDTH))
        if self.fix is not None:
            out.append(str(self.fix))
        out.append(f"({self.seconds:.2f} s)")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


