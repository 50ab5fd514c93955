"""Per-iteration telemetry of the DP gradient sync: bytes, times as device-clock stamps,
non-finite flags, bypass counts (what :mod:`megatron_edgc.patches.ddp` records; the runtime
takes each step's and reads them at the log interval)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_edgc.patches.timing import IntervalClock


@dataclass
class DPSyncStats:
    """Per-iteration DP-sync telemetry of this rank.

    Nothing here waits for the device during the step: times are kept as pairs of
    :attr:`clock` stamps (CUDA events on a GPU, ``perf_counter`` on CPU) and each bucket's
    non-finite flag as a device tensor; :meth:`take` hands a step's over and
    :meth:`resolve_all` turns those of many steps into ``compress_s``, ``comm_s``,
    ``nonfinite_buckets`` and events, with one device wait and one read.
    """

    bytes_sent: int = 0      # bytes placed into DP collectives
    bytes_dense: int = 0     # bytes plain megatron-core would have placed
    expert_bytes_sent: int = 0   # of those, the expert-parallel buckets' (MoE)
    expert_bytes_dense: int = 0
    slow_hop_bytes_sent: int = 0   # of those, across distributed-optimizer instances
    slow_hop_bytes_dense: int = 0
    collectives: int = 0     # DP collectives this rank issued (megatron-core's one per bucket)
    compress_s: float = 0.0  # time in compression math (P, QR, Q, decompression)
    comm_s: float = 0.0      # time launching and waiting for the collectives (GPU: the
                             # time the stream waited for them)
    nonfinite_buckets: int = 0       # buckets some rank flagged NaN/Inf (left NaN, EF kept)
    #: the buckets whose factors failed from finite gradients (this rank's view)
    factor_failures: list = field(default_factory=list)
    factors_stood_in: int = 0        # ... the matrices whose basis stood in, in all of them
    bypassed_buckets: int = 0        # sent dense by a decision: the bypass or the fallback
    fallback_buckets: int = 0        # of those, by the fallback (their factors failed)
    buckets: int = 0                 # this rank's buckets
    predicted_saving_s: float = 0.0  # link-model saving of the buckets sent compressed
    predicted_cost_s: float = 0.0    # their measured compress + decompress time
    #: the bypass's predictions of both choices for its buckets at this step's rank
    #: (every bucket dense; every bucket compressed), and of each bucket's local work on
    #: the path it takes (``{key: (dense, seconds)}``): what :attr:`local_s` is held to
    predicted_dense_s: float = 0.0
    predicted_compressed_s: float = 0.0
    predicted_local: dict = field(default_factory=dict)
    explored: bool = False   # the bypass sent every bucket the other way (it measures it)
    #: ``{key: seconds}``: each bucket's local work this step (its strategy's math between
    #: collectives: compression, or the dense path's casts; and its collectives
    #: inside a distributed-optimizer instance, off the priced link), from :meth:`resolve_all`
    local_s: dict = field(default_factory=dict)
    #: ``{key: seconds}``: the local work of a bucket switching its path this step (its
    #: residuals absorbed into a dense message), kept out of :attr:`local_s`
    switch_s: dict = field(default_factory=dict)
    compressed: bool = False
    link_gbps: float = float("nan")  # the bypass's link rate in use (all-reduce payload)
    link_alpha_ms: float = float("nan")  # ... and its latency per collective
    events: list = field(default_factory=list)
    #: (link index, bytes, seconds the link was busy with it, dense): each transfer on a
    #: bypass-decided group, filled by :meth:`resolve_all` (the link model's input);
    #: ``dense``: of a bucket sent dense (a compressed bucket's transfers are small)
    link_busy: list = field(default_factory=list)
    clock: IntervalClock = field(default_factory=lambda: IntervalClock(use_cuda=False))
    _intervals: list = field(default_factory=list)  # (name, start, end, key, switch)
    _nonfinite: list = field(default_factory=list)  # (bucket key, bool [2] device tensor)
    _link: list = field(default_factory=list)  # (link, bytes, issue, completion, phase, dense)

    def reset(self) -> None:
        self.bytes_sent = self.bytes_dense = self.nonfinite_buckets = 0
        self.expert_bytes_sent = self.expert_bytes_dense = 0
        self.slow_hop_bytes_sent = self.slow_hop_bytes_dense = 0
        self.bypassed_buckets = self.collectives = self.factors_stood_in = 0
        self.fallback_buckets = self.buckets = 0
        self.compress_s = self.comm_s = 0.0
        self.predicted_saving_s = self.predicted_cost_s = 0.0
        self.predicted_dense_s = self.predicted_compressed_s = 0.0
        self.predicted_local, self.local_s, self.switch_s = {}, {}, {}
        self.explored = False
        self.compressed = False
        self.link_gbps = self.link_alpha_ms = float("nan")
        self.events, self.link_busy, self.factor_failures = [], [], []
        self._intervals, self._nonfinite, self._link = [], [], []

    def add_bytes(self, sent: int, dense: int, expert: bool, slow_hop: bool = False) -> None:
        """Count ``sent`` bytes placed into collectives where megatron-core would place
        ``dense`` (``expert``: an expert-parallel bucket; ``slow_hop``: across
        distributed-optimizer instances)."""
        self.bytes_sent += sent
        self.bytes_dense += dense
        if expert:
            self.expert_bytes_sent += sent
            self.expert_bytes_dense += dense
        if slow_hop:
            self.slow_hop_bytes_sent += sent
            self.slow_hop_bytes_dense += dense

    def add_time(self, name: str, start, key: Optional[str] = None,
                 switch: bool = False) -> None:
        """Count the time from ``start`` (a stamp of :attr:`clock`) to now into ``name``
        (and into bucket ``key``'s :attr:`local_s`, where given; ``switch``: its
        :attr:`switch_s` instead)."""
        self._intervals.append((name, start, self.clock.stamp(), key, switch))

    def add_link_collective(self, link: int, nbytes: int, issued, completed,
                            phase: int = -1, dense: bool = True) -> None:
        """A collective of ``nbytes`` on link ``link`` (the bypass planner's group index),
        issued at stamp ``issued``, completing at stamp ``completed``
        (:meth:`~megatron_edgc.patches.timing.IntervalClock.completion`); the collectives
        of one ``phase`` (issued together) are one transfer; ``dense``: a dense bucket's."""
        self._link.append((link, nbytes, issued, completed, phase, dense))

    def add_nonfinite_flag(self, key: str, flags: torch.Tensor) -> None:
        """Bucket ``key``'s flags of this step (``[2]`` on the device: left non-finite, and
        the matrices whose factors failed; :meth:`~megatron_edgc.compression.kernels.Step.flags`)."""
        self._nonfinite.append((key, flags))

    def take(self) -> "DPSyncStats":
        """This step's telemetry, unread, as a copy; this object starts afresh (same clock)."""
        step = copy.copy(self)
        self.reset()
        return step

    def resolve(self) -> None:
        """Turn the step's stamps and flags into numbers (reads the device: after the step's
        work; a second call adds nothing)."""
        DPSyncStats.resolve_all([self])

    @staticmethod
    def resolve_all(steps: list, wait: bool = True) -> None:
        """:meth:`resolve` of several steps' stats: one device wait (``wait=False``: the
        caller has waited), one read of all their non-finite flags."""
        if wait and any(s._intervals or s._link for s in steps):
            steps[0].clock.wait()
        for s in steps:
            for name, start, end, key, switch in s._intervals:
                seconds = s.clock.seconds_between(start, end)
                setattr(s, name, getattr(s, name) + seconds)
                if key is not None:
                    into = s.switch_s if switch else s.local_s
                    into[key] = into.get(key, 0.0) + seconds
            s._intervals = []
            s._resolve_link()
        flagged = [(s, key, flag) for s in steps for key, flag in s._nonfinite]
        if flagged:
            values = torch.stack([flag.view(2) for _, _, flag in flagged]).tolist()
            for (s, key, _), (bad, factors) in zip(flagged, values):
                if factors:
                    s.factor_failures.append(key)
                    s.factors_stood_in += int(factors)
                if factors and not bad:
                    s.events.append(f"failed factorization from finite gradients in {key}: "
                                    f"a fixed basis stood in for {int(factors)} matrices, "
                                    f"the error feedback keeps what it missed")
                elif factors:
                    s.events.append(f"non-finite factors from finite gradients in {key}: "
                                    f"gradients left non-finite, error feedback untouched")
                elif bad:
                    s.events.append(f"non-finite gradient in {key}: left non-finite, "
                                    f"error feedback untouched")
                s.nonfinite_buckets += bool(bad)
        for s in steps:
            s._nonfinite = []

    def _resolve_link(self) -> None:
        """Each transfer on a link — a collective, or the collectives of one phase (issued
        together, they share the link and pay their latency together) — with its bytes
        and the time from its issue, or from the end of the link's transfers before it if
        later (queued or concurrent ones share the link: the busy times add up to the time
        the link had any in flight), to its last completion. The transfers follow from the
        issue order alone, so every member of a group has the same list."""
        if not self._link:
            return
        origin = self._link[0][2]
        ends: dict = {}      # link -> the latest completion of its transfers so far
        current = None       # (index in link_busy, link, phase, start) of the open transfer
        for link, nbytes, issued, completed, phase, dense in self._link:
            start = self.clock.seconds_between(origin, issued)
            end = self.clock.seconds_between(origin, completed)
            if current is not None and current[1:3] == (link, phase) and phase >= 0:
                i, _, _, first = current
                _, b, t, _ = self.link_busy[i]
                self.link_busy[i] = (link, b + nbytes, max(t, end - first), dense)
            else:
                first = max(start, ends.get(link, start))
                self.link_busy.append((link, nbytes, end - first, dense))
                current = (len(self.link_busy) - 1, link, phase, first)
            if end == end:   # NaN: its completion callback has not run (CPU): the busy
                ends[link] = max(end, ends.get(link, end))   # time reads NaN
        self.link_busy = [(link, b, t if t != t else max(0.0, t), dense)
                          for link, b, t, dense in self.link_busy]
        self._link = []
