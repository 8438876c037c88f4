"""The third search's criterion (``search="verified"``): float32's seed spread at the search's k steps.

The twin-run band (jaxmp/diagnostics/_noise.py) asks "is this run indistinguishable from float32
rounding noise?"; the issue's goal and `PrecisionPlan.verify` ask "is its final loss within
float32's seed spread?". The second is far wider (on the MNIST-1D CNN, NVFP4 everywhere drifts
15x the twin band in 4 steps yet ends within float32's 3-seed spread after 100), so a search
judged by the first keeps more high precision than the goal needs. This module measures the
second at the search's scale: each seed trains ``k`` steps from the given parameters on its own
sample of the given batch (seed 0 the batch as given; seed ``s`` its rows drawn with replacement
by ``numpy.random.default_rng(s)``: a different sample of the same data, as a seed's data order
is), and a run's final loss is its own loss function's (the candidate's forward, as the
benchmark's held-out loss is each variant's) on the whole given batch after training. A
candidate is within when ``|mean(candidate) - mean(float32)| <= max(float32's spread (max -
min), 1% of |mean(float32)|)``: `PrecisionPlan.verify`'s criterion
(jaxmp/diagnostics/_verify.py). See docs/precision-search.md#the-verified-search.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.diagnostics._verify import REL_FLOOR

#: Seeds of ``search="verified"`` (as `PrecisionPlan.verify`'s default).
SEEDS = (0, 1, 2)


def seed_batches(rest: tuple, seeds=SEEDS) -> list[tuple] | None:
    """Per seed, the batch arguments: seed 0's as given, seed ``s``'s rows drawn with replacement.

    The batch axis is the leading axis of the first array argument with one; every array
    argument with that leading size is drawn with the same rows (inputs and labels stay paired),
    the others are passed as they are. None when no argument has a leading axis of size >= 2
    (nothing to draw seeds' samples from).
    """
    arrays = [a for a in rest if hasattr(a, "shape") and len(a.shape) >= 1]
    if not arrays or arrays[0].shape[0] < 2:
        return None
    n = int(arrays[0].shape[0])
    out = []
    for s in seeds:
        if s == 0:
            out.append(tuple(rest))
            continue
        rows = np.sort(np.random.default_rng(s).integers(0, n, n))
        out.append(tuple(a[rows] if hasattr(a, "shape") and len(a.shape) >= 1 and a.shape[0] == n else a
                         for a in rest))
    return out


class SeedCheck:
    """Float32's final losses per seed at ``steps`` steps, and candidates measured against them.

    ``trainer`` is the search's `_Trainer` (its parameters, batch, steps and optimizer; its cost
    counter counts these runs too).
    """

    def __init__(self, trainer, fn: Callable, rests: list[tuple]):
        self.trainer, self.fn, self.rests = trainer, fn, rests
        self.float32 = self.finals(fn)
        mean = float(np.mean(self.float32))
        self.mean = mean
        self.spread = float(np.max(self.float32) - np.min(self.float32))
        self.tolerance = max(self.spread, REL_FLOOR * abs(mean))

    def finals(self, loss_fn: Callable) -> np.ndarray:
        """Each seed's final loss: ``loss_fn`` trained ``steps`` steps on the seed's batch (one
        compile for every seed), then its loss on the given batch."""
        import optax

        tx, steps = self.trainer.tx, self.trainer.steps

        given = self.trainer.rest
        evaluate = jax.jit(lambda q: jnp.asarray(loss_fn(q, *given), jnp.float32))

        @jax.jit
        def step(q, o, rest):
            g = jax.grad(loss_fn)(q, *rest)
            u, o = tx.update(g, o, q)
            return optax.apply_updates(q, u), o

        out = []
        for rest in self.rests:
            q = self.trainer.params
            o = tx.init(q)
            for _ in range(steps):
                q, o = step(q, o, rest)
            out.append(evaluate(q))
        self.trainer.cost += steps * len(self.rests)
        return np.asarray(jax.device_get(out), np.float64)

    def gap(self, loss_fn: Callable) -> float:
        """``|mean(candidate) - mean(float32)| / |mean(float32)|`` (inf when not finite)."""
        got = self.finals(loss_fn)
        gap = abs(float(np.mean(got)) - self.mean) / max(abs(self.mean), 1e-30)
        return gap if np.isfinite(gap) else float("inf")

    @property
    def band(self) -> float:
        """The tolerance relative to ``|mean(float32)|`` (the band ``gap`` is read against)."""
        return self.tolerance / max(abs(self.mean), 1e-30)

    @property
    def relative_spread(self) -> float:
        return self.spread / max(abs(self.mean), 1e-30)

