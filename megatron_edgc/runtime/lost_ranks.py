"""Which rank a job lost under torchrun: one line naming a rank that died without an error
of its own (SIGKILL, the OOM killer, a crash, its host gone) while the other ranks'
collectives failed because of it (docs/reliability.md, "A rank lost under torchrun": why
torchrun's own root cause cannot say, with the measurement). The plain launcher and srun
name a killed rank themselves. Through the store torchrun's agent hosts for the job
(``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_ADDR``/``MASTER_PORT``: the public
contract of ``torch.distributed.rendezvous``), which outlives every worker:

* :func:`watch`, once a rank's process groups exist: two clients of the agent's store and
  a thread blocked on one key (the GIL released: nothing runs per step); the rank marks
  itself when it exits by itself, and when the launcher stops it (a SIGTERM handler,
  where SIGTERM had its default action).
* :func:`report`, in a rank's failure path: the rank marks itself, and the first rank of
  the job to fail announces it, which wakes every live rank's thread to mark its rank, also
  while its main thread is blocked in a collective; the announcer waits up to
  :data:`ANSWER_WINDOW_S` for every mark and names the ranks still unmarked on stderr
  (nothing where every rank answers, in milliseconds).
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

#: How long the announcing rank waits for every live rank's mark, in seconds. They answer
#: within milliseconds (a thread woken by the store); the window covers a loaded host.
ANSWER_WINDOW_S = 2.0
#: Between two looks at the count of marks, in seconds (the announcing rank only).
POLL_S = 0.02
#: The clients' connection and answer timeout (the agent's store is up when they connect).
STORE_TIMEOUT = datetime.timedelta(seconds=10)
#: The watching thread's wait for an announcement: as long as a job runs (it waits again).
WATCH_TIMEOUT = datetime.timedelta(days=7)


@dataclass
class _Watch:
    """One rank's part: its store client (the main thread's), the keys of this run and
    restart attempt, its rank and the job's size."""

    store: object
    prefix: str
    rank: int
    world_size: int

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def rank_key(self, rank: int) -> str:
        return self.key(f"rank/{rank}")

    def mark(self, store=None) -> None:
        """This rank is alive, or ended by itself (idempotent across its threads: the
        store's ``add`` is atomic)."""
        store = store or self.store
        if store.add(self.rank_key(self.rank), 1) == 1:
            store.add(self.key("marked"), 1)


_watch: Optional[_Watch] = None
#: True while this rank reports (a SIGTERM then is held in ``_held``, then delivered).
_reporting = False
_held: list = []


def agent_store_address(environ=None) -> Optional[tuple]:
    """``(host, port)`` of the store torchrun's agent hosts for this job, or None where the
    launcher is not torchrun with its agent's store (the plain launcher, srun, env://
    with a store on rank 0, which dies with it)."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return None


def _client(address: tuple, timeout: datetime.timedelta):
    import torch.distributed as dist

    return dist.TCPStore(address[0], address[1], None, is_master=False, timeout=timeout,
                         wait_for_workers=False)


def watch(uncaught: bool = False) -> bool:
    """Take part (once per process, after the process groups exist; idempotent). Returns
    False, starting nothing, where there is no agent's store (:func:`agent_store_address`)
    or it cannot be reached. ``uncaught``: also :func:`report` an exception that nobody
    catches (``sys.excepthook``, chained before the one in place), for a front-end that
    does not own its training loop (the Megatron-LM plug-in: its collectives also fail in
    Megatron-LM's logging and checkpointing)."""
    global _watch
    if _watch is not None:
        return True
    address = agent_store_address()
    if address is None:
        return False
    env = os.environ
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        store, waiter = _client(address, STORE_TIMEOUT), _client(address, WATCH_TIMEOUT)
    except Exception:   # noqa: BLE001 (no store to reach: nothing to name ranks with)
        return False
    # Scoped to this run and restart attempt: torchrun's c10d rendezvous keeps one agent
    # store across --max-restarts attempts.
    prefix = (f"edgc/lost_ranks/{env.get('TORCHELASTIC_RUN_ID', '')}/"
              f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    part = _Watch(store, prefix, rank, world_size)
    threading.Thread(target=_answer_when_announced, args=(part, waiter),
                     name="edgc-lost-ranks", daemon=True).start()
    atexit.register(_mark_quietly, part)
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)   # a handler in place is left alone
    if uncaught:
        previous = sys.excepthook

        def excepthook(exc_type, exc, tb):
            report(exc)
            previous(exc_type, exc, tb)
        sys.excepthook = excepthook
    _watch = part
    return True


def _answer_when_announced(part: _Watch, waiter) -> None:
    """The watching thread: blocks until a rank announces a failure, then marks this rank
    (its main thread may be blocked in a collective, the GIL released)."""
    while True:
        started = time.monotonic()
        try:
            waiter.wait([part.key("announced")])
            part.mark(waiter)
            return
        except Exception:   # noqa: BLE001 (the store timed out, or is gone with the job)
            if time.monotonic() - started < WATCH_TIMEOUT.total_seconds() / 2:
                return   # gone, not timed out: nothing to answer any more


def _mark_quietly(part: _Watch) -> None:
    try:
        part.mark()
    except Exception:   # noqa: BLE001 (at exit, the store may be gone)
        pass


def report(exc: Optional[BaseException] = None) -> None:
    """A rank's failure path, for any exception (re-raise it afterwards): marks this rank;
    the first rank of the job to call it names the ranks that were lost, in one line on
    stderr (see the module's docstring). Never raises; a no-op without :func:`watch`."""
    global _reporting
    part = _watch
    if part is None or _reporting:
        return
    _reporting = True
    try:
        part.mark()
        if part.store.add(part.key("announced"), 1) == 1:   # else another rank reports
            lost = _wait_for_marks(part)
            if lost:
                print(lost_line(lost, part.world_size), file=sys.stderr, flush=True)
    except Exception:   # noqa: BLE001 (the store is gone: nothing to add to the error)
        pass
    finally:
        _reporting = False
    if _held:           # the launcher's stop, held back meanwhile
        _held.clear()
        signal.raise_signal(signal.SIGTERM)


def _on_sigterm(signum, frame) -> None:
    """The launcher stops this rank: mark it (and name the lost ranks if it is the first
    to know of a failure), then end by SIGTERM as without the handler."""
    if _reporting:
        _held.append(signum)
        return
    report(None)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)


def _wait_for_marks(part: _Watch) -> list:
    """The ranks still unmarked after :data:`ANSWER_WINDOW_S` (none as soon as every rank
    has marked)."""
    deadline = time.monotonic() + ANSWER_WINDOW_S
    while part.store.add(part.key("marked"), 0) < part.world_size:
        if time.monotonic() >= deadline:
            return [r for r in range(part.world_size)
                    if not part.store.check([part.rank_key(r)])]
        time.sleep(POLL_S)
    return []


def lost_line(ranks: list, world_size: int) -> str:
    """The one line: ``error: rank 2 of 4 was lost (...)``; several ranks as ranges."""
    if len(ranks) == 1:
        return (f"error: rank {ranks[0]} of {world_size} was lost (no error of its own, no "
                f"answer: killed, crashed, or its host is gone); the other ranks' errors "
                f"followed from it")
    return (f"error: ranks {_ranges(ranks)} of {world_size} were lost (no error of their "
            f"own, no answer: killed, crashed, or their hosts are gone); the other "
            f"ranks' errors followed from them")


def _ranges(ranks: list) -> str:
    """``[1, 2, 3, 5]`` -> ``1-3, 5``."""
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(runs)
