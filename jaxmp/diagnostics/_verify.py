"""Verified, not predicted: a `PrecisionPlan`'s rules trained against float32 over several seeds.

Float32 (the loss as given) and the chosen rules (``jaxmp.autocast(fn, policy, rules=rules)``) are
trained for the same steps from the same parameters on the same batches, once per seed; each
run's final loss is the float32 loss of its trained parameters on the last batch it trained on.
The verdict is benchmarks/fidelity.py's: within when ``|mean(rules) - mean(float32)| <=
max(max - min of float32's final losses, 1% of |mean(float32)|)``. See
docs/precision-search.md#verified-not-predicted.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp.diagnostics import _format

#: The smallest tolerance, as a fraction of float32's mean final loss (benchmarks/fidelity.py's).
REL_FLOOR = 0.01
CRITERION = "|mean(rules) - mean(float32)| <= max(float32's seed spread (max - min), 1% of |mean(float32)|)"


@dataclasses.dataclass(frozen=True)
class Verification:
    """The rules trained against float32, per seed (`PrecisionPlan.verification`).

    Attributes:
      seeds: the seeds, in order.
      steps: optimizer steps per run.
      float32: each seed's final loss trained in float32.
      rules: each seed's final loss trained under the chosen rules.
      tolerance: ``max(max(float32) - min(float32), 1% of |mean(float32)|)``.
      within: ``|mean(rules) - mean(float32)| <= tolerance`` (benchmarks/fidelity.py's verdict).
      seconds: wall time of the verification (compiles included).
    """

    seeds: tuple[int, ...]
    steps: int
    float32: tuple[float, ...]
    rules: tuple[float, ...]
    tolerance: float
    within: bool
    seconds: float = 0.0

    @property
    def spread(self) -> tuple[float, float]:
        """float32's final losses' ``(min, max)`` over the seeds."""
        return min(self.float32), max(self.float32)

    @property
    def gap(self) -> float:
        """``mean(rules) - mean(float32)``."""
        return float(np.mean(self.rules) - np.mean(self.float32))

    def table(self) -> str:
        """Per seed, both final losses; float32's spread; the verdict and its criterion."""
        lo, hi = self.spread
        rows = [[str(s), f"{a:.6g}", f"{b:.6g}", "yes" if lo <= b <= hi else "no"]
                for s, a, b in zip(self.seeds, self.float32, self.rules)]
        out = [_format.render_table(f"Verified: {self.steps} steps per run", ["seed", "float32", "rules",
                                                                               "in float32's range"],
                                    rows, None, _format.WIDTH)]
        out.append(_format.wrap(
            f"float32's spread {lo:.6g}..{hi:.6g}; mean(rules) - mean(float32) = {self.gap:+.3g}, tolerance "
            f"{self.tolerance:.3g}: {'WITHIN' if self.within else 'OUTSIDE'} ({CRITERION}; {self.seconds:.1f} s)"))
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()


def _split(params):
    """``(floating params with None at the other leaves, the other leaves, the tree)``."""
    from jaxmp.diagnostics._inputs import _floating, _is_none

    leaves, tree = jax.tree_util.tree_flatten(params, is_leaf=_is_none)
    mask = tuple(x is not None and _floating(x) for x in leaves)
    train = jax.tree_util.tree_unflatten(tree, [x if m else None for x, m in zip(leaves, mask)])
    fixed = [x for x, m in zip(leaves, mask) if not m]
    return train, fixed, (tree, mask)


def _merge(train, fixed, shape):
    from jaxmp.diagnostics._inputs import _is_none

    tree, mask = shape
    got = iter(jax.tree_util.tree_flatten(train, is_leaf=_is_none)[0])
    rest = iter(fixed)
    return jax.tree_util.tree_unflatten(tree, [next(got) if m else next(rest) for m in mask])


def _as_args(batch) -> tuple:
    return tuple(batch) if isinstance(batch, tuple) else (batch,)


class _Runner:
    """Jitted training step of one loss, compiled once per parameter structure, reused for every seed."""

    def __init__(self, loss_fn: Callable, tx):
        self.loss_fn, self.tx = loss_fn, tx
        self._steps: dict[Any, Callable] = {}

    def step(self, shape):
        if shape not in self._steps:
            import optax

            loss_fn, tx = self.loss_fn, self.tx

            @jax.jit
            def step(train, fixed, opt, batch):
                g = jax.grad(lambda t: loss_fn(_merge(t, fixed, shape), *batch))(train)
                u, opt = tx.update(g, opt, train)
                return optax.apply_updates(train, u), opt

            self._steps[shape] = step
        return self._steps[shape]

    def train(self, params, batches: list) -> Any:
        train, fixed, shape = _split(params)
        step = self.step(shape)
        opt = self.tx.init(train)
        for batch in batches:
            train, opt = step(train, fixed, opt, batch)
        return _merge(train, fixed, shape)


def _seed_inputs(init_params, batches, seed: int, steps: int, default_params, default_batch) -> tuple[Any, list]:
    params = init_params(seed) if callable(init_params) else (default_params if init_params is None else init_params)
    if batches is None:
        got = [default_batch] * steps
    else:
        source = batches(seed) if callable(batches) else batches
        got = []
        for batch in source:
            if len(got) == steps:
                break
            got.append(_as_args(batch))
        if len(got) < steps:
            raise ValueError(f"PrecisionPlan.verify: batches gave {len(got)} batches for seed {seed}, fewer than "
                             f"steps={steps}: give at least as many (or a smaller steps)")
    return params, got


def verify(fn: Callable, policy: str, rules, default_params, default_batch: tuple, *, init_params, batches,
           seeds: Sequence[int], steps: int, optimizer) -> Verification:
    """Trains ``fn`` in float32 and under ``rules`` per seed and compares the final losses (see the module doc)."""
    from jaxmp._misuse import loss_scaled_grad
    from jaxmp.engine._seams import autocast

    t0 = time.perf_counter()
    if not (callable(init_params) or callable(batches)):
        raise ValueError("PrecisionPlan.verify: the seeds must change something: give init_params as a function of "
                         "the seed (e.g. lambda seed: model.init(jax.random.key(seed), x)['params']) or batches as "
                         "one (lambda seed: iterator of batches)")
    seeds = tuple(seeds)
    if len(seeds) < 2 or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"PrecisionPlan.verify: seeds must be at least two ints (a spread needs two runs), got {seeds!r}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"PrecisionPlan.verify: steps must be an int >= 1, got {steps!r}")
    runs = {"float32": _Runner(fn, optimizer), "rules": _Runner(autocast(fn, policy, rules=rules), optimizer)}
    final: dict[str, list[float]] = {"float32": [], "rules": []}
    evaluate = jax.jit(lambda p, batch: jnp.asarray(fn(p, *batch), jnp.float32))
    with loss_scaled_grad():
        for seed in seeds:
            params, got = _seed_inputs(init_params, batches, int(seed), int(steps), default_params, default_batch)
            for name, runner in runs.items():
                trained = runner.train(params, got)
                final[name].append(float(evaluate(trained, got[-1])))
    f32 = np.asarray(final["float32"], np.float64)
    tol = max(float(f32.max() - f32.min()), REL_FLOOR * abs(float(f32.mean())))
    gap = abs(float(np.mean(final["rules"]) - f32.mean()))
    return Verification(tuple(int(s) for s in seeds), int(steps), tuple(final["float32"]), tuple(final["rules"]),
                        tol, bool(gap <= tol), time.perf_counter() - t0)
