"""Orbax checkpoints of the whole training state, for exact resumption.

One checkpoint holds the train state pytree (half params if any, the optimizer
state -- with its fp32 master params, loss scale and skip counters -- model state
such as BatchNorm statistics, and the step) plus JSON metadata: the data
position and the settings that must match for a resume to be meaningful.
Orbax writes each step to a temporary directory and renames it when complete,
so a run killed with SIGKILL mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from typing import Any

import jax

# Settings a resumed run must share with the run that wrote the checkpoint.
MUST_MATCH = ("policy", "seed", "model", "dataset", "global_batch_size", "num_train_steps")


class CheckpointMismatchError(RuntimeError):
    """The workdir holds checkpoints of a different run."""


class Checkpointer:
    """Saves and restores ``(state, meta)`` under ``<workdir>/checkpoints``.

    Args:
      workdir: the run's directory.
      max_to_keep: how many recent checkpoints to keep.
    """

    def __init__(self, workdir: str, max_to_keep: int = 2):
        import orbax.checkpoint as ocp  # lazy: only runs that checkpoint pay the import

        self._ocp = ocp
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        # Synchronous saves: the step that follows may donate (overwrite) the state buffers,
        # and a save that returned is a checkpoint a SIGKILL cannot take back.
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or ``None``."""
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Writes a checkpoint of ``state`` and the JSON-able ``meta`` at ``step``."""
        ocp = self._ocp
        # Save a host copy: the state is replicated, and handing orbax the replicated device
        # arrays costs a small compile per leaf (seconds per save on 8 devices); one replica
        # on the host is the same bytes. Restoring puts it back with the template's sharding.
        host = jax.device_get(state)
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(host), meta=ocp.args.JsonSave(meta)), force=True)
        self._manager.wait_until_finished()

    def restore(self, state_template: Any, meta_expected: dict, step: int | None = None):
        """Restores the newest (or given) checkpoint into the structure of ``state_template``.

        Args:
          state_template: a state of the right structure, dtypes and shardings.
          meta_expected: values of :data:`MUST_MATCH` for the current run.
          step: which checkpoint; default the newest.

        Returns:
          ``(state, meta)``.

        Raises:
          CheckpointMismatchError: the checkpoint belongs to a different run.
        """
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        diffs = {k: (meta.get(k), meta_expected.get(k)) for k in MUST_MATCH
                 if k in meta_expected and meta.get(k) != meta_expected.get(k)}
        if diffs:
            detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
            raise CheckpointMismatchError(
                f"{self.directory} holds checkpoints of a different run ({detail}). "
                "Use a new --workdir, or delete that directory to start over.")
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state_template)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        return restored["state"], meta

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def load_state(workdir: str, step: int | None = None) -> Any:
    """Reads a checkpoint's state as a tree of numpy arrays, without a template (tests, analysis)."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"))
    step = manager.latest_step() if step is None else step
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    manager.close()
    return step, out
