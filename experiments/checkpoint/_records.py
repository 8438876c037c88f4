"""What is recorded when a step is written: the manifest, the shard files, and which process owns
each file of the state. The host copies for orbax and the per-shard checksum records are
jaxmp's (``jaxmp/parallel/_checksums.py``, shared with `jaxmp.parallel.Checkpointer`)."""

from __future__ import annotations

import os
import re
from typing import Any

import jax

from experiments.checkpoint._format import FORMAT, _canonical, _sha256, shared

region, saveable, shard_records, array_specs = shared.region, shared.saveable, shared.shard_records, shared.array_specs


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
