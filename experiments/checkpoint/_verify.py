"""Damage detection: the checks of a step's manifest, metadata, settings, shard files, file lists
and restored pieces, each raising `_Damaged` (or `CheckpointMismatchError`) with what is wrong.
The check of the restored pieces, `check_shards`, is jaxmp's (``jaxmp/parallel/_checksums.py``)."""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from experiments.checkpoint._errors import CheckpointMismatchError, _Damaged
from experiments.checkpoint._format import (_META_TYPES, FILE_LIST, FORMAT, OLD_FORMATS, RESHARDABLE, SHARDS, _canonical, _key,
                                            _sha256, shared)

_covers, _check_cover, check_shards, region = shared._covers, shared.check_cover, shared.check_shards, shared.region


def _check_manifest(manifest: Any, step: int) -> None:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("arrays"), list):
        raise _Damaged("manifest: not a manifest object")
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    if manifest.get("manifest_sha256") != _sha256(_canonical(body)):
        raise _Damaged("manifest: its own checksum does not match (edited or corrupted)")
    if manifest.get("format") in OLD_FORMATS:
        # Intact, but written before per-process shard checksums: not damage, and not resumable here.
        raise CheckpointMismatchError(
            f"checkpoint step {step} was written in format {manifest['format']!r}, which this version cannot "
            f"verify (it reads {FORMAT!r}). Resume it with the version that wrote it, or use a new --workdir.")
    if manifest.get("format") != FORMAT:
        raise _Damaged(f"manifest: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if manifest.get("step") != step:
        raise _Damaged(f"manifest: written for step {manifest.get('step')!r}, found in step directory {step}")
    count = manifest.get("process_count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise _Damaged(f"manifest: process_count {count!r} is not a positive integer")


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


def settings_diffs(saved: Any, now: dict, step: int, directory: str) -> dict[str, tuple[Any, Any]]:
    """``{field: (checkpoint value, current value)}`` for every setting that differs (`RESHARDABLE`
    ones aside: a run may resume on another number of devices with the same global batch).

    Raises:
      CheckpointMismatchError: the checkpoint records no settings (written by an older version), so
        whether this run matches it cannot be checked.
    """
    if not isinstance(saved, dict):
        raise CheckpointMismatchError(
            f"checkpoint step {step} in {directory} records no run settings (it was written by an older version "
            "of experiments/), so resuming it could mix two runs unnoticed. Finish it with the version that wrote "
            "it, or use a new --workdir.")
    return {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k) and k not in RESHARDABLE}


def _flag_value(v: Any) -> str:
    """A JSON value as it is written after ``--config.<field>=``."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return "(" + ",".join(str(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return str(v)


def _read_json_file(path: str, name: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise _Damaged(f"{name}: missing") from None
    except (OSError, ValueError) as e:
        raise _Damaged(f"{name}: unreadable ({type(e).__name__})") from None


def _shard_file(step_dir: str, process: int, step: int) -> list[dict]:
    """The records in process ``process``'s shard file of ``step``, after checking the file itself."""
    name = f"{SHARDS}/process_{process}.json"
    body = _read_json_file(os.path.join(step_dir, SHARDS, f"process_{process}.json"), name)
    if not isinstance(body, dict) or not isinstance(body.get("shards"), list):
        raise _Damaged(f"{name}: not a shard checksum file")
    if body.get("sha256") != _sha256(_canonical({k: v for k, v in body.items() if k != "sha256"})):
        raise _Damaged(f"{name}: its own checksum does not match (edited or corrupted)")
    if (body.get("format"), body.get("step"), body.get("process_index")) != (FORMAT, step, process):
        raise _Damaged(f"{name}: written for step {body.get('step')!r} by process {body.get('process_index')!r} "
                       f"(format {body.get('format')!r}), found as step {step}'s file of process {process}")
    return body["shards"]


def read_shard_records(step_dir: str, manifest: dict, step: int) -> dict[str, list[dict]]:
    """Every process's shard records of a step, by array key, each with the ``process`` that wrote it.

    Args:
      step_dir: the step's directory.
      manifest: its checked manifest (`_check_manifest`).
      step: the step.

    Returns:
      ``{key: [record, ...]}`` for every array of the manifest.

    Raises:
      _Damaged: a shard file is missing, edited or malformed, or the records do not tile an array.
    """
    by_key: dict[str, list[dict]] = {a["key"]: [] for a in manifest["arrays"]}
    for process in range(manifest["process_count"]):
        for r in _shard_file(step_dir, process, step):
            if not isinstance(r, dict) or r.get("key") not in by_key:
                raise _Damaged(f"{SHARDS}/process_{process}.json: a record of an array the manifest does not "
                               f"list ({r.get('path') if isinstance(r, dict) else r!r})")
            by_key[r["key"]].append({**r, "process": process})
    try:
        for a in manifest["arrays"]:
            _check_cover(a, by_key[a["key"]])
    except (TypeError, ValueError, KeyError) as e:
        raise _Damaged(f"{SHARDS}: malformed shard records ({type(e).__name__}: {e})") from None
    return by_key


def held_by_one_process(piece: list, by_process: dict[int, dict[str, list]]) -> bool:
    """Whether one process's blocks together hold all of a saved piece.

    Args:
      piece: the piece's global region, ``[start, stop]`` per dimension.
      by_process: per process, its distinct blocks of the restore layout (``{str(region): region}``).

    Example:
      >>> held_by_one_process([[0, 8]], {0: {"[[0, 4]]": [[0, 4]], "[[4, 8]]": [[4, 8]]}})
      True
      >>> held_by_one_process([[0, 8]], {0: {"[[0, 4]]": [[0, 4]]}, 1: {"[[4, 8]]": [[4, 8]]}})
      False
    """
    # The usual case, restoring onto the layout it was saved with, is a dict lookup.
    return any(str(piece) in blocks or _covers(list(blocks.values()), piece) for blocks in by_process.values())


def _check_layout(target: Any, by_key: dict[str, list[dict]], step: int) -> None:
    """Every recorded piece lies in the blocks one process holds of the restore layout, so that
    process can check it: the same layout, a coarser one, or a finer one (saved on 4 devices,
    restored onto 8: a piece lies across two blocks of one process, `_assemble` joins them).
    Only a piece split between processes could not be checked by anyone.

    Raises:
      CheckpointMismatchError: naming the array, a piece no one process holds, and both layouts.
    """
    for path, t in jax.tree_util.tree_leaves_with_path(target):
        if not isinstance(t, jax.ShapeDtypeStruct):
            continue  # a host array: every process holds all of it
        by_process: dict[int, dict[str, list]] = {}
        for d, i in t.sharding.devices_indices_map(t.shape).items():
            b = region(i, t.shape)
            by_process.setdefault(d.process_index, {})[str(b)] = b
        for r in by_key[_key(path)]:
            piece = r["index"]
            if held_by_one_process(piece, by_process):
                continue
            raise CheckpointMismatchError(
                f"step {step}: array {r['path']} was saved in pieces (e.g. {piece}, written by process "
                f"{r['process']}) that the restore sharding {t.sharding} splits between processes, so no process "
                "could verify them. Restore onto a layout where each process holds whole saved pieces (the one it "
                "was saved with, a coarser or finer one on the same processes, or host arrays), then reshard.")


def check_file_list(step_dir: str, process: int) -> None:
    """Checks the files process ``process`` wrote in one step against its list (sizes, SHA-256).

    Run before orbax (TensorStore) reads the state: a truncated, zeroed or bit-flipped file is
    named here, instead of failing inside TensorStore with ``DATA_LOSS``/``OUT_OF_RANGE`` or,
    worse, being read. No list (a run killed between finalize and writing it) passes.

    Raises:
      _Damaged: a file is missing, has another size or content, or the list itself is damaged.
    """
    name = FILE_LIST.format(process)
    path = os.path.join(step_dir, name)
    if not os.path.exists(path):
        return
    try:
        with open(path) as f:
            body = json.load(f)
        files = body["files"]
        assert body["sha256"] == _sha256(_canonical([process, files]))
    except Exception:  # noqa: BLE001 - any defect of the list itself is damage
        raise _Damaged(f"{name}: unreadable or edited") from None
    state_dir = os.path.join(step_dir, "state")
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


def unreadable(error: BaseException) -> _Damaged:
    """The damage report for an orbax/TensorStore failure to read a step's arrays.

    TensorStore raises ``ValueError``s whose text starts with a status (``DATA_LOSS``,
    ``OUT_OF_RANGE``, ``FAILED_PRECONDITION``, ``NOT_FOUND``...), orbax its own errors; on a step
    that passed its checks any of them means a damaged file, so the first line is kept as the
    detail and the rest (a chain of TensorStore contexts) dropped.
    """
    first = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
    return _Damaged(f"state arrays unreadable ({type(error).__name__}: {first})")
