"""Checksums of a checkpoint's pieces: what is recorded when a state is saved, and the check of a
restored state against it. No orbax here (``import jaxmp`` stays light); `jaxmp.parallel.Checkpointer`
(``_checkpoint.py``) and the experiments' checkpointer (``experiments/checkpoint/``) both write and
check these records.

A piece is what one process hands orbax of one leaf: for a sharded ``jax.Array`` each addressable
shard with ``replica_id == 0`` (orbax's rule for which copy of a shard is saved), for a host array
(process 0 only) the whole array. Its record holds the leaf's path, its global index (``[start,
stop]`` per dimension), shape, dtype and the SHA-256 of its bytes, hashed from the very data
handed to orbax. A restored state is checked piece by piece, however it is sharded: a piece saved
on 4 devices and restored onto 8 is put together from the blocks that hold it.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import jax
import numpy as np


class Damaged(Exception):
    """A checkpoint failed verification; the message says which leaf (array) and what."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _key(path) -> str:
    """A path as ``a/b/0``: the same for a state and for orbax's template-free dict of it."""
    return "/".join(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path)


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
            "dtype": str(a.dtype), "sha256": sha256(a.tobytes())}


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


def check_cover(array: dict, records: list[dict]) -> None:
    """The records of one array (``path``, ``shape``, ``dtype``) lie inside it, have its dtype,
    and add up to its size.

    Raises:
      Damaged: naming the array and the record that does not fit, or how much is covered.
    """
    shape, total = array["shape"], 0
    for r in records:
        idx = r["index"]
        fits = (len(idx) == len(shape) and all(0 <= a <= b <= n for (a, b), n in zip(idx, shape))
                and r["shape"] == [b - a for a, b in idx] and r["dtype"] == array["dtype"])
        if not fits:
            raise Damaged(f"array {array['path']}: the shard record {idx} of process {r['process']} "
                           f"({r['shape']} {r['dtype']}) does not fit the array ({shape} {array['dtype']})")
        total += math.prod(b - a for a, b in idx)
    if total != math.prod(shape):
        # Pieces of one array never overlap (replica-0 shards tile it), so a wrong sum means
        # a piece is missing or recorded twice.
        raise Damaged(f"array {array['path']}: its shard checksums cover {total} of {math.prod(shape)} elements")


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
        raise Damaged(f"{where}: restored as {list(a.shape)} {a.dtype}, saved {record['shape']} {record['dtype']}")
    if sha256(a.tobytes()) != record["sha256"]:
        raise Damaged(f"{where}: content checksum mismatch")


def check_shards(state: Any, by_key: dict[str, list[dict]]) -> int:
    """Checks every recorded piece that lies in the data this process holds of a restored state.

    Args:
      state: the restored state: host arrays (every piece is held) or ``jax.Array`` objects (the
        pieces that this process's addressable shards hold, whole or between them, are).
      by_key: the records by array key (`_key`), each with the ``process`` that wrote it.

    Returns:
      How many pieces were checked.

    Raises:
      Damaged: naming the array, the shard index, the process that wrote it and what differs.
    """
    leaves = jax.tree_util.tree_leaves_with_path(state)
    if sorted(_key(p) for p, _ in leaves) != sorted(by_key):
        missing = sorted(set(by_key).symmetric_difference(_key(p) for p, _ in leaves))
        raise Damaged(f"arrays: the restored tree and the recorded checksums differ (first: {missing[:1]})")
    checked = 0
    for path, x in leaves:
        blocks = _blocks(x)
        for r in by_key[_key(path)]:
            piece = _assemble(r["index"], blocks)
            if piece is not None:
                _compare(r, piece)
                checked += 1
    return checked
