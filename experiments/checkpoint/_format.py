"""The on-disk format of a checkpoint: item and file names, format versions, the metadata schema,
and the canonical JSON and hashing every checksum is made with."""

from __future__ import annotations

from jaxmp.parallel import _checksums as shared

# The hashing every checksum is made with, and the records of the pieces each process writes and
# their check (`region`, `saveable`, `shard_records`, `array_specs`, `check_shards`, `_Damaged`),
# are jaxmp's (``jaxmp/parallel/_checksums.py``): one implementation for both checkpointers.
_sha256, _canonical, _key = shared.sha256, shared.canonical, shared._key

FORMAT = "jaxmp-experiments-checkpoint/2"
# Formats this version recognises but cannot verify (whole-array checksums, no shard files).
OLD_FORMATS = ("jaxmp-experiments-checkpoint/1",)
SHARDS = "shards"  # orbax item: shards/process_<i>.json, the checksums of what process i wrote
FILE_LIST = "state_files_process_{}.json"  # per-process file checksums of the state, written after finalize
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

