"""From the host datasets (``experiments.data``) to device batches.

The sources yield numpy batches from a data position (exact resumption); here they are split
over the processes and placed on the mesh as global arrays.
"""

from __future__ import annotations

from typing import Any, Iterator

import jaxmp.parallel as mpp
from experiments import data as data_lib
from experiments.validation import UserError


def get_datasets(config) -> tuple[Any, Any]:
    """The (train, eval) sources of ``config``; an unknown name is a `UserError`."""
    try:
        return data_lib.get_datasets(config)
    except ValueError as e:
        raise UserError(str(e)) from None


def to_device(batch: dict, mesh) -> dict:
    """Host batch (the same global batch on every process) -> global arrays sharded over the mesh.

    Each process keeps only its own rows (``jaxmp.parallel.process_batch_slice``); with one
    process that is the whole batch.
    """
    rows = mpp.process_batch_slice(len(batch["label"]))
    return mpp.make_global_batch({k: v[rows] for k, v in batch.items()}, mesh)


def device_batches(source, batch_size: int, *, seed: int, start: int, mesh) -> Iterator[dict]:
    """Training batches from data position ``start``, on the mesh."""
    for batch in source.train_batches(batch_size, seed=seed, start=start):
        yield to_device(batch, mesh)
