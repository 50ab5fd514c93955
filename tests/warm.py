"""Test jobs started from a warm interpreter: the imports paid once per session, not per job.

A job of the suite is a fresh Python process (``python job_runner.py ...``,
``python pretrain_gpt2_edgc.py ...``, ``torchrun ... pretrain_gpt.py ...``) that spends
most of its few seconds importing torch, megatron-core and Megatron-LM: about 4 s of CPU
per process, four processes per torchrun, on a 2-core CI machine. :func:`run` starts the
same command as a child forked from a server that has those modules imported already
(one server per interpreter, ``PYTHONPATH``, ``OMP_NUM_THREADS`` and ``PYTHONWARNINGS``):
the child takes the job's environment, working directory and ``sys.argv`` and runs the
script or module as ``__main__``, its output in files the caller reads. A torchrun of the
tests' form (``--standalone`` or a static rendezvous, ``--nproc-per-node N``) is its agent
(issues 81, 91): the job's store hosted by a process of the agent's at ``MASTER_PORT``
(``TORCHELASTIC_USE_AGENT_STORE=True``, so the workers' rendezvous and the lost-rank
watcher use it, as under torchrun; a store that cannot listen fails the job with its
error), N workers forked with torchrun's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_*``, ``TORCHELASTIC_*``, an error file each in a directory of
the job's ``TMPDIR``, removed after; ``OMP_NUM_THREADS=1`` where unset and N > 1), each
in a process group of its own, polled every 0.1 s; at a failure the others SIGTERMed and
SIGKILLed after torchrun's 30 s; torchrun's report (the root cause the failure with the
earliest timestamp) and exit code 1. Each job gets a fresh RNG state (``random``, numpy)
and, as it imports the preloaded modules, what their imports did in the server's preload,
in order: the filters they set, their warnings (through the job's filters). Not
emulated: the hash seed, one per server (a job whose environment sets ``PYTHONHASHSEED``
runs cold); torchrun's own log lines; a preloaded module the job imports by
``importlib.import_module`` alone replays nothing.

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
import time

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
#: the environment a server is started with, one server per value (``PYTHONWARNINGS``: the
#: filters a job starts with)
_SERVER_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONWARNINGS")


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
    key = tuple([cmd[0]] + [env.get(k, "") for k in _SERVER_ENV])
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

    def __init__(self, python: str, *values: str):
        env = dict(os.environ)
        for name, value in zip(_SERVER_ENV, values):
            if value:
                env[name] = value
            else:
                env.pop(name, None)
        self.proc = subprocess.Popen([python, os.path.abspath(__file__)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)

    def run(self, request: dict, cmd, timeout):
        with tempfile.TemporaryDirectory(prefix="edgc-warm-") as tmp:
            request = dict(request, stdout=os.path.join(tmp, "out"),
                           stderr=os.path.join(tmp, "err"), groups=os.path.join(tmp, "groups"))
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            result: list = []
            reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()),
                                      daemon=True)
            reader.start()
            reader.join(timeout)
            timed_out = not result
            if timed_out:   # the job's process group ends, and its workers' groups
                groups = _read(request["groups"]).split() if \
                    os.path.exists(request["groups"]) else []
                for group in [pid] + [int(g) for g in groups]:
                    _signal_group(group, signal.SIGKILL)
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
    """Import :data:`PRELOAD`, recording per module what a cold job's import of it does
    again (:data:`_EVENTS`): every warning it gives (whatever the server's filters), the
    filters it sets for good (not applied here: a job applies them where it imports the
    module), the modules it imports. A filter set inside ``catch_warnings`` applies as it
    would (its scope is the module's own)."""

    def load(names):
        for name in names:
            try:
                __import__(name)   # through the tracking __import__ below
            except Exception:   # noqa: BLE001 (not on this path: the job imports it, or fails)
                pass

    import builtins
    import warnings

    original = builtins.__import__
    setters = {f: getattr(warnings, f) for f in ("filterwarnings", "simplefilter",
                                                 "resetwarnings")}
    enter, leave = warnings.catch_warnings.__enter__, warnings.catch_warnings.__exit__
    depth, recording = [0], [True]

    def tracking(name, globals=None, locals=None, fromlist=(), level=0):
        module = original(name, globals, locals, fromlist, level)
        names = _imported(name, globals, fromlist, level) if recording[0] else ()
        if names:
            _log(("import", names))
        return module

    def setter(function):
        def set_filter(*args, **kwargs):
            if recording[0] and not depth[0]:   # for good: the job sets it, in order
                _log(("filter", function, args, kwargs))
            else:
                return setters[function](*args, **kwargs)
        return set_filter

    def entered(self):   # a filter set in a catch_warnings scope: applied, not recorded
        depth[0] += 1
        return enter(self)

    def left(self, *exc):
        depth[0] -= 1
        return leave(self, *exc)

    def attribute(message, category, filename, lineno, file=None, line=None):
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename, frame.f_lineno) != \
                (filename, lineno):
            frame = frame.f_back
        _log(("warn", message, category, filename, lineno,
              frame.f_globals if frame is not None else None))

    saved = warnings.filters[:], warnings.showwarning
    warnings.filters[:] = [("always", None, Warning, None, 0)]
    warnings._filters_mutated()
    warnings.showwarning = attribute
    warnings.catch_warnings.__enter__, warnings.catch_warnings.__exit__ = entered, left
    for function in setters:
        setattr(warnings, function, setter(function))
    builtins.__import__ = tracking
    try:
        _load_all(load)
    finally:   # a module keeping a setter (``from warnings import ...``) gets the original
        recording[0] = False
        builtins.__import__ = original
        for function, setter_ in setters.items():
            setattr(warnings, function, setter_)
        warnings.catch_warnings.__enter__, warnings.catch_warnings.__exit__ = enter, leave
        warnings.filters[:], warnings.showwarning = saved
        warnings._filters_mutated()


def _log(event) -> None:
    """Record ``event`` for the module whose body runs (the innermost ``<module>`` frame),
    and each module that runs in another's body as imported by it there."""
    frame, inner, module = sys._getframe(2), 0, None
    while True:   # the module frames outwards, linked in pairs up to one linked already
        while frame is not None and (frame.f_code.co_name != "<module>" or
                                     frame.f_globals.get("__name__") in (None, "__main__")):
            frame = frame.f_back
        outer = None if frame is None else frame.f_globals["__name__"]
        if inner == 0:
            module = outer
        elif (outer, inner) in _LINKED:
            break
        else:
            _LINKED.add((outer, inner))
            _EVENTS.setdefault(outer, []).append(("import", [inner]))
        if outer is None:
            break
        inner, frame = outer, frame.f_back
    _EVENTS.setdefault(module, []).append(event)


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
    Returns its pid once it listens; raises with the store's error where it cannot (a
    port in use: torchrun's own ``DistNetworkError``)."""
    ready, told = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready)
        try:
            import datetime

            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", port, None, is_master=True,  # noqa: F841
                                  timeout=datetime.timedelta(minutes=30),
                                  wait_for_workers=False)
            os.write(told, b"ready")
        except BaseException as exc:   # noqa: BLE001
            os.write(told, f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
                     .encode())
            os._exit(1)
        os.close(told)
        while True:
            signal.pause()
    os.close(told)
    said = b""
    while True:   # to its end: "ready" from a store that listens, else why it does not
        chunk = os.read(ready, 65536)
        if not chunk:
            break
        said += chunk
    os.close(ready)
    if said != b"ready":
        os.waitpid(pid, 0)
        raise RuntimeError(said.decode(errors="replace")
                           or "the job's store ended before it listened")
    return pid


#: torchrun's agent: how often it polls its workers (``--monitor-interval``'s default),
#: and how long it waits after their SIGTERM before it SIGKILLs them (``PContext.close``);
#: a job's ``EDGC_WARM_KILL_GRACE_S`` shortens the wait, for a test of it.
MONITOR_INTERVAL_S, KILL_GRACE_S = 0.1, 30


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _torchrun(request: dict) -> int:
    """torchrun's local agent (module docstring), its error directory removed after."""
    errors = tempfile.mkdtemp(prefix="edgc-warm-errors-")   # in the job's TMPDIR
    try:
        return _agent(request, errors)
    finally:
        import shutil

        shutil.rmtree(errors, ignore_errors=True)


def _agent(request: dict, errors: str) -> int:
    """``nproc`` workers with torchrun's environment around the agent's store, each in a
    process group of its own; polled every :data:`MONITOR_INTERVAL_S`; at a failure the
    rest SIGTERMed, SIGKILLed after :data:`KILL_GRACE_S`; then torchrun's report: the root
    cause the failure with the earliest timestamp (its error file's, else when it was
    seen), exit code 1."""
    from torch.distributed.elastic.multiprocessing.errors import (ChildFailedError,
                                                                  ProcessFailure)

    n, port, env = request["nproc"], request["port"] or _free_port(), request["env"]
    try:
        store = _agent_store(port)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    files = [os.path.join(errors, f"{rank}.json") for rank in range(n)]
    running = {}
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)   # torchrun: start_new_session, signalled by group
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                              LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", ROLE_RANK=str(rank),
                              ROLE_WORLD_SIZE=str(n), GROUP_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                              TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                              TORCHELASTIC_RUN_ID="none", TORCHELASTIC_USE_AGENT_STORE="True",
                              TORCHELASTIC_ERROR_FILE=files[rank])
            if n > 1 and "OMP_NUM_THREADS" not in env:   # torchrun's rule
                os.environ["OMP_NUM_THREADS"] = "1"
                sys.modules["torch"].set_num_threads(1)
            _fresh_process()
            _exit(_run_target(request))
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        running[pid] = rank
        with open(request["groups"], "a") as fh:   # for the client's timeout
            fh.write(f"{pid}\n")
    failures: dict = {}

    def poll(pids) -> dict:
        ended = {}
        for pid in pids:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ended[pid] = os.waitstatus_to_exitcode(status)
        return ended

    def record(ended: dict) -> None:
        for pid, code in sorted(ended.items(), key=lambda kv: running[kv[0]]):
            rank = running.pop(pid)
            if code:
                failures[rank] = ProcessFailure(local_rank=rank, pid=pid, exitcode=code,
                                                error_file=files[rank])

    while running and not failures:
        time.sleep(MONITOR_INTERVAL_S)
        record(poll(running))
    if running:   # torchrun's close: SIGTERM, the grace, SIGKILL
        for pid in running:
            _signal_group(pid, signal.SIGTERM)
        grace = float(env.get("EDGC_WARM_KILL_GRACE_S", KILL_GRACE_S))
        end, ended = time.monotonic() + grace, {}
        while len(ended) < len(running) and time.monotonic() < end:
            time.sleep(0.01)
            ended.update(poll(set(running) - set(ended)))
        for pid in set(running) - set(ended):
            _signal_group(pid, signal.SIGKILL)
            ended[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        record(ended)
    os.kill(store, signal.SIGKILL)
    os.waitpid(store, 0)
    if not failures:
        return 0
    report = ChildFailedError(name=request["argv"][0], failures=failures)
    print(f"{type(report).__module__}.{type(report).__qualname__}: {report}",
          file=sys.stderr)
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
    tempfile.tempdir = None   # from the job's TMPDIR
    if request["nproc"]:   # the agent, as torchrun's: its workers start fresh
        _exit(_torchrun(request))
    _fresh_process()
    _exit(_run_target(request))


#: module name (None: the preload) -> what its import did in the server's preload, in
#: order (:func:`_preload`): ``("import", names)``, ``("filter", setter, args, kwargs)``,
#: ``("warn", message, category, filename, lineno, the warning's module globals)``
_EVENTS: dict = {}
_LINKED: set = set()


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
    server's) and, as its code imports the preloaded modules (a package's parents first),
    what their imports did in the preload, once each, in order: the filters they set,
    their warnings through the job's filters (``warn_explicit``, with the module's
    registry), as a cold import gives them."""
    import builtins
    import random
    import warnings

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    seen: set = set()

    def emit(names):
        for name in names:
            parts = name.split(".")
            for module in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
                if module in seen:
                    continue
                seen.add(module)
                for event in _EVENTS.get(module, ()):
                    if event[0] == "import":
                        emit(event[1])
                    elif event[0] == "filter":
                        getattr(warnings, event[1])(*event[2], **event[3])
                    else:
                        message, category, filename, lineno, globals_ = event[1:]
                        globals_ = {} if globals_ is None else globals_
                        warnings.warn_explicit(
                            message, category, filename, lineno,
                            module=globals_.get("__name__"),
                            registry=globals_.setdefault("__warningregistry__", {}),
                            module_globals=globals_ or None)

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
