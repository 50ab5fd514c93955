"""Test jobs started from a warm interpreter: the imports paid once per session, not per job.

A job of the suite is a fresh Python process (``python job_runner.py ...``,
``python pretrain_gpt2_edgc.py ...``, ``torchrun ... pretrain_gpt.py ...``) that spends
most of its few seconds importing torch, megatron-core and Megatron-LM: about 4 s of CPU
per process, four processes per torchrun, on a 2-core CI machine. :func:`run` starts the
same command as a child forked from a server that has those modules imported already
(one server per interpreter, ``PYTHONPATH`` and ``OMP_NUM_THREADS``): the child takes the
job's environment, working directory and ``sys.argv`` and runs the script or module as
``__main__``, its output in files the caller reads. A torchrun of the tests' form
(``--standalone`` or a static rendezvous, ``--nproc-per-node N``) is its agent (issue 81):
the job's store hosted by a process of the agent's at ``MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``, so the workers' rendezvous and the lost-rank
watcher use it, as under torchrun), N workers forked with torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*``, ``TORCHELASTIC_*``, an error file
each, ``OMP_NUM_THREADS=1`` where unset), a failed worker stopping its peers, the root
cause's error file reported and exit code 1, as torchrun's agent does. Each job gets a
fresh RNG state (``random``, numpy) and the warnings its imports gave in the server on its
own stderr. Not emulated: the hash seed, one per server (a job whose environment sets
``PYTHONHASHSEED`` runs cold).

Forking is safe as the workers of :func:`megatron_edgc.training.launch.spawn_local` are:
the server runs no torch operation (OpenMP thread pools do not survive a fork). Anything
else (another command, ``EDGC_TEST_COLD=1``) runs as :func:`subprocess.run` would.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))

#: What the server imports (each where it imports: a module missing for one interpreter or
#: path is skipped): the trainer's and Megatron-LM's heavy imports, no torch operation.
PRELOAD = ["torch", "numpy", "yaml", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
           "megatron.core.pipeline_parallel", "megatron.core.datasets.gpt_dataset",
           "megatron.core.dist_checkpointing", "megatron_edgc.config",
           "megatron_edgc.training.loop", "megatron_edgc.training.launch",
           "megatron_edgc.patches.ddp", "megatron_edgc.megatron_lm",
           "megatron_edgc.megatron_lm.cpu", "tensorboard.compat.proto.event_pb2"]
#: Megatron-LM's (after the CPU runner's import stubs): only where it is on the path.
PRELOAD_MEGATRON_LM = ["megatron.training", "megatron.training.arguments",
                       "megatron.training.training", "megatron.training.initialize",
                       "megatron.training.checkpointing", "megatron.core.models.gpt.gpt_layer_specs"]
#: torchrun flags of the tests' commands that take a value / take none.
_TORCHRUN_VALUE = {"--nproc-per-node", "--nnodes", "--master-addr", "--master-port"}
_TORCHRUN_FLAG = {"--standalone"}


# ------------------------------------------------------------------ client

_servers: dict = {}
_lock = threading.Lock()


def run(cmd, *, env=None, cwd=None, timeout=None, capture_output=True, text=True,
        check=False):
    """:func:`subprocess.run` of ``cmd`` (output captured, as text), from a warm server
    where ``cmd`` is ``[python, script.py | -m module | -m torch.distributed.run ..., ...]``
    (module docstring)."""
    env = dict(os.environ if env is None else env)
    request = _request(cmd, env, cwd)
    if request is None or not capture_output or not text or "PYTHONHASHSEED" in env or \
            os.environ.get("EDGC_TEST_COLD") == "1":
        return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, check=check,
                              capture_output=capture_output, text=text)
    key = (cmd[0], env.get("PYTHONPATH", ""), env.get("OMP_NUM_THREADS", ""))
    with _lock:
        server = _servers.get(key)
        if server is None or server.proc.poll() is not None:
            server = _servers[key] = _Server(*key)
        proc = server.run(request, cmd, timeout)
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
    return proc


def _request(cmd, env: dict, cwd) -> dict | None:
    """The server's request for ``cmd``, or None where it is not a Python job."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 2 or os.path.basename(cmd[0]).split(".")[0] not in ("python", "python3") \
            or cmd[0] != sys.executable and not os.path.isabs(cmd[0]):
        return None
    args, nproc, port = cmd[1:], 0, None
    if args[:2] == ["-m", "torch.distributed.run"]:
        args = args[2:]
        while args and args[0].startswith("--"):
            flag = args[0].replace("_", "-")
            if flag in _TORCHRUN_FLAG:
                args = args[1:]
            elif flag in _TORCHRUN_VALUE:
                if flag == "--nproc-per-node":
                    nproc = int(args[1])
                elif flag == "--master-port":
                    port = int(args[1])
                args = args[2:]
            else:
                return None    # a torchrun flag this emulation does not know
        if nproc < 1:
            return None
    if args[:1] == ["-m"] and len(args) >= 2:
        target = {"module": args[1], "argv": [args[1]] + args[2:]}
    elif args and args[0].endswith(".py") and not args[0].startswith("-"):
        target = {"script": os.path.abspath(os.path.join(cwd or ".", args[0])),
                  "argv": args}
    else:
        return None
    return {**target, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
            "nproc": nproc, "port": port}


class _Server:
    """One warm interpreter: ``python warm.py`` reading requests on stdin, one at a time."""

    def __init__(self, python: str, pythonpath: str, omp: str):
        env = dict(os.environ, PYTHONPATH=pythonpath)
        if omp:
            env["OMP_NUM_THREADS"] = omp
        else:
            env.pop("OMP_NUM_THREADS", None)
        self.proc = subprocess.Popen([python, os.path.abspath(__file__)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)

    def run(self, request: dict, cmd, timeout):
        with tempfile.TemporaryDirectory(prefix="edgc-warm-") as tmp:
            request = dict(request, stdout=os.path.join(tmp, "out"),
                           stderr=os.path.join(tmp, "err"))
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            result: list = []
            reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()),
                                      daemon=True)
            reader.start()
            reader.join(timeout)
            timed_out = not result
            if timed_out:   # the job's process group (the job and its workers) ends
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                reader.join()
            if not result[0]:
                raise RuntimeError("the warm test server died")
            reply = json.loads(result[0])
            out, err = (_read(request[k]) for k in ("stdout", "stderr"))
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout, out, err)
        return subprocess.CompletedProcess(cmd, reply["rc"], out, err)


def _read(path: str) -> str:
    with open(path, errors="replace") as fh:
        return fh.read()


# ------------------------------------------------------------------ server

def _preload() -> None:

    def load(names):
        for name in names:
            try:
                __import__(name)   # through the tracking __import__ below
            except Exception:   # noqa: BLE001 (not on this path: the job imports it, or fails)
                pass

    import builtins
    import warnings

    stack, original = [], builtins.__import__

    def tracking(name, globals=None, locals=None, fromlist=(), level=0):
        parent = stack[-1] if stack else None
        stack.append(_absolute(name, globals, level))
        try:
            module = original(name, globals, locals, fromlist, level)
        finally:
            stack.pop()
        if parent is not None:
            _DEPENDS.setdefault(parent, set()).update(_imported(name, globals, fromlist, level))
        return module

    def attribute(message, category, filename, lineno, file=None, line=None):
        _WARNED.setdefault(stack[-1] if stack else None, []).append(
            (message, category, filename, lineno))

    with warnings.catch_warnings():
        warnings.showwarning = attribute
        builtins.__import__ = tracking
        try:
            _load_all(load)
        finally:
            builtins.__import__ = original


def _load_all(load) -> None:
    load(PRELOAD)
    try:
        from megatron_edgc.megatron_lm.cpu import install_import_stubs
        import importlib.util

        if importlib.util.find_spec("megatron.training") is not None:
            install_import_stubs()
            load(PRELOAD_MEGATRON_LM)
    except Exception:   # noqa: BLE001
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_target(request: dict) -> int:
    """Run the request's script or module as ``__main__``; its exit code."""
    sys.argv = list(request["argv"])
    if "module" in request:   # runpy imports its package with importlib, not __import__
        __import__(request["module"].rpartition(".")[0] or request["module"])
    try:
        if "module" in request:
            sys.path[0] = request["cwd"]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(request["script"])
            runpy.run_path(request["script"], run_name="__main__")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException:   # noqa: BLE001 (as the interpreter would: traceback, exit 1)
        import traceback

        traceback.print_exc()
        return 1


def _agent_store(port: int) -> int:
    """The job's store, as torchrun's agent hosts it (a TCPStore at ``port`` for the
    workers' rendezvous and the lost-rank watcher), in a process of its own: the agent
    forks its workers after, and a process that forks must have no thread of a store's.
    Returns its pid once it listens."""
    ready, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready)
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, None, is_master=True,  # noqa: F841
                              timeout=datetime.timedelta(minutes=30), wait_for_workers=False)
        os.write(told, b"1")
        os.close(told)
        while True:
            signal.pause()
    os.close(told)
    os.read(ready, 1)
    os.close(ready)
    return pid


def _torchrun(request: dict) -> int:
    """torchrun's local agent (module docstring): ``nproc`` workers with its environment
    around the agent's store; a failed worker stops the others; exit code 1 on a failure,
    its root cause (the first failure) reported from the worker's error file."""
    n, port = request["nproc"], request["port"] or _free_port()
    store = _agent_store(port)
    errors = tempfile.mkdtemp(prefix="edgc-warm-errors-")
    pids = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                              LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", ROLE_RANK=str(rank),
                              ROLE_WORLD_SIZE=str(n), GROUP_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                              TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                              TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="True",
                              TORCHELASTIC_ERROR_FILE=os.path.join(errors, f"{rank}.json"))
            if "OMP_NUM_THREADS" not in request["env"]:   # torchrun's default, N > 1
                os.environ["OMP_NUM_THREADS"] = "1"
                import torch

                torch.set_num_threads(1)
            _exit(_run_target(request))
        pids[pid] = rank
    failures = []
    while pids:
        pid, status = os.wait()
        if pid not in pids:
            continue
        rank = pids.pop(pid)
        rc = os.waitstatus_to_exitcode(status)
        if rc:
            failures.append((rank, rc))
            for other in pids:   # as torchrun's agent: the rest of the group is stopped
                try:
                    os.kill(other, signal.SIGTERM)
                except ProcessLookupError:
                    pass
    os.kill(store, signal.SIGKILL)
    os.waitpid(store, 0)
    if not failures:
        return 0
    rank, rc = failures[0]
    error = os.path.join(errors, f"{rank}.json")
    message = _read(error) if os.path.exists(error) else "<N/A>"
    print(f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
          f"Root Cause (first observed failure):\n  rank: {rank} (local_rank: {rank})\n"
          f"  exitcode: {rc}\n  error_file: {error if message != '<N/A>' else '<N/A>'}\n"
          f"  traceback: {message}", file=sys.stderr)
    return 1


def _job(request: dict) -> None:
    """The forked job: its own process group, environment, directory and output files."""
    os.setsid()
    fd_in = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd_in, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    _fresh_process()
    _exit(_torchrun(request) if request["nproc"] else _run_target(request))


#: module -> the modules its import imported, and the warnings given while it was the
#: innermost import, in the server's preload (a cold job's imports give them again)
_DEPENDS: dict = {}
_WARNED: dict = {}


def _absolute(name, globals_, level) -> str:
    """An ``__import__`` call's module name, its relative form resolved."""
    if not level:
        return name
    package = (globals_ or {}).get("__package__") or ""
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{name}" if name else base


def _imported(name, globals_, fromlist, level) -> list:
    """The modules an ``__import__`` call names (its ``fromlist``'s submodules too), those
    that exist."""
    name = _absolute(name, globals_, level)
    names = [name] + [f"{name}.{f}" for f in fromlist or () if f != "*"]
    return [n for n in names if n in sys.modules]


def _fresh_process() -> None:
    """What a process of its own would start with: its RNG states from the OS (not the
    server's), and on its stderr the warnings the imports it runs would have given, once
    each, as its code imports the preloaded modules that gave them (directly or through
    the modules they import)."""
    import builtins
    import random
    import warnings

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    seen: set = set()

    def emit(names):
        todo = list(names)
        while todo:
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            for w in _WARNED.get(module, ()):
                warnings.showwarning(*w)
            todo.extend(sorted(_DEPENDS.get(module, ()), reverse=True))

    original = builtins.__import__

    def replaying(name, globals=None, locals=None, fromlist=(), level=0):
        module = original(name, globals, locals, fromlist, level)
        emit(_imported(name, globals, fromlist, level))
        return module

    builtins.__import__ = replaying


def _exit(code: int) -> None:
    """End a forked process as the interpreter ends: non-daemon threads joined, ``atexit``
    handlers run, output flushed."""
    try:
        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:   # noqa: BLE001
                pass
        os._exit(code)


def serve() -> None:
    # the replies on a descriptor of their own; anything else printed goes to stderr
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    _preload()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                replies.close()
                _job(request)
            finally:
                os._exit(1)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
