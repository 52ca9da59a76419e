"""Joining a ``jax.distributed`` job: the launcher's environment, SLURM, Open MPI."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import jax

from multimesh import _compat
from multimesh.runtime import crossproc
from multimesh.runtime.crossproc import LayoutError as LayoutError

_compat.register_exclusion(__file__)

log = logging.getLogger("multimesh")

# set by ``python -m multimesh.launch`` for each process it starts
ENV_COORDINATOR = "MULTIMESH_COORDINATOR"
ENV_NUM_PROCESSES = "MULTIMESH_NUM_PROCESSES"
ENV_PROCESS_ID = "MULTIMESH_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "MULTIMESH_DEVICES_PER_PROCESS"
ENV_LOCAL_PROCESSES = "MULTIMESH_LOCAL_PROCESSES"
ENV_HEARTBEAT = "MULTIMESH_HEARTBEAT_TIMEOUT"

_STATE: dict[str, Any] = {"initialized": False}


def _cluster_size() -> int:
    """How many processes the environment says this job has (1 if none)."""
    for key in (ENV_NUM_PROCESSES, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_NTASKS", "").isdigit():
        return int(os.environ["SLURM_NTASKS"])
    return 1


def local_process_count() -> int:
    """How many processes of this job run on this host, as the launcher, Open MPI, MPICH
    or SLURM tells it (1 if none does)."""
    for key in (ENV_LOCAL_PROCESSES, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(key, "").isdigit():
            return max(1, int(os.environ[key]))
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    if os.environ.get("SLURM_JOB_ID") and per_node.isdigit():
        return max(1, int(per_node))
    return 1


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    heartbeat_timeout_seconds: int | None = None,
) -> bool:
    """Join the ``jax.distributed`` job this process belongs to; returns whether it is
    a multi-process run.

    With no arguments: under ``python -m multimesh.launch`` it joins the launcher's job;
    under SLURM or Open MPI ``jax.distributed.initialize`` detects the job; in a plain
    single process it does nothing, so one script runs both ways. Explicit arguments are
    passed to ``jax.distributed.initialize``. On CPU it sets the number of virtual
    devices per process the launcher asks for, and JAX's gloo collectives.
    ``heartbeat_timeout_seconds`` bounds how long peers wait for a process that died
    (JAX's default: 100 s). Call it before anything touches JAX devices. In a
    multi-process run, a process dying of an uncaught exception exits at once after
    printing it (instead of waiting minutes at exit for peers that wait for it).
    """
    if _STATE["initialized"]:
        return jax.process_count() > 1
    env = os.environ
    if coordinator_address is None and env.get(ENV_COORDINATOR):
        coordinator_address = env[ENV_COORDINATOR]
        num_processes = num_processes if num_processes is not None else int(env[ENV_NUM_PROCESSES])
        process_id = process_id if process_id is not None else int(env[ENV_PROCESS_ID])
    if heartbeat_timeout_seconds is None and env.get(ENV_HEARTBEAT, "").isdigit():
        heartbeat_timeout_seconds = int(env[ENV_HEARTBEAT])
    explicit = coordinator_address is not None or num_processes not in (None, 1)
    if not explicit and _cluster_size() <= 1:
        _STATE["initialized"] = True
        return False  # a plain single process: nothing to join
    per = env.get(ENV_DEVICES_PER_PROCESS, "")
    if per.isdigit():  # virtual CPU devices per process (affects the CPU backend only)
        jax.config.update("jax_num_cpu_devices", int(per))
    if hasattr(jax.config, "jax_cpu_collectives_implementation"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = {}
    if local_device_ids is not None:
        kwargs["local_device_ids"] = local_device_ids
    if heartbeat_timeout_seconds is not None:
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_seconds)
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    _STATE["initialized"] = True
    from multimesh.distributed import _host

    _host.fail_fast()
    if jax.process_index() == 0:
        log.info("multimesh: %s", process_map())
    return jax.process_count() > 1


def is_multiprocess() -> bool:
    """Whether this run has several JAX processes."""
    return jax.process_count() > 1


def process_map(mmesh: Any = None) -> str:
    """Which process holds which devices (and, given a MultiMesh, which submeshes)."""
    rows = []
    by_proc: dict[int, list[int]] = {}
    for d in jax.devices():
        by_proc.setdefault(d.process_index, []).append(int(d.id))
    for p, ids in sorted(by_proc.items()):
        row = f"process {p}: devices {ids}"
        if mmesh is not None:
            stages = [
                s
                for s in range(mmesh.num_stages)
                if any(int(d.id) in ids for d in mmesh.submesh(s).devices.flat)
            ]
            row += f", stages {stages}"
        rows.append(row)
    return "; ".join(rows)


def check_layout(mmesh: Any, stages: Sequence[int] | None = None) -> None:
    """Raise ``mm.distributed.LayoutError`` (a ``ValueError``) now if the processes'
    devices split ``mmesh``'s submeshes (all, or ``stages``) in a way multi-process runs
    do not support; ``mm.jit`` checks the submeshes a program uses at its first call.
    Supported: a process holds whole submeshes, or a submesh is split evenly over
    processes that hold no other submesh's devices. Nothing to check in one process."""
    import types

    from multimesh.mesh import MultiMesh

    if not isinstance(mmesh, MultiMesh):
        raise TypeError(f"check_layout takes a MultiMesh, got {type(mmesh).__name__}.")
    which = range(mmesh.num_stages) if stages is None else list(stages)
    bad = [s for s in which if not 0 <= s < mmesh.num_stages]
    if bad:
        raise ValueError(f"check_layout: stage {bad[0]} is out of range (0..{mmesh.num_stages - 1}).")
    loc = crossproc.locality()
    if loc is None:
        return
    targets = [types.SimpleNamespace(name=f"stage{s}", mesh=mmesh.submesh(s)) for s in which]
    crossproc.check_layout(loc, targets)
