"""Input-pipeline overhead: how much of a step's wall time is spent waiting for data.

NVIDIA's method: ``N`` steps fed by the iterator against ``N`` steps on one preloaded batch; the
exposed fraction ``f`` caps any compute speed-up at ``1 / f``.
See docs/diagnostics.md#how-much-can-faster-compute-help-at-all.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable, NamedTuple

import jax

from jaxmp.diagnostics import _format
from jaxmp._typing import PyTree


class PipelineOverhead(NamedTuple):
    """What [`input_pipeline_overhead`][jaxmp.diagnostics.input_pipeline_overhead] returns (times in seconds, per timed loop).

    Attributes:
      num_steps: steps per timed loop.
      total_time: wall time of ``num_steps`` steps fed by the iterator.
      model_time: wall time of ``num_steps`` steps on one preloaded batch.
      exposed_time: ``max(total_time - model_time, 0)``.
      exposed_fraction: ``exposed_time / total_time``.
      max_speedup: ``1 / exposed_fraction`` (inf when nothing is exposed): the cap on the
        end-to-end speed-up from faster compute (mixed precision, Tensor Cores).
    """

    num_steps: int
    total_time: float
    model_time: float
    exposed_time: float
    exposed_fraction: float
    max_speedup: float

    def projected_speedup(self, compute_speedup: float) -> float:
        """End-to-end speed-up if the model time gets ``compute_speedup`` times faster.

        Args:
          compute_speedup: speed-up of the model (compute) part, e.g. 2.0 from mixed precision.

        Returns:
          ``total / (exposed + model / compute_speedup)``.
        """
        if not compute_speedup > 0:
            raise ValueError(f"compute_speedup must be positive, got {compute_speedup}")
        remaining = self.exposed_time + self.model_time / compute_speedup
        # Nothing exposed and compute made infinitely fast: no time is left, the speed-up is unbounded.
        return self.total_time / remaining if remaining > 0 else math.inf

    def summary(self) -> str:
        """One line for logs."""
        cap = "unbounded" if math.isinf(self.max_speedup) else f"{self.max_speedup:.2f}x"
        return (f"input pipeline: {1e3 * self.total_time / self.num_steps:.2f} ms/step total, "
                f"{1e3 * self.model_time / self.num_steps:.2f} ms/step model, exposed data time "
                f"{_format.fmt_pct(self.exposed_fraction)} -> faster compute can give at most {cap}")

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-serialisable dict (``max_speedup`` is None when unbounded)."""
        d = self._asdict()
        if math.isinf(d["max_speedup"]):
            d["max_speedup"] = None
        d["summary"] = self.summary()
        return d

    def __str__(self) -> str:
        return _format.wrap(self.summary())


def _next(it, needed: int, taken: int):
    try:
        return next(it)
    except StopIteration:
        raise ValueError(f"the batch iterator ran out after {taken} batches; "
                         f"input_pipeline_overhead needs {needed} (warmup + repeats * num_steps)") from None


def input_pipeline_overhead(step_fn: Callable, state: PyTree, batches: Iterable, num_steps: int = 50, *,
                            warmup: int = 2, repeats: int = 1, has_aux: bool = False,
                            device_put: bool = True, timer: Callable[[], float] = time.perf_counter
                            ) -> PipelineOverhead:
    """Measures the exposed input-pipeline time of a training loop (NVIDIA's two-loop method).

    The last warm-up batch is the preloaded one; state is threaded through every step (donating
    steps work). See docs/diagnostics.md#how-much-can-faster-compute-help-at-all.

    Args:
      step_fn: ``step_fn(state, batch) -> state`` (or ``(state, aux)`` with ``has_aux=True``).
        Wrap a ``train_step(params, opt_state, batch)`` as
        ``lambda s, b: train_step(*s, b)[:2]``.
      state: the initial state.
      batches: an iterator or iterable of batches; ``warmup + repeats * num_steps`` are drawn.
      num_steps: steps per timed loop (>= 1). Make it large enough to amortise overlap.
      warmup: untimed steps before timing (>= 1; the first compiles).
      repeats: how many times each loop is timed (>= 1); the minimum counts.
      has_aux: ``step_fn`` returns ``(state, aux)``; aux is waited on too.
      device_put: move the preloaded batch to the device before the model loop.
      timer: a clock in seconds (``time.perf_counter``; replaceable for tests).

    Returns:
      A [`PipelineOverhead`][jaxmp.diagnostics.PipelineOverhead] (``exposed_fraction``, ``max_speedup``, ``summary()``).

    Raises:
      TypeError: ``step_fn`` is not callable or ``batches`` is not iterable.
      ValueError: ``num_steps``, ``warmup`` or ``repeats`` below 1, or the iterator runs out.

    Example:
      >>> import itertools, jax, numpy as np, jaxmp
      >>> step = jax.jit(lambda w, batch: w - 0.1 * batch.mean(axis=0))
      >>> batches = itertools.repeat(np.ones((8, 3), np.float32))
      >>> w = np.zeros(3, np.float32)
      >>> ov = jaxmp.input_pipeline_overhead(step, w, batches, num_steps=5)
      >>> 0.0 <= ov.exposed_fraction <= 1.0
      True
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}: {step_fn!r}")
    for label, value in (("num_steps", num_steps), ("warmup", warmup), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, got {type(value).__name__}: {value!r}")
        if value < 1:
            raise ValueError(f"{label} must be >= 1, got {value}")
    try:
        it = iter(batches)
    except TypeError as e:
        raise TypeError(f"batches must be an iterator or iterable of batches, got {type(batches).__name__}") from e

    needed = warmup + repeats * num_steps
    taken = 0

    def step(s, b):
        out = step_fn(s, b)
        return out[0] if has_aux else out, out

    batch = None
    for _ in range(warmup):
        batch = _next(it, needed, taken)
        taken += 1
        state, out = step(state, batch)
    jax.block_until_ready(out)
    preloaded = jax.device_put(batch) if device_put else batch
    # One untimed step on the preloaded batch: a committed device array can be a new jit cache key.
    state, out = step(state, preloaded)
    jax.block_until_ready(out)

    totals, models = [], []
    for _ in range(repeats):
        start = timer()
        for _ in range(num_steps):
            batch = _next(it, needed, taken)
            taken += 1
            state, out = step(state, batch)
        jax.block_until_ready(out)
        totals.append(timer() - start)

        start = timer()
        for _ in range(num_steps):
            state, out = step(state, preloaded)
        jax.block_until_ready(out)
        models.append(timer() - start)

    total, model = min(totals), min(models)
    exposed = max(total - model, 0.0)
    fraction = exposed / total if total > 0 else 0.0
    return PipelineOverhead(num_steps, total, model, exposed, fraction,
                            1.0 / fraction if fraction > 0 else math.inf)
