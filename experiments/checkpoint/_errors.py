"""What a checkpoint raises and warns: the public errors and the internal verdict `_Damaged`."""

from __future__ import annotations

from experiments.validation import RunFailedError, UserError
from experiments.checkpoint._format import shared


class CheckpointMismatchError(UserError):
    """The workdir holds checkpoints of a different run (policy, loss scale, model...)."""


class CheckpointDamagedError(UserError):
    """The workdir holds checkpoints, but none of them is intact."""


class CheckpointWriteError(RunFailedError):
    """A checkpoint (or another file of the run) could not be written: a full disk, a quota, an I/O error."""


class CheckpointDamageWarning(UserWarning):
    """A checkpoint step was damaged and skipped; the run resumed from an older one."""


_Damaged = shared.Damaged  # one verdict for both checkpointers: the message says which array and what
