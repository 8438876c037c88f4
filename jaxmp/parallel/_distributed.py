"""Multi-host set-up through JAX's own engine (``jax.distributed``).

jaxmp adds nothing to JAX's multi-controller model: every process runs the same program,
``jax.devices()`` lists all processes' devices, and the sharded-jit step from
`jaxmp.parallel._sharding` runs unchanged. This module only resolves the connection
settings (arguments, then ``JAXMP_*`` environment variables, then JAX's auto-detection on
TPU pods, SLURM, Open MPI...) and picks working CPU collectives for local testing.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Sequence

import jax

from jaxmp.parallel._checks import logger

#: Environment variables read by `initialize_distributed` when an argument is not given.
ENV_COORDINATOR_ADDRESS = "JAXMP_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXMP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXMP_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAXMP_LOCAL_DEVICE_IDS"


class DistributedInfo(NamedTuple):
    """Where this process stands after [`initialize_distributed`][jaxmp.parallel.initialize_distributed].

    Attributes:
      process_index: this process (0 .. process_count - 1).
      process_count: number of processes.
      local_device_count: devices this process drives.
      device_count: devices over all processes.
      coordinator_address: the coordinator's ``host:port`` (``None`` if auto-detected).
    """

    process_index: int
    process_count: int
    local_device_count: int
    device_count: int
    coordinator_address: str | None


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from e


def _env_ids(name: str) -> list[int] | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return [int(v) for v in raw.replace(" ", "").split(",") if v]
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not a comma-separated list of integers") from e


def _check_int(value: Any, name: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def _check_address(address: Any) -> str:
    if not isinstance(address, str):
        raise TypeError(f"coordinator_address must be a 'host:port' string, got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator_address must look like 'host:port' (e.g. '10.0.0.1:1234'), got {address!r}")
    return address


def distributed_info() -> DistributedInfo:
    """This process's place in the run (works with or without ``jax.distributed``).

    Returns:
      A [`DistributedInfo`][jaxmp.parallel.DistributedInfo]; ``coordinator_address`` is ``None``.

    Example:
      >>> import jaxmp
      >>> jaxmp.parallel.distributed_info().process_count >= 1
      True
    """
    return DistributedInfo(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(), None)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_ids: int | Sequence[int] | None = None, *,
                           cpu_collectives: str | None = "gloo", initialization_timeout: int = 300,
                           **kwargs: Any) -> DistributedInfo:
    """Connects this process to the others with ``jax.distributed.initialize``.

    Each setting comes from the argument if given, else from the environment
    (``JAXMP_COORDINATOR_ADDRESS``, ``JAXMP_NUM_PROCESSES``, ``JAXMP_PROCESS_ID``,
    ``JAXMP_LOCAL_DEVICE_IDS`` as ``0,1``), else is left to JAX, which detects TPU pods,
    SLURM, Open MPI and other clusters on its own: on those call it with no arguments. Call
    it once, at start-up, before anything touches a device (``jax.devices()`` included);
    a second call is a no-op that returns the same information.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: total number of processes.
      process_id: this process's index, in ``[0, num_processes)``.
      local_device_ids: the local devices this process drives (e.g. one GPU per process).
      cpu_collectives: CPU cross-process collectives implementation set before initialising
        (``"gloo"`` works with the pip jaxlib and makes multi-process CPU runs, e.g. tests
        on loopback, possible); ``None`` leaves JAX's setting alone.
      initialization_timeout: seconds to wait for all processes to connect.
      **kwargs: forwarded to ``jax.distributed.initialize`` (e.g. ``heartbeat_timeout_seconds``).

    Returns:
      A [`DistributedInfo`][jaxmp.parallel.DistributedInfo] (process index and count, local and global device counts).

    Raises:
      ValueError: a malformed address or inconsistent numbers, or nothing given and no
        cluster JAX can detect (the message lists the environment variables).
      TypeError: a setting of the wrong type.
      RuntimeError: (from JAX) a device was already used in this process.

    Example:
      >>> import jaxmp
      >>> # process i of 2, on one machine:
      >>> # export JAXMP_COORDINATOR_ADDRESS=127.0.0.1:12345 JAXMP_NUM_PROCESSES=2
      >>> # JAXMP_PROCESS_ID=i python train.py
      >>> info = jaxmp.parallel.initialize_distributed()  # doctest: +SKIP
      >>> info.process_count  # doctest: +SKIP
      2
    """
    if jax.distributed.is_initialized():
        logger.info("jaxmp.parallel: jax.distributed is already initialised; not connecting again")
        return distributed_info()._replace(coordinator_address=coordinator_address
                                           or os.environ.get(ENV_COORDINATOR_ADDRESS))
    if coordinator_address is None:
        coordinator_address = os.environ.get(ENV_COORDINATOR_ADDRESS) or None
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    if local_device_ids is None:
        local_device_ids = _env_ids(ENV_LOCAL_DEVICE_IDS)

    if coordinator_address is not None:
        _check_address(coordinator_address)
    if num_processes is not None:
        _check_int(num_processes, "num_processes", 1)
    if process_id is not None:
        _check_int(process_id, "process_id", 0)
        if num_processes is not None and process_id >= num_processes:
            raise ValueError(f"process_id {process_id} is out of range for num_processes={num_processes}")
    if isinstance(local_device_ids, int) and not isinstance(local_device_ids, bool):
        local_device_ids = [local_device_ids]
    if local_device_ids is not None:
        if isinstance(local_device_ids, (bool, str)) or not hasattr(local_device_ids, "__iter__"):
            raise TypeError(f"local_device_ids must be an int or a sequence of ints (e.g. [0, 1]), got "
                            f"{type(local_device_ids).__name__}: {local_device_ids!r}")
        local_device_ids = [_check_int(i, "local_device_ids entry", 0) for i in local_device_ids]
    if coordinator_address is not None and (num_processes is None or process_id is None):
        # JAX may fill these in from a detected cluster (SLURM...); log it, as a hang waiting for
        # the others is otherwise hard to trace back to a missing setting.
        missing = [n for n, v in (("num_processes", num_processes), ("process_id", process_id)) if v is None]
        logger.info("jaxmp.parallel: %s not given; leaving them to JAX's cluster auto-detection", ", ".join(missing))

    if cpu_collectives is not None:
        # Cross-process collectives on CPU need an implementation; "gloo" ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id, local_device_ids=local_device_ids,
                                   initialization_timeout=initialization_timeout, **kwargs)
    except ValueError as e:
        if coordinator_address is None:
            raise ValueError(
                f"{e} -- no coordinator given and no cluster detected: pass coordinator_address, num_processes and "
                f"process_id, or set {ENV_COORDINATOR_ADDRESS}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} "
                "(on TPU pods and SLURM JAX finds them itself). For a single process, do not call this at all."
            ) from e
        raise
    info = distributed_info()._replace(coordinator_address=coordinator_address)
    logger.info("jaxmp.parallel: process %d of %d, %d local devices, %d in all", info.process_index,
                info.process_count, info.local_device_count, info.device_count)
    return info
