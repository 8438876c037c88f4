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

The implementation is split by concern, each in a private module of this package:
``_format`` (names, versions, the metadata schema, hashing), ``_records`` (what is recorded when a
step is written), ``_verify`` (damage detection), ``_agree`` (multi-process verdicts),
``_write_errors`` (a failed write as one clear error), ``_checkpointer`` (the orbax adapter:
`Checkpointer`) and ``_load`` (`load_state`). Import the names from ``experiments.checkpoint``.
"""

from experiments.checkpoint._agree import agreed, allgather_text
from experiments.checkpoint._checkpointer import Checkpointer, Restored, restore_target
from experiments.checkpoint._errors import (CheckpointDamagedError, CheckpointDamageWarning, CheckpointMismatchError,
                                            CheckpointWriteError)
from experiments.checkpoint._errors import _Damaged as _Damaged  # tests reach the private names here
from experiments.checkpoint._format import FILE_LIST, FORMAT, MUST_MATCH, OLD_FORMATS, SETTINGS, SHARDS
from experiments.checkpoint._format import _canonical as _canonical, _key as _key, _sha256 as _sha256
from experiments.checkpoint._load import load_state
from experiments.checkpoint._records import array_specs, make_manifest, make_shard_file, region, saveable, shard_records
from experiments.checkpoint._verify import (check_file_list, check_meta, check_shards, held_by_one_process,
                                            read_shard_records, settings_diffs, unreadable)
from experiments.checkpoint._format import RESHARDABLE
from experiments.checkpoint._write_errors import errno_name, write_failure
from experiments.validation import UserError

__all__ = [
    "FILE_LIST", "FORMAT", "MUST_MATCH", "OLD_FORMATS", "RESHARDABLE", "SETTINGS", "SHARDS", "CheckpointDamageWarning",
    "CheckpointDamagedError", "CheckpointMismatchError", "CheckpointWriteError", "Checkpointer", "Restored", "UserError",
    "agreed", "allgather_text", "array_specs", "check_file_list", "check_meta", "check_shards", "held_by_one_process", "errno_name",
    "load_state", "make_manifest", "make_shard_file", "read_shard_records", "region", "restore_target", "saveable",
    "settings_diffs", "shard_records", "unreadable", "write_failure",
]
