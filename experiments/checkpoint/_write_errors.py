"""A failed write in a run's workdir turned into one clear `CheckpointWriteError`: the errno's
meaning, the space the last checkpoint took and the space free, and how to go on."""

from __future__ import annotations

import os
import re
import shutil

from experiments.checkpoint._errors import CheckpointWriteError


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


# TensorStore reports the OS error of a failed write inside its message, not as an OSError:
# "... Failed to write 50360 bytes to file 16: File too large [os_error_code='27']".
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)'?|\[Errno (\d+)\]|OS error (\d+)")
_SPACE_ERRNOS = ("ENOSPC", "EDQUOT")


def _errno(error: BaseException) -> int | None:
    """The errno behind ``error``: an OSError in its cause chain, or the code in a TensorStore message."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e.errno
        m = _OS_ERROR_CODE.search(str(e))
        if m:
            return int(next(g for g in m.groups() if g))
        e = e.__cause__ or e.__context__
    return None


def _root_cause(error: BaseException, code: int | None) -> str:
    """The failure in words: the errno's meaning first (``File too large (EFBIG)``), then the
    library's own first line, whole, so the file it failed on stays in the message."""
    first = (str(error).strip().splitlines() or [""])[0][:1000]
    if code is None:
        return f"{type(error).__name__}: {first}"
    meaning = f"{os.strerror(code)} ({errno_name(code)})"
    if isinstance(error, OSError) and error.errno == code and not error.filename:
        return meaning
    return f"{meaning}; {type(error).__name__}: {first}"


def errno_name(code: int) -> str:
    import errno

    return errno.errorcode.get(code, str(code))


def _way_out(code: int | None) -> str:
    """What to fix before running again, for the errno the write failed with."""
    name = None if code is None else errno_name(code)
    if name in _SPACE_ERRNOS:
        return "free space"
    if name == "EFBIG":
        return "raise the file-size limit (ulimit -f, or the filesystem's; more free space does not help)"
    if name in ("EACCES", "EPERM", "EROFS"):
        return "make the workdir writable"
    return "fix the cause"


def write_failure(workdir: str, what: str, error: BaseException) -> CheckpointWriteError:
    """The clear error for a failed write in a run's workdir: what failed and why (the errno's
    meaning first), the space the last checkpoint took and the space free now, and how to go on.

    Args:
      workdir: the run's directory.
      what: what was being written (``"checkpoint step 20"``, ``"results.json"``).
      error: the exception the write raised.
    """
    workdir = os.path.abspath(workdir)
    code = _errno(error)
    fix = _way_out(code)
    directory = os.path.join(workdir, "checkpoints")
    steps = sorted(int(d) for d in (os.listdir(directory) if os.path.isdir(directory) else []) if d.isdigit())
    if steps:
        last = steps[-1]
        space = (f"The last checkpoint (step {last}) takes {_mib(_tree_bytes(os.path.join(directory, str(last))))}; "
                 "the next one needs about as much")
        go_on = (f"Checkpoint step {last} and older are intact: {fix} and run the same "
                 f"command again; it resumes from step {last} exactly")
    else:
        space = "No checkpoint has been written yet"
        go_on = f"{fix[0].upper()}{fix[1:]} and run the same command again; it starts from step 0"
    try:
        free = f", {_mib(shutil.disk_usage(workdir).free)} free now"
    except OSError:
        free = ""
    return CheckpointWriteError(
        f"could not write {what} in {workdir}: {_root_cause(error, code)}. {space}{free}. {go_on}.")
