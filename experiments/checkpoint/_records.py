"""What is recorded when a step is written: host copies for orbax, per-shard checksum records,
the manifest, the shard files, and which process owns each file of the state."""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import numpy as np

from experiments.checkpoint._format import FORMAT, _canonical, _key, _sha256


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


def _file_owner(rel: str, process_count: int) -> int:
    """Which process wrote a file of the state, by orbax's per-process names (``ocdbt.process_<i>/``,
    ``array_metadatas/process_<i>``); shared files are process 0's. A name orbax may use one day
    and this does not know only moves work to process 0: every file is still listed once."""
    for part in rel.split(os.sep):
        m = re.fullmatch(r"(?:.*\.)?process_(\d+)", part)
        if m and int(m.group(1)) < process_count:
            return int(m.group(1))
    return 0
