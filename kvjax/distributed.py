"""Multi-process jobs on JAX's own distributed runtime (``jax.distributed``), and the CLI's mesh flags.

Every process of a job runs the same command; :func:`initialize` connects them through a
coordinator (process 0's address), after which ``jax.devices()`` lists every process's devices and a
mesh (:mod:`kvjax.sharding`) can span them. Settings come from flags, else the environment:

=====================  =========================  ==============================================
flag                   environment                meaning
=====================  =========================  ==============================================
``--coordinator``      ``KVJAX_COORDINATOR``      ``host:port`` of process 0
``--num-processes``    ``KVJAX_NUM_PROCESSES``    processes in the job
``--process-id``       ``KVJAX_PROCESS_ID``       this process's index, 0 .. num_processes - 1
=====================  =========================  ==============================================

With none of them set nothing is initialised (one process). On a TPU pod slice or under SLURM /
Open MPI, ``--distributed auto`` lets ``jax.distributed.initialize()`` find them itself. CPU
processes exchange data with the gloo collectives (set here before initialising).
"""

from __future__ import annotations

import argparse
import os

import jax

ENV = {"coordinator": "KVJAX_COORDINATOR", "num_processes": "KVJAX_NUM_PROCESSES", "process_id": "KVJAX_PROCESS_ID"}


def settings(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> dict | None:
    """The job's (coordinator, num_processes, process_id) from the arguments, else the environment;
    None when none is set. Raises ValueError when only some are set or they disagree."""
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for key, var in ENV.items():
        if given[key] is None and os.environ.get(var):
            given[key] = os.environ[var]
    if all(v is None for v in given.values()):
        return None
    missing = [f"--{k.replace('_', '-')} ({ENV[k]})" for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"a multi-process job needs the coordinator, the process count and this process's id; "
                         f"missing: {', '.join(missing)}")
    try:
        count, index = int(given["num_processes"]), int(given["process_id"])
    except ValueError:
        raise ValueError(f"num_processes and process_id must be integers, got {given['num_processes']!r}, "
                         f"{given['process_id']!r}") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"need num_processes >= 1 and 0 <= process_id < num_processes, got {count}, {index}")
    if ":" not in str(given["coordinator"]):
        raise ValueError(f"the coordinator is host:port of process 0, got {given['coordinator']!r}")
    return {"coordinator_address": str(given["coordinator"]), "num_processes": count, "process_id": index}


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, *,
               auto: bool = False) -> bool:
    """Join a multi-process job (see module docstring); returns whether ``jax.distributed`` was initialised.

    Call before any other jax use. ``auto``: let jax detect the cluster (TPU pods, SLURM, Open MPI).
    """
    job = settings(coordinator, num_processes, process_id)
    if job is None and not auto:
        return False
    # CPU devices of different processes talk through gloo (no effect on GPU / TPU backends); asking
    # which backend runs would start it, and jax.distributed must be initialised before that
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**(job or {}))
    return True


def add_mesh_args(p: argparse.ArgumentParser) -> None:
    """``--mesh`` and the multi-process flags (see module docstring)."""
    g = p.add_argument_group("devices", "split the model and caches over a device mesh (kvjax.sharding), "
                             "optionally across processes (kvjax.distributed)")
    g.add_argument("--mesh", default=None,
                   help="device mesh, e.g. data=2,model=4 (rows on data, attention heads on model; default: one device)")
    g.add_argument("--coordinator", default=None, help="host:port of process 0 of a multi-process job")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the job")
    g.add_argument("--process-id", type=int, default=None, help="this process's index")
    g.add_argument("--distributed", choices=["off", "auto"], default="off",
                   help="auto: let jax.distributed find the cluster (TPU pods, SLURM, Open MPI)")


def setup_devices(args) -> str | None:
    """Initialise the job from :func:`add_mesh_args`'s flags; returns the ``--mesh`` value (None: one device).

    A malformed ``--mesh`` is refused before anything starts (ValueError).
    """
    from kvjax.sharding import parse_mesh

    if args.mesh is not None:
        parse_mesh(args.mesh)
    initialize(args.coordinator, args.num_processes, args.process_id, auto=args.distributed == "auto")
    return args.mesh
