"""The second search (``search="program"``): a SNIP-style integer program over per-module measurements.

Each module's drift contribution at each rung is measured alone (every other module at the top
rung), less the drift with every module at the top; the program picks the assignment of least
predicted matmul cost whose summed contributions stay within the band; the search then measures
that assignment and, if it misses, promotes greedily from it. The program is solved exactly by
dynamic programming over the modules, keeping the (cost, drift) Pareto frontier: a partial
assignment costlier and no better in drift than another is dropped. See
docs/precision-search.md#the-integer-program.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

#: Cost model of the program: B200's datasheet peaks, the one device with every rung natively.
COST_DEVICE = "B200"


def solve(options: Sequence[Sequence[tuple[float, float]]], budget: float) -> tuple[int, ...] | None:
    """The least-cost choice of one option per module whose drifts sum to at most ``budget``.

    Args:
      options: per module, per rung, ``(cost, drift contribution)``.
      budget: the most summed drift allowed.

    Returns:
      The chosen rung index per module (ties: the lower drift, then the lower indexes first), or
      None when no choice fits.

    Example:
      >>> import jaxmp
      >>> options = [[(1, 5.0), (2, 1.0)], [(1, 0.5), (2, 0.0)]]
      >>> jaxmp.diagnostics._program.solve(options, budget=1.5)
      (1, 0)
    """
    frontier: list[tuple[float, float, tuple[int, ...]]] = [(0.0, 0.0, ())]
    for opts in options:
        cand = [(c + oc, d + od, pick + (i,)) for c, d, pick in frontier for i, (oc, od) in enumerate(opts)
                if np.isfinite(od) and d + od <= budget]
        cand.sort()
        frontier, best = [], float("inf")
        for point in cand:
            if point[1] < best:  # cheaper points all drift more: this one is on the frontier
                frontier.append(point)
                best = point[1]
        if not frontier:
            return None
    return frontier[0][2]
