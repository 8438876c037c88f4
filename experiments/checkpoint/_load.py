"""`load_state`: a checkpoint's state read back without a template (one process, read-only), every
file and shard checked."""

from __future__ import annotations

import os
from typing import Any

from experiments.checkpoint._errors import CheckpointDamagedError, _Damaged
from experiments.checkpoint._verify import (_check_manifest, _read_json_file, check_file_list, check_shards,
                                            read_shard_records, unreadable)
from experiments.orbax_noise import drop_closed_loop_noise
from experiments.validation import UserError


def load_state(workdir: str, step: int | None = None) -> tuple[int, Any]:
    """Reads a checkpoint's state as host arrays without a template (one process) and checks every shard.

    The checks of `Checkpointer.restore_latest`, read-only (nothing is moved aside): the
    manifest, every process's file list (sizes and SHA-256 of the state's files, before
    TensorStore reads them), then each piece against its shard checksum.

    Args:
      workdir: the run's directory (the one given as ``--workdir``).
      step: which step; default the newest.

    Returns:
      ``(step, state)``.

    Raises:
      CheckpointDamagedError: the step is damaged (a file truncated, zeroed or changed; a
        manifest or shard file missing; an array not matching its checksum).
      UserError: ``workdir`` is not a directory, holds no checkpoints, or has no step ``step``.

    Example:
      >>> step, state = load_state("/tmp/run")  # doctest: +SKIP
    """
    import orbax.checkpoint as ocp

    drop_closed_loop_noise()  # a damaged file's failed read leaves late TensorStore callbacks
    workdir = os.path.abspath(workdir)
    if not os.path.isdir(workdir):
        what = "is a file" if os.path.exists(workdir) else "does not exist"
        raise UserError(f"load_state: {workdir} {what}; pass a run's workdir, the directory given as --workdir "
                        "(it holds checkpoints/<step>/).")
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        raise UserError(f"load_state: {workdir} holds no checkpoints (no {directory} directory); is it a run's "
                        "--workdir?")
    manager = ocp.CheckpointManager(directory)
    try:
        steps = sorted(manager.all_steps())
        if not steps:
            raise UserError(f"load_state: {directory} holds no finalized checkpoint.")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise UserError(f"load_state: {directory} has no finalized step {step}; its steps: {steps or 'none'}.")
        step_dir = os.path.join(directory, str(step))
        try:
            manifest = _read_json_file(os.path.join(step_dir, "manifest", "metadata"), "manifest")
            _check_manifest(manifest, step)
            for process in range(manifest["process_count"]):
                check_file_list(step_dir, process)
            try:
                state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
            except Exception as e:  # noqa: BLE001 - TensorStore's DATA_LOSS/OUT_OF_RANGE/... on a damaged file
                raise unreadable(e) from None
            check_shards(state, read_shard_records(step_dir, manifest, step))
        except _Damaged as e:
            raise CheckpointDamagedError(f"step {step} of {workdir}: {e}") from None
    finally:
        manager.close()
    return step, state
