"""Per-iteration stage timings for DAC (EDGC §6) and the benchmarks: micro-batch backward,
backward sends, the end of the DP gradient sync, and when gradients are ready.

megatron-core's schedules (0.13.1 ... 0.16.1; checked in ``features.py``) call the
module-level ``pipeline_parallel/schedules.py:backward_step`` by name at call time, so
wrapping that attribute times every micro-batch backward of every schedule (1F1B and interleaved).
Intervals are taken with CUDA events on a GPU and with a monotonic clock on CPU, every
iteration, and read only where the runtime reads its telemetry (at ``--log-interval``):
one device wait for all the iterations since the last read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from megatron_edgc.patches import features


class IntervalClock:
    """Stamps of the device's timeline, read later: CUDA events on a GPU, ``perf_counter``
    on CPU. Taking a stamp never waits for the device; reading one (GPU) needs every stamp
    read to be complete: call :meth:`wait` first, once for all of them."""

    def __init__(self, use_cuda: bool):
        self.use_cuda = use_cuda
        self._origin = None       # start()'s stamp
        self._origin_wall = 0.0
        self._anchor = None       # a stamp taken with the device idle, and its wall time
        self._anchor_wall = 0.0
        self._side = None         # the stream completion stamps wait on (GPU)

    def start(self) -> None:
        """Set the origin of :meth:`ms`."""
        self._origin_wall = time.time()
        self._origin = self.stamp()

    def stamp(self):
        if self.use_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def completion(self, work):
        """A stamp of when the asynchronous collective ``work`` completes, taken without
        waiting for it: on a GPU an event recorded on a side stream made to wait for the
        work (the stream that waits for it later is untouched); on CPU the host clock in
        the work's completion callback (gloo runs it as the collective ends). Read it as
        any stamp; a CPU stamp whose callback has not run reads NaN."""
        if self.use_cuda:
            if self._side is None:
                self._side = torch.cuda.Stream()
            with torch.cuda.stream(self._side):
                work.wait()
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            return event
        done = _Completion()
        work.get_future().add_done_callback(done)
        return done

    def seconds_between(self, start, end) -> float:
        """Seconds from stamp ``start`` to stamp ``end`` (GPU: once both are complete)."""
        if self.use_cuda:
            return start.elapsed_time(end) / 1e3
        return float(end) - float(start)

    def ms_between(self, start, end) -> float:
        """Milliseconds from stamp ``start`` to stamp ``end`` (GPU: once both are complete)."""
        return self.seconds_between(start, end) * 1e3

    def wait(self) -> None:
        """Until every stamp taken so far is complete (GPU: a device synchronize)."""
        if self.use_cuda:
            torch.cuda.synchronize()

    def ms(self, stamp) -> float:
        """Milliseconds from :meth:`start` to ``stamp`` (GPU: once both are complete)."""
        return self.ms_between(self._origin, stamp)

    def anchor(self) -> None:
        """Pin the stamps to the wall clock: call with the device idle (after :meth:`wait`),
        when a stamp completes as it is taken."""
        self._anchor, self._anchor_wall = self.stamp(), time.time()

    def wall(self, stamp) -> float:
        """``stamp`` as wall-clock seconds (comparable across processes of one machine, and
        across NTP-synced nodes to their clock offset): from the last :meth:`anchor` (the
        host may run ahead of the device, so the time a stamp is taken is not its time);
        without one, from :meth:`start`."""
        if self._anchor is None:
            return self._origin_wall + self.ms(stamp) / 1e3
        return self._anchor_wall + self.seconds_between(self._anchor, stamp)


class _Completion:
    """A CPU stamp set by a future's done-callback (:meth:`IntervalClock.completion`)."""

    __slots__ = ("t",)

    def __init__(self):
        self.t = float("nan")

    def __call__(self, _future) -> None:
        self.t = time.perf_counter()

    def __float__(self) -> float:
        return self.t


@dataclass
class StageTiming:
    """One iteration of one rank, in milliseconds."""

    backward_ms: float = float("nan")      # mean micro-batch backward time t_b
    backward_end_ms: float = float("nan")  # end of the last backward, since iteration start
    send_ms: float = float("nan")          # mean backward-send time t_p2p (NaN: no sends)
    sync_end_ms: float = float("nan")      # end of the DP gradient sync
    sync_end_wall: float = float("nan")    # the same, as wall-clock seconds
    grads_ready_ms: float = float("nan")   # end of finalize_model_grads (DP sync and the
                                           # tied-embedding / TP norm all-reduces)

    @property
    def sync_ms(self) -> float:
        """The DP sync time after this stage's backward: what DAC's ``T_s(r)`` models."""
        return self.sync_end_ms - self.backward_end_ms

    @property
    def grad_sync_ms(self) -> float:
        """Last backward done → gradients ready for the optimizer (any mode, any layout)."""
        return self.grads_ready_ms - self.backward_end_ms


@dataclass
class StageStamps:
    """The stamps of one iteration, not yet read; :meth:`resolve` reads them."""

    origin: object                                    # the iteration's start
    backward: list = field(default_factory=list)      # (start, end) per micro-batch
    sends: list = field(default_factory=list)         # (start, end) per backward send
    sync_end: object = None
    grads_ready: object = None

    def resolve(self, clock: IntervalClock) -> StageTiming:
        """The iteration's times (GPU: after ``clock.wait()``; wall times from its last
        anchor)."""
        def ms(stamp):
            return clock.ms_between(self.origin, stamp)

        t = StageTiming()
        if self.backward:
            t.backward_ms = sum(ms(b) - ms(a) for a, b in self.backward) / len(self.backward)
            t.backward_end_ms = ms(self.backward[-1][1])
        if self.sends:
            t.send_ms = sum(ms(b) - ms(a) for a, b in self.sends) / len(self.sends)
        if self.sync_end is not None:
            t.sync_end_ms = ms(self.sync_end)
            t.sync_end_wall = clock.wall(self.sync_end)
        if self.grads_ready is not None:
            t.grads_ready_ms = ms(self.grads_ready)
        return t


class StageTimer:
    """Collects the stamps of one iteration; :meth:`take` hands them over, unread."""

    def __init__(self, use_cuda: bool):
        self.clock = IntervalClock(use_cuda)
        self._stamps = StageStamps(origin=None)
        self._installed = False

    # ------------------------------------------------------------------ stamps

    def begin_iteration(self) -> None:
        self._stamps = StageStamps(origin=self.clock.stamp())

    def stamp(self):
        return self.clock.stamp()

    def record_send(self, start, end) -> None:
        self._stamps.sends.append((start, end))

    def mark_sync_end(self) -> None:
        self._stamps.sync_end = self.clock.stamp()

    def timed_finalize(self, finalize):
        """Wrap megatron-core's ``finalize_model_grads`` to stamp when gradients are ready."""
        def finalize_and_stamp(*args, **kwargs):
            out = finalize(*args, **kwargs)
            self._stamps.grads_ready = self.clock.stamp()
            return out

        return finalize_and_stamp

    def take(self) -> StageStamps:
        """The iteration's stamps, unread (read them with ``resolve(timer.clock)``)."""
        stamps, self._stamps = self._stamps, StageStamps(origin=None)
        return stamps

    # ------------------------------------------------------------------ the patch

    def install(self) -> None:
        """Wrap ``schedules.backward_step`` (once per timer)."""
        from megatron.core.pipeline_parallel import schedules

        features.require("timing")
        if self._installed:
            return
        original = schedules.backward_step
        timer = self

        def timed_backward_step(*args, **kwargs):
            start = timer.clock.stamp()
            out = original(*args, **kwargs)
            timer._stamps.backward.append((start, timer.clock.stamp()))
            return out

        timed_backward_step.__wrapped__ = original
        schedules.backward_step = timed_backward_step
        self._installed = True
