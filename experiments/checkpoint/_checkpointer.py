"""The orbax adapter: `Checkpointer` saves a step (with its records) and restores the newest
intact one, verified by every process; `restore_target` and `Restored` are what it restores into and returns."""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from experiments.checkpoint._agree import agreed, allgather_text
from experiments.checkpoint._errors import CheckpointDamagedError, CheckpointDamageWarning, CheckpointMismatchError, _Damaged
from experiments.checkpoint._format import FILE_LIST, MUST_MATCH, SETTINGS, SHARDS, _canonical, _sha256
from experiments.checkpoint._records import _file_owner, array_specs, make_manifest, make_shard_file, saveable, shard_records
from experiments.checkpoint._verify import (_check_layout, _check_manifest, _flag_value, check_file_list, check_meta,
                                            check_shards, read_shard_records, settings_diffs, unreadable)
from experiments.checkpoint._write_errors import write_failure
from experiments.orbax_noise import drop_closed_loop_noise, quiet_save
from experiments.validation import UserError


def restore_target(template: Any) -> Any:
    """What orbax restores into: host (numpy) arrays, or ``ShapeDtypeStruct`` leaves with shardings.

    Args:
      template: host arrays; ``jax.Array`` leaves (fetched to the host unless they span processes);
        or ``jax.ShapeDtypeStruct`` leaves (with a sharding: restored onto it; without: on the host).

    Returns:
      The same pytree, every leaf a numpy array or a sharded ``jax.ShapeDtypeStruct``.
    """
    def one(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x if x.sharding is not None else np.zeros(x.shape, x.dtype)
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return np.asarray(x)

    return jax.tree_util.tree_map(one, template)


class Restored(NamedTuple):
    """An intact checkpoint: the state, its metadata and its step."""

    state: Any
    meta: dict
    step: int


class Checkpointer:
    """Saves and verifies ``(state, meta)`` under ``<workdir>/checkpoints``.

    In a multi-process run every process creates one, with the same ``workdir``, and calls
    `save` and `restore_latest` at the same points.

    Args:
      workdir: the run's directory (on a filesystem all processes share).
      max_to_keep: how many recent checkpoints to keep (>= 1).

    Example:
      >>> ckpt = Checkpointer("/tmp/run")  # doctest: +SKIP
      >>> ckpt.save(10, state, {"data_position": 10, ...})  # doctest: +SKIP
      >>> restored = ckpt.restore_latest(host_template, expected_meta)  # doctest: +SKIP
    """

    def __init__(self, workdir: str, max_to_keep: int = 2):
        import orbax.checkpoint as ocp  # lazy: only runs that checkpoint pay the import

        drop_closed_loop_noise()
        if max_to_keep < 1:
            raise UserError(f"keep_checkpoints={max_to_keep} is invalid: use an integer >= 1.")
        self._ocp = ocp
        self.workdir = os.path.abspath(workdir)
        self.directory = os.path.join(self.workdir, "checkpoints")
        # Synchronous saves: the step that follows may donate (overwrite) the state buffers,
        # and a save that returned is a checkpoint a SIGKILL cannot take back.
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        # Every process writes its own shard file (primary_host=None: each is "primary" for
        # it) inside the step, so orbax's atomic finalize covers it.
        every_process = ocp.options.MultiprocessingOptions(primary_host=None)
        shards = ocp.JsonCheckpointHandler(filename=f"process_{jax.process_index()}.json",
                                           multiprocessing_options=every_process)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
            "manifest": ocp.JsonCheckpointHandler(), SHARDS: shards})
        # Verification reads through the handlers, not the manager: a manager restore ends at a
        # barrier, where the processes would hang if one of them had failed before reaching it.
        self._json_reader = ocp.JsonCheckpointHandler()
        self._state_reader = ocp.StandardCheckpointHandler()

    def steps(self) -> list[int]:
        """Finalized steps, oldest first (intact or not)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Writes one step; in a multi-process run every process calls it with its view of the state.

        Args:
          step: the step number (its directory name).
          state: the train state: host arrays and/or ``jax.Array`` leaves (sharded ones may span
            processes: each process writes and checksums its own shards).
          meta: JSON-able metadata with the fields of ``_META_TYPES`` (``data_position == step``).

        Returns once the step is finalized and every process's file list is written.

        Raises:
          CheckpointWriteError: the step could not be written (a full disk, any other write failure);
            its unfinished files are removed, older steps are untouched.
        """
        ocp = self._ocp
        state = saveable(state)
        manifest = make_manifest(state, meta, step)
        shards = make_shard_file(shard_records(state), step)
        try:
            self._write_step(step, ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                manifest=ocp.args.JsonSave(manifest), **{SHARDS: ocp.args.JsonSave(shards)}))
        except Exception as e:  # noqa: BLE001 - orbax and TensorStore wrap the OSError; name it
            self._discard_unfinished(step)
            raise write_failure(self.workdir, f"checkpoint step {step}", e) from e
        try:
            agreed(lambda: self._write_file_list(step), f"writing the file list of checkpoint step {step}")
        except Exception as e:  # noqa: BLE001 - the step itself is finalized: it stays, verified by its shards
            raise write_failure(self.workdir, f"the file list of checkpoint step {step}", e) from e

    def _write_step(self, step: int, args: Any) -> None:
        """orbax's save of one step, finalized (atomically renamed) before it returns.

        A failed write fails in orbax's writer threads first, each logging its traceback: they
        are held back (`experiments.orbax_noise.quiet_save`), and the failure is reported
        once, by `save`.
        """
        with quiet_save():
            self._manager.save(step, args=args, force=True)
            self._manager.wait_until_finished()

    def _discard_unfinished(self, step: int) -> None:
        """Removes what a failed save of ``step`` left half-written (never a finalized step), to free its space."""
        if jax.process_index() != 0 or not os.path.isdir(self.directory):
            return
        for name in os.listdir(self.directory):
            if name.startswith(f"{step}.orbax-checkpoint-tmp"):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _write_file_list(self, step: int) -> None:
        """Checksums of the files of the state this process wrote, so damage is found before orbax reads them.

        Written after orbax's atomic finalize (the file names exist only then): a step killed in
        between has no list and is verified by the shard checksums alone.
        """
        me, count = jax.process_index(), jax.process_count()
        state_dir = os.path.join(self.directory, str(step), "state")
        files = {}
        for root, _, names in os.walk(state_dir):
            for name in names:
                path = os.path.join(root, name)
                rel = os.path.relpath(path, state_dir)
                if _file_owner(rel, count) == me:
                    with open(path, "rb") as f:
                        files[rel] = {"size": os.path.getsize(path), "sha256": _sha256(f.read())}
        body = {"process_index": me, "files": files, "sha256": _sha256(_canonical([me, files]))}
        out = os.path.join(self.directory, str(step), FILE_LIST.format(me))
        with open(out + ".tmp", "w") as f:
            json.dump(body, f)
        os.replace(out + ".tmp", out)

    def _read_json(self, step: int, item: str) -> Any:
        """One JSON item of a step (``manifest``, ``meta``); any failure to read is damage."""
        from etils import epath  # orbax's path type (an orbax dependency)

        try:
            return self._json_reader.restore(epath.Path(self.directory) / str(step) / item)
        except Exception as e:  # noqa: BLE001 - any failure to read is damage, reported by name
            raise _Damaged(f"{item}: missing or unreadable ({type(e).__name__})") from None

    def _check_step(self, step: int, target: Any, expected: dict) -> tuple[dict, dict[str, list[dict]]]:
        """Phase 1, before any array is read: manifest, metadata, run settings, structure, shard
        files, restore layout, and this process's share of the file lists.

        Returns:
          ``(meta, shard records by key)``.
        """
        manifest = self._read_json(step, "manifest")
        _check_manifest(manifest, step)
        meta = check_meta(self._read_json(step, "meta"), manifest, step)
        diffs = {k: (meta.get(k), expected[k]) for k in MUST_MATCH if k in expected and meta.get(k) != expected[k]}
        if SETTINGS in expected:
            diffs.update(settings_diffs(meta.get(SETTINGS), expected[SETTINGS], step, self.directory))
        if diffs:
            detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
            back = " ".join(f"--config.{k}={_flag_value(a)}" for k, (a, _) in diffs.items()
                            if k not in MUST_MATCH and a is not None)
            keep = f" To continue that run instead, pass its values: {back}." if back else ""
            raise CheckpointMismatchError(
                f"{self.directory} holds checkpoints of a different run ({detail}). Resuming (or reading back a "
                "finished run) under different settings would mix two runs, and its results would describe "
                f"settings it did not use: to start fresh, use a new --workdir (or move this one away).{keep}")
        want = [(a.get("path"), a.get("shape"), a.get("dtype")) for a in manifest["arrays"]]
        have = [(r["path"], r["shape"], r["dtype"]) for r in array_specs(target)]
        if want != have:
            diff = next((i for i, (w, h) in enumerate(zip(want, have)) if w != h), min(len(want), len(have)))
            raise CheckpointMismatchError(
                f"step {step} in {self.directory} holds a state of a different structure (e.g. another model "
                f"size): at leaf {diff} the checkpoint has {want[diff] if diff < len(want) else 'nothing'}, this "
                f"run {have[diff] if diff < len(have) else 'nothing'}. Use a new --workdir.")
        by_key = read_shard_records(os.path.join(self.directory, str(step)), manifest, step)
        _check_layout(target, by_key, step)
        # Each process checks the lists of its share of the writers (its own, when the process
        # count is unchanged), so no file is hashed twice.
        me, count = jax.process_index(), jax.process_count()
        for process in range(me, manifest["process_count"], count):
            check_file_list(os.path.join(self.directory, str(step)), process)
        return meta, by_key

    def _read_state(self, step: int, target: Any, by_key: dict[str, list[dict]]) -> Any:
        """Phase 2: restores the state into ``target`` and checks the pieces this process holds."""
        from etils import epath

        ocp = self._ocp
        try:
            state = self._state_reader.restore(epath.Path(self.directory) / str(step) / "state",
                                               args=ocp.args.StandardRestore(target))
        except Exception as e:  # noqa: BLE001 - orbax/TensorStore errors on damaged files become a report
            raise unreadable(e) from None
        check_shards(state, by_key)
        return state

    def _verify(self, step: int, target: Any, expected: dict) -> Restored:
        what = f"verifying checkpoint step {step}"
        meta, by_key = agreed(lambda: self._check_step(step, target, expected), what)
        # Only now, with every process content with the files, does anyone read the arrays.
        state = agreed(lambda: self._read_state(step, target, by_key), what)
        return Restored(state, meta, step)

    def _agreed_steps(self) -> list[int]:
        """The finalized steps, the same on every process (or a clear error instead of a hang)."""
        steps = self.steps()
        seen = allgather_text(f"{len(steps)}:{_sha256(_canonical(steps))}")
        if len(set(seen)) > 1:
            raise RuntimeError(
                f"the processes see different checkpoint steps in {self.directory} (count:hash per process: "
                f"{seen}); a checkpoint directory must be one filesystem shared by every process.")
        return steps

    def _quarantine(self, step: int) -> str:
        """Moves a damaged step out of orbax's way (kept for inspection, never deleted)."""
        dest = os.path.join(self.workdir, "damaged_checkpoints", f"{step}.{time.strftime('%Y%m%dT%H%M%S')}")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.move(os.path.join(self.directory, str(step)), dest)
        return dest

    def _set_aside(self, damage: list[tuple[int, str]], resumed: int) -> None:
        """Process 0 moves the damaged steps aside, then every process warns about each."""
        for bad, what in damage:
            moved = agreed(lambda: self._quarantine(bad) if jax.process_index() == 0 else "",
                           f"moving damaged checkpoint step {bad} aside")
            # agreed() returned on every process only after process 0's move: nobody reloads early.
            where = allgather_text(moved)[0]
            warnings.warn(f"checkpoint step {bad} in {self.directory} is DAMAGED ({what}); moved to {where}. "
                          f"Resuming from step {resumed}, the newest intact one.", CheckpointDamageWarning,
                          stacklevel=3)
        if damage:
            self._manager.reload()

    def restore_latest(self, template: Any, expected: dict) -> Restored | None:
        """The newest intact step, verified by every process; ``None`` in an empty directory.

        Args:
          template: the state's structure, shapes and dtypes. Host (numpy) arrays and ``jax.Array``
            leaves on this process's devices are restored on the host; ``jax.Array`` leaves that
            span processes and ``jax.ShapeDtypeStruct`` leaves with a sharding are restored onto
            that sharding (see `restore_target`).
          expected: the current run's values of `MUST_MATCH`.

        Returns:
          A `Restored`, or ``None`` when there is nothing to resume.

        Raises:
          CheckpointMismatchError: the intact checkpoint belongs to a different run, or the
            restore sharding splits a piece it was saved in between processes.
          CheckpointDamagedError: checkpoints exist but none is intact.
        """
        target = restore_target(template)
        damage = []
        for step in reversed(self._agreed_steps()):
            try:
                restored = self._verify(step, target, expected)
            except _Damaged as e:
                damage.append((step, str(e)))
                continue
            self._set_aside(damage, step)
            return restored
        if damage:
            lines = "; ".join(f"step {s}: {w}" for s, w in damage)
            raise CheckpointDamagedError(
                f"no intact checkpoint in {self.directory} ({lines}). Nothing was overwritten. Move the workdir "
                "away (or delete it) to start over.")
        self._check_empty()
        return None

    def _check_empty(self) -> None:
        """Leftovers of a save killed before it was finalized are fine; anything else is not."""
        entries = os.listdir(self.directory) if os.path.isdir(self.directory) else []
        unfinished = [e for e in entries if ".orbax-checkpoint-tmp" in e]
        if unfinished:
            warnings.warn(f"{self.directory}: ignoring unfinished save(s) {unfinished} of a run killed before its "
                          "first checkpoint completed; starting from step 0.", CheckpointDamageWarning, stacklevel=3)
        others = sorted(set(entries) - set(unfinished))
        if others:
            raise CheckpointDamagedError(
                f"{self.directory} holds {others} but no complete checkpoint. Nothing was overwritten. Move the "
                "workdir away (or delete it) to start over.")

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
