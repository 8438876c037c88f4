"""`Checkpointer`: orbax's ``StandardCheckpointer`` plus a SHA-256 of every saved piece, checked on restore.

A checkpoint is one orbax checkpoint directory with two items, finalized atomically (orbax writes
a temporary directory and renames it, so a save killed midway leaves no checkpoint at ``path``):

* ``state``: the state pytree, written by orbax's ``StandardCheckpointHandler`` (each process
  writes the shards its devices hold; fully replicated leaves are written once, as host copies);
* ``checksums``: one JSON file per process, ``checksums/process_<i>.json``: every piece that
  process wrote (its leaf, global index, shape, dtype and the SHA-256 of its bytes, see
  ``_checksums.py``), the path, shape and dtype of every leaf, and the file's own SHA-256.

`Checkpointer.restore` reads the checksum files, has orbax restore the state, then hashes every
restored piece this process holds. orbax (TensorStore) checks only part of what it reads
(OCDBT's index); a flipped bit in a chunk of codes or moments restores as a different value
without an error, which is what the checksums catch. orbax is imported when a `Checkpointer` is
made, not with ``jaxmp``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import numpy as np

from jaxmp._typing import PyTree
from jaxmp.parallel._checks import target_mismatch_error
from jaxmp.parallel._checksums import (Damaged, array_specs, canonical, check_cover, check_shards, saveable, sha256,
                                       shard_records)

FORMAT = "jaxmp-checkpoint/1"
_STATE, _CHECKSUMS = "state", "checksums"


def _checksum_file(path: str, process: int) -> dict:
    """One process's checksum file, after checking the file's own SHA-256 and header."""
    name = f"{_CHECKSUMS}/process_{process}.json"
    try:
        with open(os.path.join(path, _CHECKSUMS, f"process_{process}.json"), "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        raise Damaged(f"{name}: missing") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise Damaged(f"{name}: unreadable ({type(e).__name__})") from None
    if not isinstance(body, dict) or body.get("sha256") != sha256(canonical({k: v for k, v in body.items()
                                                                                 if k != "sha256"})):
        raise Damaged(f"{name}: its own checksum does not match (edited or corrupted)")
    if (body.get("format"), body.get("process_index")) != (FORMAT, process):
        raise Damaged(f"{name}: format {body.get('format')!r} of process {body.get('process_index')!r}, "
                       f"expected {FORMAT!r} of process {process}")
    return body


def _read_checksums(path: str) -> tuple[list[dict], dict[str, list[dict]]]:
    """The saved leaves (path, key, shape, dtype) and every process's piece records by leaf key.

    Raises:
      Damaged: a checksum file is missing, edited or malformed, or the records do not tile a leaf.
    """
    first = _checksum_file(path, 0)
    count, arrays = first.get("process_count"), first.get("arrays")
    if not isinstance(count, int) or count < 1 or not isinstance(arrays, list):
        raise Damaged(f"{_CHECKSUMS}/process_0.json: malformed (process_count {count!r})")
    try:
        by_key: dict[str, list[dict]] = {a["key"]: [] for a in arrays}
        for process in range(count):
            for r in (first if process == 0 else _checksum_file(path, process))["pieces"]:
                by_key[r["key"]].append({**r, "process": process})
        for a in arrays:
            check_cover(a, by_key[a["key"]])
    except (TypeError, ValueError, KeyError) as e:
        raise Damaged(f"{_CHECKSUMS}: malformed piece records ({type(e).__name__}: {e})") from None
    return arrays, by_key


def _as_target(template: Any) -> Any:
    """What orbax restores into: ``ShapeDtypeStruct`` leaves with shardings, or host arrays.

    A ``jax.Array`` is restored onto its own sharding, a ``ShapeDtypeStruct`` without one (from
    ``jax.eval_shape``) onto the default device; neither is ever filled with stand-in values, which a
    pytree that checks its fields when rebuilt (a loss scale must be positive) would refuse.
    """
    def one(x):
        if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
            sharding = x.sharding if x.sharding is not None else jax.sharding.SingleDeviceSharding(
                jax.local_devices()[0])
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return np.asarray(x)

    return jax.tree_util.tree_map(one, template)


def _unreadable(error: BaseException, arrays: list[dict]) -> str:
    """orbax's or TensorStore's failure to read the state, with the leaf it names where it names one.

    TensorStore's message is one long line: its status (``DATA_LOSS``, ``OUT_OF_RANGE``...), a chain
    of contexts naming the leaf as orbax stores it (``opt_state.inner_state.0.mu.w/``), the reason
    last, then its specs; the leaf (in the state's own spelling) and the reason are kept.
    """
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text.split(" [tensorstore_spec", 1)[0]
    names = {a["key"].replace("/", "."): a["path"] for a in arrays}
    stored = re.search(r'Error reading "([^"/]+)/', text)
    leaf = names.get(stored.group(1)) if stored else None
    status = re.match(r"([A-Z_]+): ", text)
    parts = text.split(": ")
    reason = ": ".join(parts[-2:])[:200]
    where = f", first at leaf {leaf}" if leaf else ""
    return f"orbax could not read the state{where} ({status.group(1) if status else type(error).__name__}: {reason})"


class Checkpointer:
    """Saves and restores a training state with orbax, and refuses a damaged checkpoint, naming the leaf.

    Use it as orbax's ``StandardCheckpointer``: ``save(path, state)``, ``restore(path, target)``.
    Each process records the SHA-256 of every piece of the state it writes (per shard, so nothing
    is gathered); `restore` hashes the restored pieces and raises on the first that differs. Any
    pytree of arrays works: params, an optax state with loss scale and masters, quantized
    (`jaxmp.lean`) moments, on one device or sharded over a mesh (ZeRO, FSDP), restored onto the
    layout the target's shardings give. In a multi-process run every process calls `save` and
    `restore` with the same path (one filesystem that all processes share, as orbax requires);
    each process checks the pieces its devices hold whole.

    Example:
      >>> import jax.numpy as jnp, jaxmp, tempfile
      >>> state = {"w": jnp.arange(4.0)}
      >>> path = tempfile.mkdtemp() + "/ckpt"
      >>> with jaxmp.parallel.Checkpointer() as ckptr:
      ...     ckptr.save(path, state)
      ...     restored = ckptr.restore(path, state)
      >>> restored["w"].tolist()
      [0.0, 1.0, 2.0, 3.0]
    """

    def __init__(self):
        import orbax.checkpoint as ocp  # lazy: `import jaxmp` does not import orbax

        self._ocp = ocp
        # Every process writes its own checksum file (primary_host=None: each is "primary" for it)
        # inside the checkpoint, so orbax's atomic finalize covers it.
        checksums = ocp.JsonCheckpointHandler(
            filename=f"process_{jax.process_index()}.json",
            multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None))
        # Synchronous: the train step that follows may donate (overwrite) the state's buffers.
        self._orbax = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
            **{_STATE: ocp.StandardCheckpointHandler(), _CHECKSUMS: checksums}))

    def save(self, path: str | os.PathLike, state: PyTree, *, force: bool = False) -> None:
        """Writes ``state`` and its checksums to ``path``; returns once the checkpoint is finalized.

        Args:
          path: the checkpoint's directory (absolute or relative; it must not exist unless ``force``).
          state: a pytree of arrays: host arrays and/or ``jax.Array`` leaves, sharded or not.
          force: overwrite an existing checkpoint at ``path`` (orbax's ``force``).
        """
        ocp = self._ocp
        state = saveable(state)
        body = {"format": FORMAT, "process_index": jax.process_index(), "process_count": jax.process_count(),
                "arrays": array_specs(state), "pieces": shard_records(state)}
        body["sha256"] = sha256(canonical(body))
        self._orbax.save(os.path.abspath(os.fspath(path)), args=ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(state), _CHECKSUMS: ocp.args.JsonSave(body)}), force=force)

    def restore(self, path: str | os.PathLike, target: PyTree | None = None) -> PyTree:
        """The state saved at ``path``, every piece checked against its SHA-256.

        Args:
          path: a checkpoint written by `save`.
          target: the state's structure: ``jax.ShapeDtypeStruct`` leaves with shardings (e.g.
            `jaxmp.parallel.abstract_state`; restored onto those shardings, on any mesh size),
            ``jax.Array`` leaves (restored onto their shardings), ``jax.eval_shape`` of the state
            (onto the default device), host arrays (restored as host arrays), or ``None`` (the
            saved structure, as orbax restores it without a target).

        Returns:
          The restored state, in ``target``'s structure.

        Raises:
          ValueError: the checkpoint is damaged (a leaf's bytes differ from those saved, a file
            orbax cannot read, a checksum file missing or edited), naming the leaf or the file;
            or ``path`` holds no checkpoint written by `save`.
        """
        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            raise ValueError(f"no checkpoint at {path}: pass the directory given to Checkpointer.save")
        if not os.path.isdir(os.path.join(path, _CHECKSUMS)):
            raise ValueError(
                f"{path} has no {_CHECKSUMS}/ item, so it was not written by jaxmp.parallel.Checkpointer and "
                "cannot be verified. A checkpoint of orbax's own StandardCheckpointer restores, unverified, with "
                f"orbax.checkpoint.StandardCheckpointer().restore({path!r}, target).")
        try:
            arrays, by_key = _read_checksums(path)
            state = self._read_state(path, target, arrays)
            check_shards(state, by_key)
        except Damaged as e:
            raise ValueError(f"checkpoint {path} is damaged: {e}. Its bytes on disk are not the bytes that were "
                             "saved: restore an earlier checkpoint.") from None
        return state

    def _read_state(self, path: str, target: Any, arrays: list[dict]) -> Any:
        """orbax's restore of the ``state`` item into ``target`` (see `restore`)."""
        ocp = self._ocp
        target = None if target is None else _as_target(target)
        try:
            return self._orbax.restore(path, args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardRestore(target)}))[_STATE]
        except Exception as e:  # noqa: BLE001 - TensorStore's DATA_LOSS/OUT_OF_RANGE/... on a damaged file
            saved = [(a.get("key"), a.get("shape"), a.get("dtype")) for a in arrays]
            specs = None if target is None else array_specs(target)
            if specs is not None and saved != [(a["key"], a["shape"], a["dtype"]) for a in specs]:
                # A target of another structure, not damage: name the arrays that differ.
                mismatch = target_mismatch_error(arrays, specs, where=f"checkpoint {path}")
                if mismatch is not None:
                    raise mismatch from e
                raise
            raise Damaged(_unreadable(e, arrays)) from None

    def close(self) -> None:
        """Closes orbax's checkpointer (the ``with`` statement calls it)."""
        self._orbax.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
