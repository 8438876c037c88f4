"""Multi-process verdicts: every process runs a phase, then all reach the same verdict, so no
process reads a step another found damaged or waits at a barrier another never reaches."""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
import numpy as np

from experiments.checkpoint._errors import CheckpointMismatchError, _Damaged

_VERDICT_BYTES = 2048  # the longest verdict one process sends the others

_T = TypeVar("_T")



def allgather_text(text: str) -> list[str]:
    """``text`` from every process, in process order (a one-process run: just this one).

    Args:
      text: at most ``_VERDICT_BYTES`` bytes of UTF-8 are sent (longer text is cut).

    Returns:
      One string per process.
    """
    if jax.process_count() == 1:
        return [text]
    from jax.experimental import multihost_utils

    raw = text.encode()[:_VERDICT_BYTES]
    buf = np.zeros(_VERDICT_BYTES, np.uint8)
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    rows = multihost_utils.process_allgather(buf)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in np.asarray(rows)]


def agreed(fn: Callable[[], _T], what: str) -> _T:
    """Runs ``fn`` on every process, then makes all processes reach the same verdict.

    Every process calls this at the same point; it exchanges one verdict per process, so it is
    also a barrier. A single-process run raises or returns exactly what ``fn`` did.

    Args:
      fn: one phase of work (verification, writing a file list...).
      what: what the phase is, for messages (``"verifying checkpoint step 20"``).

    Returns:
      ``fn()``'s result when no process found anything wrong.

    Raises:
      _Damaged: some process found the step damaged (each such process named, with what).
      CheckpointMismatchError: some process found a checkpoint of a different run.
      RuntimeError: another process failed in ``fn`` (this process re-raises its own error).
    """
    result, kind, text, error = None, "ok", "", None
    try:
        result = fn()
    except _Damaged as e:
        kind, text = "damaged", str(e)
    except CheckpointMismatchError as e:
        kind, text, error = "mismatch", str(e), e
    except Exception as e:  # noqa: BLE001 - the others must hear of it, or they would wait for this process
        kind, text, error = "error", f"{type(e).__name__}: {e}", e
    verdicts = [v.partition(":")[::2] for v in allgather_text(f"{kind}:{text}")]
    if error is not None:
        raise error
    for i, (k, t) in enumerate(verdicts):
        if k == "error":
            raise RuntimeError(f"process {i} failed while {what}: {t}")
    for k, t in verdicts:
        if k == "mismatch":
            raise CheckpointMismatchError(t)
    damaged = [(i, t) for i, (k, t) in enumerate(verdicts) if k == "damaged"]
    if damaged:
        raise _Damaged(damaged[0][1] if len(verdicts) == 1 else "; ".join(f"process {i}: {t}" for i, t in damaged))
    return result
