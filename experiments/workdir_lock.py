"""One run per workdir: a lock the kernel releases when the run ends, however it ends.

A run takes an exclusive ``fcntl.flock`` on ``<workdir>/.jaxmp.lock`` before it reads or writes
anything there and holds it until it has written its results; a second run in the same workdir
(``main.py``, ``compare.py``, a ``train.py`` job) stops at once with `WorkdirBusyError`,
which names the process holding the lock (pid, host, start time and command, written into the
lock file by the holder), and touches nothing. The kernel drops the lock when the holder's file
descriptor closes, so a run that is killed (SIGKILL included) or crashes never leaves a stale
lock behind: the file stays, its contents describe the last holder, and the next run simply
takes it. In a multi-process run only process 0 takes the lock (once for the run), and every
process learns the verdict (`experiments.checkpoint.agreed`), so all of them stop together.

``flock`` is reliable on local filesystems. Nothing is promised on network filesystems (NFS,
SMB, FUSE mounts such as GCS or S3 buckets): some ignore ``flock`` or emulate it per host, so two
runs on different machines may both get the lock there.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from typing import Iterator

from experiments.validation import UserError

LOCK_NAME = ".jaxmp.lock"


class WorkdirBusyError(UserError):
    """Another run holds the workdir's lock."""


def _holder(path: str) -> str:
    """What the lock file says about its holder, in words."""
    try:
        with open(path) as f:
            info = json.load(f)
        return (f"pid {info.get('pid')} on host {info.get('host')}, started {info.get('started')}"
                f" ({info.get('command')})")
    except (OSError, ValueError, AttributeError):
        return "a process that has not yet written its name into the lock file"


class WorkdirLock:
    """An exclusive, kernel-released lock on a workdir (see the module docstring).

    Args:
      workdir: the directory (created if missing).
      what: what holds it, for the other run's error (``"experiments.main"``...).

    Example:
      >>> with WorkdirLock("/tmp/jaxmp_lock_demo"):  # doctest: +SKIP
      ...     pass  # a second run in /tmp/jaxmp_lock_demo now gets WorkdirBusyError
    """

    def __init__(self, workdir: str, what: str | None = None):
        self.workdir = os.path.abspath(workdir)
        self.path = os.path.join(self.workdir, LOCK_NAME)
        self.what = what or " ".join([os.path.basename(sys.executable)] + sys.argv)[:300]
        self._fd: int | None = None

    def acquire(self) -> "WorkdirLock":
        """Takes the lock or raises `WorkdirBusyError` naming its holder."""
        os.makedirs(self.workdir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise WorkdirBusyError(
                f"--workdir={self.workdir} is in use by another run: {_holder(self.path)}. Two runs in one "
                "workdir would overwrite each other's checkpoints and results; nothing of that run was touched. "
                "Wait for it to finish (or stop it), or use a new --workdir.") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": self.what}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Gives the lock back (the file stays: removing it would let two runs lock two different files)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.ftruncate(fd, 0)  # no stale holder for the next reader; the kernel lock is what counts
            except OSError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def locked(workdir: str, what: str | None = None) -> Iterator[None]:
    """Holds ``workdir``'s lock for the ``with`` block; in a multi-process run process 0 holds it.

    Raises:
      WorkdirBusyError: another run holds it (on every process of a multi-process run).
    """
    import jax

    from experiments.checkpoint import agreed

    lock = WorkdirLock(workdir, what)
    if jax.process_count() == 1:
        with lock:
            yield
        return
    try:
        agreed(lambda: lock.acquire() if jax.process_index() == 0 else None, f"locking {workdir}")
    except RuntimeError as e:  # process 0's WorkdirBusyError, as the other processes hear of it
        raise WorkdirBusyError(str(e)) from None
    try:
        yield
    finally:
        lock.release()
