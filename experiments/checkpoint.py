"""Verified orbax checkpoints of the whole training state, for exact resumption.

Each step is one orbax ``CheckpointManager`` step with three items, finalized atomically
(orbax writes a temporary directory and renames it when complete):

* ``state``: the train state pytree as host arrays (half params, the optimizer state with its
  fp32 masters, loss scale and skip counters, BatchNorm statistics, the step);
* ``meta``: JSON -- the data position, the settings a resume must share, the metric history;
* ``manifest``: JSON -- per array its path, shape, dtype and the SHA-256 of its bytes, the
  SHA-256 of ``meta``, the data position, the jaxmp and format versions, and its own SHA-256.

After orbax has finalized the step, ``state_files.json`` adds the size and SHA-256 of every file
orbax wrote, so damaged files are found before orbax (TensorStore) reads them.

:meth:`Checkpointer.restore_latest` verifies a step against its manifest before trusting it.
A step that is damaged (a flipped bit, a garbled or truncated file, a deleted array file,
manifest or metadata, edited metadata) is named with what is wrong, moved aside to
``<workdir>/damaged_checkpoints`` (never deleted), and the next older step is tried, with a
loud :class:`CheckpointDamageWarning`. With no intact step left the run stops with
:class:`CheckpointDamagedError`; it never starts over silently in a workdir that has history.
Nothing is pickled: metadata is JSON, validated on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from experiments.validation import UserError

FORMAT = "jaxmp-experiments-checkpoint/1"
FILE_LIST = "state_files.json"  # per-file checksums of the state item, written after finalize
# Settings a resumed run must share with the run that wrote the checkpoint.
MUST_MATCH = ("policy", "loss_scale", "master_weights", "engine", "seed", "model", "dataset",
              "global_batch_size", "num_train_steps")
_META_TYPES = {"policy": str, "loss_scale": str, "master_weights": bool, "engine": str, "seed": int,
               "model": str, "dataset": str, "global_batch_size": int, "num_train_steps": int,
               "data_position": int, "history": list}


class CheckpointMismatchError(UserError):
    """The workdir holds checkpoints of a different run (policy, loss scale, model...)."""


class CheckpointDamagedError(UserError):
    """The workdir holds checkpoints, but none of them is intact."""


class CheckpointDamageWarning(UserWarning):
    """A checkpoint step was damaged and skipped; the run resumed from an older one."""


class _Damaged(Exception):
    """One step failed verification; the message says which array and what."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _key(path) -> str:
    """A path as ``a/b/0``: the same for a state and for orbax's template-free dict of it."""
    return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


def array_records(host_state: Any) -> list[dict]:
    """Path, shape, dtype and SHA-256 of the bytes of every leaf of a host (numpy) state."""
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(host_state):
        a = np.ascontiguousarray(np.asarray(x))
        out.append({"path": jax.tree_util.keystr(path), "key": _key(path), "shape": list(a.shape),
                    "dtype": str(a.dtype), "sha256": _sha256(a.tobytes())})
    return out


def make_manifest(host_state: Any, meta: dict, step: int) -> dict:
    """The manifest of one step (see the module docstring); its last field is its own SHA-256."""
    import jaxmp

    manifest = {"format": FORMAT, "step": int(step), "data_position": int(meta["data_position"]),
                "jaxmp_version": jaxmp.__version__, "meta_sha256": _sha256(_canonical(meta)),
                "arrays": array_records(host_state)}
    manifest["manifest_sha256"] = _sha256(_canonical(manifest))
    return manifest


def _check_manifest(manifest: Any, step: int) -> None:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("arrays"), list):
        raise _Damaged("manifest: not a manifest object")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if manifest.get("manifest_sha256") != _sha256(_canonical(body)):
        raise _Damaged("manifest: its own checksum does not match (edited or corrupted)")
    if manifest.get("format") != FORMAT:
        raise _Damaged(f"manifest: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("step") != step:
        raise _Damaged(f"manifest: written for step {manifest.get('step')!r}, found in step directory {step}")


def check_meta(meta: Any, manifest: dict, step: int) -> dict:
    """Validates a step's metadata against its manifest and the expected schema.

    Raises:
      _Damaged: naming the field that is wrong.
    """
    if not isinstance(meta, dict):
        raise _Damaged("metadata: not a JSON object")
    if manifest["meta_sha256"] != _sha256(_canonical(meta)):
        raise _Damaged("metadata: content differs from what was saved (edited or corrupted; checksum mismatch)")
    for key, typ in _META_TYPES.items():
        if not isinstance(meta.get(key), typ) or (typ is int and isinstance(meta.get(key), bool)):
            raise _Damaged(f"metadata: field {key!r} is {meta.get(key)!r}, expected a {typ.__name__}")
    pos = meta["data_position"]
    if pos != step or pos != manifest["data_position"] or not 0 < pos <= meta["num_train_steps"]:
        raise _Damaged(f"metadata: data_position {pos} does not match step {step} "
                       f"(manifest says {manifest['data_position']})")
    return meta


def _check_arrays(restored: Any, manifest: dict) -> None:
    got = {r["key"]: r for r in array_records(restored)}
    want = manifest["arrays"]
    if sorted(got) != sorted(w["key"] for w in want):
        missing = sorted({w["key"] for w in want} - set(got)) or sorted(set(got) - {w["key"] for w in want})
        raise _Damaged(f"arrays: the saved tree and the manifest differ (first: {missing[:1]})")
    for w in want:
        g = got[w["key"]]
        for field in ("shape", "dtype", "sha256"):
            if g[field] != w[field]:
                what = "content checksum mismatch" if field == "sha256" else f"{field} {g[field]} != saved {w[field]}"
                raise _Damaged(f"array {w['path']}: {what}")


class Restored(NamedTuple):
    """An intact checkpoint: the host state, its metadata and its step."""

    state: Any
    meta: dict
    step: int


class Checkpointer:
    """Saves and verifies ``(state, meta)`` under ``<workdir>/checkpoints``.

    Args:
      workdir: the run's directory.
      max_to_keep: how many recent checkpoints to keep (>= 1).

    Example:
      >>> ckpt = Checkpointer("/tmp/run")  # doctest: +SKIP
      >>> ckpt.save(10, state, {"data_position": 10, ...})  # doctest: +SKIP
      >>> restored = ckpt.restore_latest(host_template, expected_meta)  # doctest: +SKIP
    """

    def __init__(self, workdir: str, max_to_keep: int = 2):
        import orbax.checkpoint as ocp  # lazy: only runs that checkpoint pay the import

        if max_to_keep < 1:
            raise UserError(f"keep_checkpoints={max_to_keep} is invalid: use an integer >= 1.")
        self._ocp = ocp
        self.workdir = os.path.abspath(workdir)
        self.directory = os.path.join(self.workdir, "checkpoints")
        # Synchronous saves: the step that follows may donate (overwrite) the state buffers,
        # and a save that returned is a checkpoint a SIGKILL cannot take back.
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        """Finalized steps, oldest first (intact or not)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Writes ``state`` (device or host arrays), the JSON-able ``meta`` and their manifest at ``step``."""
        ocp = self._ocp
        # A host copy: the state is replicated, and one replica on the host is the same bytes
        # (handing orbax replicated device arrays costs a small compile per leaf).
        host = jax.device_get(state)
        manifest = make_manifest(host, meta, step)
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(host), meta=ocp.args.JsonSave(meta),
            manifest=ocp.args.JsonSave(manifest)), force=True)
        self._manager.wait_until_finished()
        self._write_file_list(step)

    def _write_file_list(self, step: int) -> None:
        """Checksums of the files orbax wrote for the state, so damage is found before orbax reads them.

        Written after orbax's atomic finalize (the file names exist only then): a step killed in
        between has no list and is verified by the array checksums alone.
        """
        state_dir = os.path.join(self.directory, str(step), "state")
        files = {}
        for root, _, names in os.walk(state_dir):
            for name in names:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    files[os.path.relpath(path, state_dir)] = {"size": os.path.getsize(path),
                                                               "sha256": _sha256(f.read())}
        body = {"files": files, "sha256": _sha256(_canonical(files))}
        out = os.path.join(self.directory, str(step), FILE_LIST)
        with open(out + ".tmp", "w") as f:
            json.dump(body, f)
        os.replace(out + ".tmp", out)

    def _check_files(self, step: int) -> None:
        path = os.path.join(self.directory, str(step), FILE_LIST)
        if not os.path.exists(path):
            return
        try:
            with open(path) as f:
                body = json.load(f)
            files = body["files"]
            assert body["sha256"] == _sha256(_canonical(files))
        except Exception:  # noqa: BLE001 - any defect of the list itself is damage
            raise _Damaged(f"{FILE_LIST}: unreadable or edited") from None
        state_dir = os.path.join(self.directory, str(step), "state")
        for rel, want in sorted(files.items()):
            full = os.path.join(state_dir, rel)
            if not os.path.isfile(full):
                raise _Damaged(f"file state/{rel}: missing")
            size = os.path.getsize(full)
            if size != want["size"]:
                raise _Damaged(f"file state/{rel}: {size} bytes, saved {want['size']} (truncated or overwritten)")
            with open(full, "rb") as f:
                if _sha256(f.read()) != want["sha256"]:
                    raise _Damaged(f"file state/{rel}: content checksum mismatch")

    def _read_json(self, step: int, item: str) -> Any:
        ocp = self._ocp
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]
        except Exception as e:  # noqa: BLE001 - any failure to read is damage, reported by name
            raise _Damaged(f"{item}: missing or unreadable ({type(e).__name__})") from None

    def _verify(self, step: int, template: Any, expected: dict) -> Restored:
        manifest = self._read_json(step, "manifest")
        _check_manifest(manifest, step)
        meta = check_meta(self._read_json(step, "meta"), manifest, step)
        diffs = {k: (meta.get(k), expected[k]) for k in MUST_MATCH if k in expected and meta.get(k) != expected[k]}
        if diffs:
            detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
            raise CheckpointMismatchError(
                f"{self.directory} holds checkpoints of a different run ({detail}). Resuming under different "
                "settings would mix two runs: use a new --workdir, or move that directory away to start over.")
        want = [(a.get("path"), a.get("shape"), a.get("dtype")) for a in manifest["arrays"]]
        have = [(r["path"], r["shape"], r["dtype"]) for r in array_records(template)]
        if want != have:
            diff = next((i for i, (w, h) in enumerate(zip(want, have)) if w != h), min(len(want), len(have)))
            raise CheckpointMismatchError(
                f"step {step} in {self.directory} holds a state of a different structure (e.g. another model "
                f"size): at leaf {diff} the checkpoint has {want[diff] if diff < len(want) else 'nothing'}, this "
                f"run {have[diff] if diff < len(have) else 'nothing'}. Use a new --workdir.")
        self._check_files(step)
        ocp = self._ocp
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template)))
        except Exception as e:  # noqa: BLE001 - orbax/TensorStore errors on damaged files become a report
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            raise _Damaged(f"state arrays unreadable ({type(e).__name__}: {first})") from None
        _check_arrays(state["state"], manifest)
        return Restored(state["state"], meta, step)

    def _quarantine(self, step: int) -> str:
        """Moves a damaged step out of orbax's way (kept for inspection, never deleted)."""
        dest = os.path.join(self.workdir, "damaged_checkpoints", f"{step}.{time.strftime('%Y%m%dT%H%M%S')}")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.move(os.path.join(self.directory, str(step)), dest)
        return dest

    def restore_latest(self, template: Any, expected: dict) -> Restored | None:
        """The newest intact step, verified against its manifest; ``None`` in an empty directory.

        Args:
          template: the state as host (numpy) arrays of the right structure, shapes and dtypes.
          expected: the current run's values of :data:`MUST_MATCH`.

        Returns:
          A :class:`Restored`, or ``None`` when there is nothing to resume.

        Raises:
          CheckpointMismatchError: the intact checkpoint belongs to a different run.
          CheckpointDamagedError: checkpoints exist but none is intact.
        """
        template = jax.tree_util.tree_map(np.asarray, template)
        damage = []
        for step in reversed(self.steps()):
            try:
                restored = self._verify(step, template, expected)
            except _Damaged as e:
                damage.append((step, str(e)))
                continue
            for bad, what in damage:
                where = self._quarantine(bad)
                warnings.warn(f"checkpoint step {bad} in {self.directory} is DAMAGED ({what}); moved to {where}. "
                              f"Resuming from step {step}, the newest intact one.", CheckpointDamageWarning,
                              stacklevel=2)
            if damage:
                self._manager.reload()
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


def load_state(workdir: str, step: int | None = None) -> tuple[int, Any]:
    """Reads a checkpoint's state as numpy arrays without a template and checks it against its manifest.

    Args:
      workdir: the run's directory.
      step: which step; default the newest.

    Returns:
      ``(step, state)``.

    Raises:
      CheckpointDamagedError: the step does not match its manifest.
    """
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"))
    try:
        step = manager.latest_step() if step is None else step
        out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                            manifest=ocp.args.JsonRestore()))
    finally:
        manager.close()
    try:
        _check_manifest(out["manifest"], step)
        _check_arrays(out["state"], out["manifest"])
    except _Damaged as e:
        raise CheckpointDamagedError(f"step {step} of {workdir}: {e}") from None
    return step, out["state"]
