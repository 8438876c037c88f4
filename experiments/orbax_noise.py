"""Keeps orbax's background noise off stderr, so that a failed save is reported once, by us.

A write that fails inside orbax (a full disk, a file-size limit) fails in its writer threads
first: each logs the exception with its traceback through absl (``future.py ... raised an
exception``) before the save raises it in the main thread, where `experiments.checkpoint`
turns it into one `experiments.checkpoint.CheckpointWriteError`. And TensorStore
completes reads and writes from its own threads by scheduling a callback on the asyncio loop
orbax ran them on; after an error orbax has closed that loop already, so the late callback's
``RuntimeError('Event loop is closed')`` is printed as an "Exception ignored" traceback, often
at exit. Neither says anything the error we raise does not: `quiet_save` holds orbax's
error records and its threads' exceptions back while a save runs (they are kept on the context
object, and re-emitted if the save then succeeds after all), and `drop_closed_loop_noise`
drops only that one unraisable ``RuntimeError``, passing every other one to the previous hook.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Iterator

_ORBAX = ("/orbax/", "\\orbax\\")


def _from_orbax(path: str) -> bool:
    return any(p in path for p in _ORBAX)


class _HoldOrbaxErrors(logging.Filter):
    """Holds back ERROR records logged by orbax's modules (the writer threads' tracebacks)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and _from_orbax(record.pathname or ""):
            self.held.append(record)
            return False
        return True


class HeldNoise:
    """What `quiet_save` held back: orbax's log records and its threads' exceptions."""

    def __init__(self) -> None:
        self.records: list[logging.LogRecord] = []
        self.thread_errors: list[BaseException] = []


def _traceback_in_orbax(tb) -> bool:
    while tb is not None:
        if _from_orbax(tb.tb_frame.f_code.co_filename):
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def quiet_save() -> Iterator[HeldNoise]:
    """While a save runs: orbax's ERROR records and exceptions escaping its threads are held back.

    On success the held records are logged after all (nothing is lost when orbax recovered on its
    own); on failure the caller's one message replaces them.

    Yields:
      A `HeldNoise` with what was held back.

    Example:
      >>> with quiet_save() as held:
      ...     pass
      >>> held.records, held.thread_errors
      ([], [])
    """
    held = HeldNoise()
    hold = _HoldOrbaxErrors()
    # orbax logs through absl's logger; the handlers also see records of loggers that propagate.
    targets = [logging.getLogger("absl"), *logging.getLogger().handlers]
    for t in targets:
        t.addFilter(hold)
    previous_hook = threading.excepthook

    def excepthook(args):
        if _traceback_in_orbax(args.exc_traceback):
            held.thread_errors.append(args.exc_value)
            return
        previous_hook(args)

    threading.excepthook = excepthook
    failed = False
    try:
        yield held
    except BaseException:
        failed = True
        raise
    finally:
        threading.excepthook = previous_hook
        for t in targets:
            t.removeFilter(hold)
        held.records = hold.held
        if not failed:
            for record in held.records:
                logging.getLogger(record.name).handle(record)


def _is_closed_loop_noise(unraisable) -> bool:
    exc = unraisable.exc_value
    if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
        return False
    tb = unraisable.exc_traceback
    while tb is not None:  # raised by asyncio's call_soon_threadsafe, from a TensorStore callback
        if tb.tb_frame.f_code.co_name == "call_soon_threadsafe":
            return True
        tb = tb.tb_next
    return False


def drop_closed_loop_noise() -> None:
    """Installs an unraisable-exception hook that drops TensorStore's late callbacks to a closed
    asyncio loop; every other unraisable exception goes to the hook installed before. Installing
    it again while it is the current hook does nothing."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop_noise", False):
        return

    def hook(unraisable):
        if not _is_closed_loop_noise(unraisable):
            previous(unraisable)

    hook.drops_closed_loop_noise = True
    sys.unraisablehook = hook
