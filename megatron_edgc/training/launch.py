"""Process launch: torchrun, srun, or a plain start that spawns the local processes itself.

* torchrun (or any launcher that sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and
  ``MASTER_ADDR``/``MASTER_PORT``): this process is one rank.
* srun (``SLURM_PROCID``/``SLURM_NTASKS`` inside a job step): this process is one rank;
  ``MASTER_ADDR`` defaults to the first node of the job, ``MASTER_PORT`` to 29500.
* started plainly: fork TP x PP x DP local workers (gloo on CPU) after the heavy imports,
  so they start in milliseconds; if one fails, the others are stopped.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    launcher: str


def _slurm_first_host() -> Optional[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30)
        hosts = out.stdout.split()
        if hosts:
            return hosts[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return nodelist.split(",")[0]


def detect_launch_env(environ=None) -> Optional[LaunchEnv]:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]),
                         int(env.get("LOCAL_RANK", 0)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
        if environ is None:  # fill the rendezvous for torch.distributed's env:// init
            os.environ.setdefault("MASTER_ADDR", _slurm_first_host() or "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)), "srun")
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(target: Callable[[int, int, int], int], rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os._exit(target(rank, world_size, rank))


def spawn_local(target: Callable[[int, int, int], int], world_size: int,
                port: Optional[int] = None) -> int:
    """Run ``target(rank, world_size, local_rank)`` in ``world_size`` forked processes.

    Returns 0 if all succeeded, else the first non-zero exit code; a failed or
    interrupted job stops every other worker (they would wait in collectives forever).
    """
    port = port or free_port()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_child, args=(target, r, world_size, port), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    code = 0
    try:
        pending = {p.sentinel: p for p in procs}
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                p = pending.pop(sentinel)
                p.join()
                if p.exitcode != 0 and code == 0:
                    code = p.exitcode if p.exitcode and p.exitcode > 0 else 1
                    _stop(pending.values())
    except KeyboardInterrupt:
        _stop(procs)
        code = 130
    finally:
        for p in procs:
            p.join(timeout=10)
    return code


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
