"""Per-iteration stage timings for DAC (EDGC §6) and the benchmarks: micro-batch backward,
backward sends, the end of the DP gradient sync, and when gradients are ready.

megatron-core's schedules (0.13.1 ... 0.16.1; checked in ``features.py``) call the
module-level ``pipeline_parallel/schedules.py:backward_step`` by name at call time, so
wrapping that attribute times every micro-batch backward of every schedule (1F1B and interleaved).
Intervals are taken with CUDA events on a GPU (resolved after the loop's end-of-iteration
synchronize) and with a monotonic clock on CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatron_edgc.patches import features


class IntervalClock:
    """Stamps resolved to milliseconds since :meth:`start`: CUDA events or ``perf_counter``."""

    def __init__(self, use_cuda: bool):
        self.use_cuda = use_cuda
        self._origin = None
        self._origin_wall = 0.0

    def start(self) -> None:
        self._origin_wall = time.time()
        self._origin = self.stamp()

    def stamp(self):
        if self.use_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds_between(self, start, end) -> float:
        """Seconds from stamp ``start`` to stamp ``end`` (GPU: once both are complete)."""
        if self.use_cuda:
            return start.elapsed_time(end) / 1e3
        return end - start

    def wait(self) -> None:
        """Until every stamp taken so far is complete (GPU: a device synchronize)."""
        if self.use_cuda:
            torch.cuda.synchronize()

    def ms(self, stamp) -> float:
        """Milliseconds from the iteration start to ``stamp`` (GPU: after a synchronize)."""
        if self.use_cuda:
            return self._origin.elapsed_time(stamp)
        return (stamp - self._origin) * 1e3

    def wall(self, stamp) -> float:
        """``stamp`` as wall-clock seconds (comparable across processes of one machine,
        and across NTP-synced nodes to their clock offset)."""
        return self._origin_wall + self.ms(stamp) / 1e3


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


class StageTimer:
    """Collects the stamps of one iteration; :meth:`finish` turns them into a StageTiming."""

    def __init__(self, use_cuda: bool):
        self.clock = IntervalClock(use_cuda)
        self._backward: list = []
        self._sends: list = []
        self._sync_end = None
        self._grads_ready = None
        self._installed = False

    # ------------------------------------------------------------------ stamps

    def begin_iteration(self) -> None:
        self._backward, self._sends, self._sync_end, self._grads_ready = [], [], None, None
        self.clock.start()

    def stamp(self):
        return self.clock.stamp()

    def record_send(self, start, end) -> None:
        self._sends.append((start, end))

    def mark_sync_end(self) -> None:
        self._sync_end = self.clock.stamp()

    def timed_finalize(self, finalize):
        """Wrap megatron-core's ``finalize_model_grads`` to stamp when gradients are ready."""
        def finalize_and_stamp(*args, **kwargs):
            out = finalize(*args, **kwargs)
            self._grads_ready = self.clock.stamp()
            return out

        return finalize_and_stamp

    def finish(self) -> StageTiming:
        """Resolve the iteration's stamps (call after the end-of-iteration synchronize)."""
        ms = self.clock.ms
        t = StageTiming()
        if self._backward:
            t.backward_ms = sum(ms(b) - ms(a) for a, b in self._backward) / len(self._backward)
            t.backward_end_ms = ms(self._backward[-1][1])
        if self._sends:
            t.send_ms = sum(ms(b) - ms(a) for a, b in self._sends) / len(self._sends)
        if self._sync_end is not None:
            t.sync_end_ms = ms(self._sync_end)
            t.sync_end_wall = self.clock.wall(self._sync_end)
        if self._grads_ready is not None:
            t.grads_ready_ms = ms(self._grads_ready)
        return t

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
            timer._backward.append((start, timer.clock.stamp()))
            return out

        timed_backward_step.__wrapped__ = original
        schedules.backward_step = timed_backward_step
        self._installed = True
