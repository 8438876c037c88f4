"""Job files of ``compare.py --isolate``: one run's arguments as JSON, validated when read.

A job file is data, never code: a workdir from someone else cannot run anything by being read.
"""

from __future__ import annotations

import json

from experiments.validation import UserError

_FIELDS = {"config": dict, "workdir": str, "policy": str, "seed": int, "desc": str, "report": bool}


def write_job(path: str, config, **fields) -> None:
    """Writes ``config`` (a ``ConfigDict``) and the run's ``fields`` (see `_FIELDS`) to ``path``."""
    job = {"config": json.loads(config.to_json()), **fields}
    for key, typ in _FIELDS.items():
        if not isinstance(job.get(key), typ):
            raise TypeError(f"job field {key!r} must be a {typ.__name__}, got {job.get(key)!r}")
    with open(path, "w") as f:
        json.dump(job, f, indent=1)


def read_job(path: str) -> dict:
    """Reads and validates a job file; the config comes back as a ``ConfigDict``.

    Raises:
      UserError: the file is missing, not JSON, or a field is missing or of the wrong type.
    """
    import ml_collections

    try:
        with open(path) as f:
            job = json.load(f)
    except OSError as e:
        raise UserError(f"--job={path!r}: cannot read it ({e.strerror}).") from None
    except ValueError as e:
        raise UserError(f"--job={path!r} is not a JSON job file ({e}).") from None
    if not isinstance(job, dict):
        raise UserError(f"--job={path!r}: expected a JSON object with fields {', '.join(_FIELDS)}.")
    for key, typ in _FIELDS.items():
        if not isinstance(job.get(key), typ) or (typ is int and isinstance(job.get(key), bool)):
            raise UserError(f"--job={path!r}: field {key!r} must be a {typ.__name__}, got {job.get(key)!r}.")
    job["config"] = ml_collections.ConfigDict(job["config"])
    return job
