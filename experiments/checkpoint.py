"""Verified orbax checkpoints of the whole training state, for exact resumption, on one process or many.

Each step is one orbax ``CheckpointManager`` step with four items, finalized atomically
(orbax writes a temporary directory and renames it once every process is done):

* ``state``: the train state pytree. Fully replicated leaves (all of a data-parallel state)
  are saved as host copies, which process 0 writes; leaves sharded over devices are handed to
  orbax as ``jax.Array`` objects, and each process writes its own shards.
* ``meta``: JSON -- the data position, the settings a resume must share, the metric history;
* ``manifest``: JSON, from process 0 -- per array its path, global shape and dtype, the SHA-256
  of ``meta``, the data position, the number of processes, the jaxmp and format versions, and
  its own SHA-256;
* ``shards``: one JSON file per process, ``shards/process_<i>.json``: each piece of an array
  that process writes -- for a sharded array every addressable shard with ``replica_id == 0``
  (orbax's rule for which copy of a shard is saved), for a host copy (process 0 only) the whole
  array -- with its global index (``[start, stop]`` per dimension), shape, dtype and the
  SHA-256 of its bytes, hashed from the very data handed to orbax; and the file's own SHA-256.
  Together the files cover every element of every array exactly once; no process ever needs
  data it does not hold.

After orbax has finalized the step, each process adds ``state_files_process_<i>.json``: the size
and SHA-256 of the files of the state it wrote (orbax's ``ocdbt.process_<i>/`` and
``array_metadatas/process_<i>``; process 0 also the shared files), so damaged files are found
before orbax (TensorStore) reads them. A step killed before these lists exist is verified by
its shard checksums alone; a step without its manifest or any process's shard file is damaged.

`Checkpointer.restore_latest` verifies a step before trusting it, each process its part:
first the metadata, the shard files and its share of the file lists, then, after restoring,
every recorded piece that lies in the data it holds, whichever process wrote it (the shard
index says where the piece is). After each of the two phases the processes exchange verdicts
(``process_allgather``), so a step one process finds damaged is rejected by all, no process
reads a step another found damaged, and no process waits at a barrier another never reaches.
A damaged step (a flipped bit, a garbled or truncated file, a deleted array file, manifest,
shard file or metadata, edited metadata) is named with what is wrong -- step, array, shard
index, and in a multi-process run which process found it --, moved aside by process 0 to
``<workdir>/damaged_checkpoints`` (never deleted), and the next older step is tried, with a loud
`CheckpointDamageWarning` on every process. With no intact step left the run stops with
`CheckpointDamagedError`; it never starts over silently in a workdir that has history.
Nothing is pickled: metadata is JSON, validated on load. The checkpoint directory must be one
filesystem shared by all processes, as orbax requires.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
import warnings
from typing import Any, Callable, NamedTuple, TypeVar

import jax
import numpy as np

from experiments.orbax_noise import drop_closed_loop_noise, quiet_save
from experiments.validation import RunFailedError, UserError

FORMAT = "jaxmp-experiments-checkpoint/2"
# Formats this version recognises but cannot verify (whole-array checksums, no shard files).
OLD_FORMATS = ("jaxmp-experiments-checkpoint/1",)
SHARDS = "shards"  # orbax item: shards/process_<i>.json, the checksums of what process i wrote
FILE_LIST = "state_files_process_{}.json"  # per-process file checksums of the state, written after finalize
_VERDICT_BYTES = 2048  # the longest verdict one process sends the others
# Settings a resumed run must share with the run that wrote the checkpoint.
MUST_MATCH = ("policy", "loss_scale", "master_weights", "engine", "seed", "model", "dataset",
              "global_batch_size", "num_train_steps")
_META_TYPES = {"policy": str, "loss_scale": str, "master_weights": bool, "engine": str, "seed": int,
               "model": str, "dataset": str, "global_batch_size": int, "num_train_steps": int,
               "data_position": int, "history": list}
# Besides MUST_MATCH, ``meta["settings"]`` holds every config value that changes what a run
# computes (flattened ``--config.<field>`` names -> JSON values, see experiments.train.run_settings);
# a resume, or a finished run read back, under other values is refused, naming each field.
SETTINGS = "settings"
# Settings recorded but free to change on a resume: the device count and the per-device batch it
# implies. The global batch (MUST_MATCH) and every other setting still must match, so the run
# computes the same steps on the same examples; the state, saved as host copies or per shard, is
# restored onto the new mesh (orbax reshards; `check_shards` verifies the pieces however they are
# split). Only the order of the cross-device gradient sum changes, by rounding.
RESHARDABLE = ("num_devices", "per_device_batch_size")
_T = TypeVar("_T")


class CheckpointMismatchError(UserError):
    """The workdir holds checkpoints of a different run (policy, loss scale, model...)."""


class CheckpointDamagedError(UserError):
    """The workdir holds checkpoints, but none of them is intact."""


class CheckpointWriteError(RunFailedError):
    """A checkpoint (or another file of the run) could not be written: a full disk, a quota, an I/O error."""


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


# ---- what is recorded ----


def region(index: tuple, shape: Any) -> list[list[int]]:
    """A shard's global index as ``[start, stop]`` per dimension.

    Args:
      index: a tuple of slices, as ``jax.Shard.index`` (``()`` or ``slice(None)``: whole dims).
      shape: the global shape of the array.

    Returns:
      ``[[start, stop], ...]``, one pair per dimension.

    Raises:
      ValueError: a strided slice (no shard of a jax.Array has one).
    """
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape):
        start, stop, stride = s.indices(n)
        if stride != 1:
            raise ValueError(f"shard index {index} has a strided slice; shards are contiguous blocks")
        out.append([start, stop])
    return out


def _contains(outer: list, inner: list) -> bool:
    return all(o[0] <= i[0] and i[1] <= o[1] for o, i in zip(outer, inner))


def _record(path, data: Any, where: list[list[int]]) -> dict:
    a = np.asarray(data)  # not ascontiguousarray: it makes 0-d arrays 1-d; tobytes() is C order anyway
    return {"path": jax.tree_util.keystr(path), "key": _key(path), "index": where, "shape": list(a.shape),
            "dtype": str(a.dtype), "sha256": _sha256(a.tobytes())}


def saveable(state: Any) -> Any:
    """What orbax is handed: host copies of fully replicated leaves, sharded ``jax.Array`` leaves as they are.

    A host copy of a replicated leaf holds the same bytes as any replica and spares orbax a
    small compile per leaf; a sharded array has no host copy on any one process under multi-host,
    so orbax gets the device array and each process writes its own shards.

    Args:
      state: a pytree of host arrays and/or ``jax.Array`` objects.

    Returns:
      The same pytree with every leaf but the sharded ``jax.Array`` ones fetched to the host.
    """
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_replicated:
            return x
        return jax.device_get(x)

    return jax.tree_util.tree_map(one, state)


def shard_records(state: Any) -> list[dict]:
    """The checksum records of the pieces of ``state`` that this process writes.

    Args:
      state: a pytree as returned by `saveable`.

    Returns:
      Per piece: ``path``, ``key``, global ``index``, ``shape``, ``dtype`` and ``sha256`` of its bytes.
    """
    me = jax.process_index()
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(x, jax.Array):
            # Of the copies of a shard, orbax saves the one with replica_id 0 (its single-replica
            # rule; replica-parallel saving splits that copy's bytes among replicas, which leaves
            # what the record covers unchanged).
            out += [_record(path, s.data, region(s.index, x.shape)) for s in x.addressable_shards
                    if s.replica_id == 0]
        elif me == 0:  # orbax writes host arrays from the primary host
            out.append(_record(path, x, region((), np.shape(x))))
    return out


def array_specs(tree: Any) -> list[dict]:
    """Path, key, global shape and dtype of every leaf (host array, ``jax.Array`` or ``ShapeDtypeStruct``)."""
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            x = np.asarray(x)
        out.append({"path": jax.tree_util.keystr(path), "key": _key(path), "shape": list(x.shape),
                    "dtype": str(np.dtype(x.dtype))})
    return out


def make_manifest(state: Any, meta: dict, step: int) -> dict:
    """The manifest of one step (see the module docstring); its last field is its own SHA-256."""
    import jaxmp

    manifest = {"format": FORMAT, "step": int(step), "data_position": int(meta["data_position"]),
                "jaxmp_version": jaxmp.__version__, "meta_sha256": _sha256(_canonical(meta)),
                "process_count": jax.process_count(), "arrays": array_specs(state)}
    manifest["manifest_sha256"] = _sha256(_canonical(manifest))
    return manifest


def make_shard_file(records: list[dict], step: int) -> dict:
    """This process's ``shards/process_<i>.json`` of one step; its last field is its own SHA-256."""
    body = {"format": FORMAT, "step": int(step), "process_index": jax.process_index(),
            "process_count": jax.process_count(), "shards": records}
    body["sha256"] = _sha256(_canonical(body))
    return body


# ---- verification ----


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


def _check_cover(array: dict, records: list[dict]) -> None:
    """The records of one array lie inside it, have its dtype, and add up to its size."""
    shape, total = array["shape"], 0
    for r in records:
        idx = r["index"]
        fits = (len(idx) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(idx, shape))
                and r["shape"] == [b - a for a, b in idx] and r["dtype"] == array["dtype"])
        if not fits:
            raise _Damaged(f"array {array['path']}: the shard record {idx} of process {r['process']} "
                           f"({r['shape']} {r['dtype']}) does not fit the array ({shape} {array['dtype']})")
        total += math.prod(b - a for a, b in idx)
    if total != math.prod(shape):
        # Pieces of one array never overlap (replica-0 shards tile it), so a wrong sum means
        # a piece is missing or recorded twice.
        raise _Damaged(f"array {array['path']}: its shard checksums cover {total} of {math.prod(shape)} elements")


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


def _blocks(x: Any) -> list[tuple[list, Any]]:
    """The blocks of a restored leaf this process holds: ``(global region, data)``, each block once."""
    if isinstance(x, jax.Array):
        seen: dict = {}
        for s in x.addressable_shards:
            seen.setdefault(str(region(s.index, x.shape)), (region(s.index, x.shape), s.data))
        return list(seen.values())
    a = np.asarray(x)
    return [(region((), a.shape), a)]


def _overlap(a: list, b: list) -> list | None:
    """The intersection of two regions (``[start, stop]`` per dimension), or ``None`` if empty."""
    out = [[max(x[0], y[0]), min(x[1], y[1])] for x, y in zip(a, b)]
    return out if all(lo < hi for lo, hi in out) else None


def _size(r: list) -> int:
    return math.prod(b - a for a, b in r)


def _covers(blocks: list[list], piece: list) -> bool:
    """Whether distinct blocks of one sharding (they never overlap) together hold all of ``piece``."""
    return sum(_size(o) for o in (_overlap(b, piece) for b in blocks) if o is not None) == _size(piece)


def _assemble(piece: list, blocks: list[tuple[list, Any]]) -> Any | None:
    """The data of ``piece`` put together from this process's blocks, or ``None`` if they do not
    hold all of it. A piece saved on fewer devices than it is restored onto (4 -> 8) lies across
    several blocks; the usual case, one block holding it whole, is a slice and no copy."""
    whole = next(((b, d) for b, d in blocks if _contains(b, piece)), None)
    if whole is not None:
        b, d = whole
        return np.asarray(d)[tuple(slice(i[0] - o[0], i[1] - o[0]) for o, i in zip(b, piece))]
    parts = [(o, b, d) for b, d in blocks if (o := _overlap(b, piece)) is not None]
    if sum(_size(o) for o, _, _ in parts) != _size(piece):
        return None
    out = None
    for o, b, d in parts:
        data = np.asarray(d)
        if out is None:
            out = np.empty([hi - lo for lo, hi in piece], data.dtype)
        out[tuple(slice(i[0] - p[0], i[1] - p[0]) for p, i in zip(piece, o))] = \
            data[tuple(slice(i[0] - c[0], i[1] - c[0]) for c, i in zip(b, o))]
    return out


def _compare(record: dict, data: Any) -> None:
    """Hashes ``data``, the restored piece that ``record`` covers."""
    a = np.asarray(data)
    where = f"array {record['path']}: shard {record['index']} (written by process {record['process']})"
    if list(a.shape) != record["shape"] or str(a.dtype) != record["dtype"]:
        raise _Damaged(f"{where}: restored as {list(a.shape)} {a.dtype}, saved {record['shape']} {record['dtype']}")
    if _sha256(a.tobytes()) != record["sha256"]:
        raise _Damaged(f"{where}: content checksum mismatch")


def check_shards(state: Any, by_key: dict[str, list[dict]]) -> int:
    """Checks every recorded piece that lies in the data this process holds of a restored state.

    Args:
      state: the restored state: host arrays (every piece is held) or ``jax.Array`` objects (the
        pieces that this process's addressable shards hold, whole or between them, are).
      by_key: `read_shard_records`.

    Returns:
      How many pieces were checked.

    Raises:
      _Damaged: naming the array, the shard index, the process that wrote it and what differs.
    """
    leaves = jax.tree_util.tree_leaves_with_path(state)
    if sorted(_key(p) for p, _ in leaves) != sorted(by_key):
        missing = sorted(set(by_key).symmetric_difference(_key(p) for p, _ in leaves))
        raise _Damaged(f"arrays: the saved tree and the manifest differ (first: {missing[:1]})")
    checked = 0
    for path, x in leaves:
        blocks = _blocks(x)
        for r in by_key[_key(path)]:
            piece = _assemble(r["index"], blocks)
            if piece is not None:
                _compare(r, piece)
                checked += 1
    return checked


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


def _file_owner(rel: str, process_count: int) -> int:
    """Which process wrote a file of the state, by orbax's per-process names (``ocdbt.process_<i>/``,
    ``array_metadatas/process_<i>``); shared files are process 0's. A name orbax may use one day
    and this does not know only moves work to process 0: every file is still listed once."""
    for part in rel.split(os.sep):
        m = re.fullmatch(r"(?:.*\.)?process_(\d+)", part)
        if m and int(m.group(1)) < process_count:
            return int(m.group(1))
    return 0


def allgather_text(text: str) -> list[str]:
    """``text`` from every process, in process order (a one-process run: just this one).

    Args:
      text: at most ``_VERDICT_BYTES`` bytes of UTF-8 are sent (longer text is cut).

    Returns:
      One string per process.
    """
    if jax.process_count() == 1:
        return [text]
    from jax.experimental import multihost_utils

    raw = text.encode()[:_VERDICT_BYTES]
    buf = np.zeros(_VERDICT_BYTES, np.uint8)
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    rows = multihost_utils.process_allgather(buf)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in np.asarray(rows)]


def agreed(fn: Callable[[], _T], what: str) -> _T:
    """Runs ``fn`` on every process, then makes all processes reach the same verdict.

    Every process calls this at the same point; it exchanges one verdict per process, so it is
    also a barrier. A single-process run raises or returns exactly what ``fn`` did.

    Args:
      fn: one phase of work (verification, writing a file list...).
      what: what the phase is, for messages (``"verifying checkpoint step 20"``).

    Returns:
      ``fn()``'s result when no process found anything wrong.

    Raises:
      _Damaged: some process found the step damaged (each such process named, with what).
      CheckpointMismatchError: some process found a checkpoint of a different run.
      RuntimeError: another process failed in ``fn`` (this process re-raises its own error).
    """
    result, kind, text, error = None, "ok", "", None
    try:
        result = fn()
    except _Damaged as e:
        kind, text = "damaged", str(e)
    except CheckpointMismatchError as e:
        kind, text, error = "mismatch", str(e), e
    except Exception as e:  # noqa: BLE001 - the others must hear of it, or they would wait for this process
        kind, text, error = "error", f"{type(e).__name__}: {e}", e
    verdicts = [v.partition(":")[::2] for v in allgather_text(f"{kind}:{text}")]
    if error is not None:
        raise error
    for i, (k, t) in enumerate(verdicts):
        if k == "error":
            raise RuntimeError(f"process {i} failed while {what}: {t}")
    for k, t in verdicts:
        if k == "mismatch":
            raise CheckpointMismatchError(t)
    damaged = [(i, t) for i, (k, t) in enumerate(verdicts) if k == "damaged"]
    if damaged:
        raise _Damaged(damaged[0][1] if len(verdicts) == 1 else "; ".join(f"process {i}: {t}" for i, t in damaged))
    return result


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
