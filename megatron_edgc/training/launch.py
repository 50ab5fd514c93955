"""Process launch: torchrun, srun, or a plain start that spawns the local processes itself.

* torchrun (or any launcher that sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and
  ``MASTER_ADDR``/``MASTER_PORT``): this process is one rank.
* srun (``SLURM_PROCID``/``SLURM_NTASKS`` inside a job step): this process is one rank;
  ``MASTER_ADDR`` defaults to the first node of the job, ``MASTER_PORT`` to 29500.
* started plainly: fork TP x PP x DP local workers (gloo on CPU) after the heavy imports,
  so they start in milliseconds; if one fails, the others are stopped.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
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


#: Where a locally spawned worker records its error (set for the workers by spawn_local).
ERROR_DIR_ENV = "EDGC_ERROR_DIR"

#: After the first worker fails, how long the others may take to end by themselves.
STOP_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_name(rank: int) -> str:
    """The name a locally spawned worker carries (``ps -o comm``, ``top``, ``/proc/PID/comm``):
    a forked worker's command line and ``/proc`` environment are its parent's, so nothing
    else tells the ranks apart from outside (Linux keeps 15 characters: ranks to 99999)."""
    return f"edgc rank {rank}"


def _name_this_process(name: str) -> None:
    """``prctl(PR_SET_NAME)`` on Linux (threads started afterwards inherit it); elsewhere a
    no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _child(target: Callable[[int, int, int], int], rank: int, world_size: int, port: int,
           error_dir: str) -> None:
    _name_this_process(worker_name(rank))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ[ERROR_DIR_ENV] = error_dir
    code = 1
    try:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        code = target(rank, world_size, rank)
    except BaseException as exc:  # noqa: BLE001 (recorded for the parent, which reports it)
        record_failure(rank, exc)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def record_failure(rank: int, exc: BaseException, reported: bool = False) -> None:
    """This rank's error, with the time it was seen, for the plain launcher's report
    (a no-op under torchrun/srun). ``reported``: the rank printed it itself (a handled
    error such as a bad checkpoint), so the launcher adds nothing when it came first."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if not error_dir or not os.path.isdir(error_dir):
        return
    with open(os.path.join(error_dir, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "time_ns": time.time_ns(), "reported": reported,
                   "error": f"{type(exc).__name__}: {exc}",
                   "traceback": "".join(traceback.format_exception(exc))}, fh)


def first_failure(error_dir: str) -> Optional[dict]:
    """The root cause: the earliest recorded error (its peers' errors — closed connections,
    aborted collectives — come after it)."""
    records = []
    for name in os.listdir(error_dir):
        with open(os.path.join(error_dir, name)) as fh:
            records.append(json.load(fh))
    return min(records, key=lambda r: r["time_ns"]) if records else None


def start_method() -> str:
    """``fork`` on CPU machines: the workers start in milliseconds with the parent's
    imports. ``spawn`` where CUDA is present: a forked child cannot use CUDA once the parent
    has initialized it, and importing megatron-core does (measured on an H100, torch 2.11:
    "Cannot re-initialize CUDA in forked subprocess" in ``torch.cuda.set_device``). The
    target must then be picklable (a module-level function or a ``functools.partial``)."""
    import torch

    return "spawn" if torch.cuda.is_available() else "fork"


def spawn_local(target: Callable[[int, int, int], int], world_size: int,
                port: Optional[int] = None) -> int:
    """Run ``target(rank, world_size, local_rank)`` in ``world_size`` local processes
    (forked, or spawned where CUDA is present: :func:`start_method`).

    Returns 0 if all succeeded, else the first non-zero exit code; a failed or
    interrupted job stops every other worker (they would wait in collectives forever).
    An exception in a worker is not printed there: the earliest one of the job (the root
    cause) is printed here, once, with its rank and traceback.
    """
    port = port or free_port()
    ctx = multiprocessing.get_context(start_method())
    with tempfile.TemporaryDirectory(prefix="edgc-errors-") as error_dir:
        procs = [ctx.Process(target=_child, args=(target, r, world_size, port, error_dir),
                             daemon=False) for r in range(world_size)]
        for p in procs:
            p.start()
        code, deadline, first_exit = 0, None, (None, 0)
        try:
            pending = {p.sentinel: p for p in procs}
            while pending:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = multiprocessing.connection.wait(list(pending), timeout)
                if not ready:  # the grace is over: the rest wait in collectives forever
                    _stop(pending.values())
                    break
                ended = [pending.pop(sentinel) for sentinel in ready]
                for p in ended:
                    p.join()
                # Ended together: a rank killed by a signal (no error of its own) before
                # the peers whose collectives it broke (their sentinels close right after
                # its own, and a busy parent may wake once for all of them).
                for p in sorted(ended, key=lambda p: p.exitcode >= 0):
                    if p.exitcode != 0 and code == 0:
                        code = p.exitcode if p.exitcode and p.exitcode > 0 else 1
                        first_exit = (procs.index(p), p.exitcode)
                        # A handled error (a failed save) ends every rank by itself, the
                        # failing one saying why: let them finish that before stopping.
                        deadline = time.monotonic() + STOP_GRACE_S
        except KeyboardInterrupt:
            _stop(procs)
            code = 130
        finally:
            for p in procs:
                p.join(timeout=10)
        failure = first_failure(error_dir) if code not in (0, 130) else None
    if code not in (0, 130) and first_exit[1] < 0 and (
            failure is None or failure["rank"] != first_exit[0]):
        print(f"error: rank {first_exit[0]} of {world_size} was killed by "
              f"{signal.Signals(-first_exit[1]).name} first (the other ranks were stopped)",
              file=sys.stderr, flush=True)
    elif failure is not None and not failure["reported"]:
        print(f"error: rank {failure['rank']} of {world_size} failed first: "
              f"{failure['error']}\n{failure['traceback'].rstrip()}\n"
              f"(the other ranks were stopped; their errors followed from this one)",
              file=sys.stderr, flush=True)
    return code


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
