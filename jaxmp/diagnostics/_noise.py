"""The debugger's verdict: the rounding noise a policy run's error is read against.

One step: the float32 shadow re-run with every half op's result perturbed by up to half an ulp
(`one_step_noise`); ``steps=k``: the twins' drift (`drift`). An error above `NOISE_MARGIN`
times the noise is an alarm. Also the gradient errors, normalised by the whole gradient. See
docs/debugging.md#a-float32-shadow-run-ranked-by-module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp import _ops
from jaxmp.diagnostics import _format
from jaxmp.diagnostics._evaluate import Site

#: An error up to this multiple of the rounding noise is not an alarm (see `ShadowReport.verdict`).
NOISE_MARGIN = 3.0
#: Noisy float32 runs the one-step verdict measures its rounding noise with.
NOISE_SEEDS = 4

#: Ops that move or select values: exact in any dtype, they add no rounding of their own.
EXACT = _ops.having("exact")  # the op catalogue's


def noisy_site(site: Site) -> bool:
    """A forward op that rounds to half (not an exact move or selection): noise goes on its result."""
    return site.half and not site.backward and site.primitive not in EXACT


def window(buf, shape, salt: int):
    """A window of the factor buffer ``buf`` (``1 + scale * uniform(-1, 1)``, drawn on the host),
    shaped ``shape``, at an offset set by ``salt`` (the site): one slice per op, not a random-number
    program per op (at the debugger's fast compile each costs about 0.1 s of compile time)."""
    n = int(np.prod(shape)) if shape else 1
    if n > buf.shape[0]:  # not a result the buffer was sized for: no noise on it
        return jnp.ones(shape, buf.dtype)
    at = (salt * 7919) % (buf.shape[0] - n + 1)
    return jax.lax.slice(buf, (at,), (at + n,)).reshape(shape)


def gradient_errors(g_tree) -> tuple[tuple[str, float], ...]:
    """Per gradient leaf ``(path, RMS(policy - float32) / RMS(whole float32 gradient))``, largest first.

    Normalised by the whole gradient, not the leaf: the relative error of a near-zero gradient
    (a BatchNorm scale at init) is large and harmless, and must not rank as an alarm.
    """
    rows = [(jax.tree_util.keystr(path), np.asarray(a, np.float64), np.asarray(b, np.float64))
            for path, (a, b) in jax.tree_util.tree_leaves_with_path(g_tree, is_leaf=lambda x: isinstance(x, tuple))]
    n = sum(b.size for _, _, b in rows)
    rms = float(np.sqrt(sum(float(np.sum(np.square(b))) for _, _, b in rows) / max(n, 1)))
    out = []
    for path, a, b in rows:
        e = float(np.sqrt(np.mean(np.square(a - b)))) if b.size else 0.0
        out.append((path, e / rms if rms > 0 else e))
    return tuple(sorted(out, key=lambda r: -r[1]))


def one_step_noise(prog, args, ref, half) -> tuple[float, str]:
    """The one-step rounding noise: RMS relative change of the float32 shadow's first output over
    `NOISE_SEEDS` runs whose half ops' results are perturbed by up to half an ulp of ``half``."""
    if half is None:
        return 0.0, "no op computes in half precision (the policy run is the float32 run)"
    rel = float(jnp.finfo(half).eps) / 2
    runs = [prog.noise(args, rel, i + 1) for i in range(NOISE_SEEDS)]  # dispatched, then read
    changes = [relerr(r[0], ref) for r in runs]
    rms = float(np.sqrt(np.mean(np.square(changes))))
    bits = int(round(-np.log2(rel)))
    what = "loss" if np.shape(ref) == () else "first output"
    return rms, (f"the RMS relative change of the float32 {what} over {NOISE_SEEDS} runs whose half-precision "
                 f"ops' results are perturbed by up to half a {_format.short_dtype(half)} ulp (2**-{bits})")


def relerr(p, s) -> float:
    """``||p - s|| / ||s||`` in float64 (``||p - s||`` where ``s`` is all zeros)."""
    p, s = np.asarray(p, np.float64), np.asarray(s, np.float64)
    den = np.linalg.norm(s)
    num = np.linalg.norm(p - s)
    return float(num / den) if den > 0 else float(num)


def drift(run, ref) -> float:
    """The relative gap of ``run``'s mean loss to ``ref``'s over the last half of training.

    ``run``, ``ref``: ``[k+1]`` loss trajectories (index ``k``: after the last step). The mean
    over steps ``k//2 .. k`` rather than the last loss: a run that overfits a batch at a high
    learning rate oscillates from step to step, and one step's loss says more about the phase
    of the oscillation than about the precision.
    """
    run, ref = np.asarray(run, np.float64), np.asarray(ref, np.float64)
    h = (len(ref) - 1) // 2
    base = float(np.mean(ref[h:]))
    gap = abs(float(np.mean(run[h:])) - base) / max(abs(base), 1e-30)
    return gap if np.isfinite(gap) else float("inf")
