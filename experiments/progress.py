"""Progress of long work: a tqdm bar with ETA on a terminal, plain periodic lines in logs and CI.

    with Progress(1000, "O2-fp16 seed 0") as bar:
        for step in range(1000):
            ...
            bar.update(1, loss=0.31)
"""

from __future__ import annotations

import sys
import time


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}:{s % 60:02d}" if s >= 60 else f"{s}s"


class Progress:
    """Counts work done out of ``total`` (``None``: unknown) and shows it.

    Args:
      total: units of work, or ``None`` for an open-ended task (shows elapsed time).
      desc: what is being done.
      initial: units already done (a resumed run).
      enabled: ``False`` shows nothing.
      interval_s: seconds between plain lines when not on a terminal.
      stream: where to write (default ``sys.stderr``).

    Example:
      >>> import io
      >>> with Progress(3, "demo", stream=io.StringIO(), interval_s=0) as p:
      ...     p.update(3)
    """

    def __init__(self, total: int | None, desc: str, *, initial: int = 0, enabled: bool = True,
                 interval_s: float = 10.0, stream=None):
        self.total, self.desc, self.n, self.initial = total, desc, initial, initial
        self.stream = sys.stderr if stream is None else stream
        self.enabled, self.interval_s = enabled, interval_s
        self._t0 = self._last = time.perf_counter()
        self._postfix: dict = {}
        self._bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, mininterval=0.5,
                             file=self.stream, leave=False)

    def update(self, n: int = 1, **postfix) -> None:
        """Adds ``n`` units; ``postfix`` values (loss, scale...) are shown beside the count."""
        self.n += n
        if postfix:
            self._postfix = postfix
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)
        elif self.enabled and time.perf_counter() - self._last >= self.interval_s:
            self._line()

    def _line(self, final: bool = False) -> None:
        now = time.perf_counter()
        self._last = now
        elapsed, done = now - self._t0, self.n - self.initial
        text = f"{self.desc}: {self.n}" + (f"/{self.total} ({100 * self.n / max(self.total, 1):.0f}%)"
                                             if self.total else "")
        text += f", {_fmt_s(elapsed)} elapsed"
        if self.total and done > 0 and not final:
            text += f", ETA {_fmt_s(elapsed / done * (self.total - self.n))}"
        if self._postfix:
            text += ", " + ", ".join(f"{k} {v}" for k, v in self._postfix.items())
        print(text + (" (done)" if final else ""), file=self.stream, flush=True)

    def close(self) -> None:
        """Ends the bar (on a terminal) or prints a final line (otherwise)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self.n > self.initial and time.perf_counter() - self._t0 >= self.interval_s:
            self._line(final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
