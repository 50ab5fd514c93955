"""The bucket pipeline: runs one sync strategy per bucket of a group, phase by phase across
the buckets, issuing their collectives, timing and counting them.

A strategy (:mod:`megatron_edgc.patches.dp_plans`) is a generator over one bucket's sync:
it does the math between collectives and yields each :class:`Phase` — the collectives
to issue — and gets control back once they are done; its return value is the bucket's
non-finite flag (or None). An ``inline`` phase is waited for at once (a collective whose
result the same bucket needs next, inside a distributed-optimizer instance); any other
ends the bucket's turn, so bucket k's collective is on the wire while bucket k+1 computes:
``start`` takes every bucket to its first such phase, each ``finish`` round takes every
bucket one phase further, in bucket order. Every rank runs the same strategies in the
same order, so every member of a group issues the same collectives in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator, Optional

import torch
import torch.distributed as dist

from megatron_edgc.patches.dp_stats import DPSyncStats


@dataclass
class Collective:
    """One SUM collective: ``all_reduce`` of ``send`` in place, ``reduce_scatter`` of
    ``send`` into ``recv``, or ``all_gather`` of ``send`` into ``recv``. ``slow_hop``: it
    crosses distributed-optimizer instances (counted apart)."""

    kind: str
    send: torch.Tensor
    group: object
    recv: Optional[torch.Tensor] = None
    slow_hop: bool = False

    def issue(self):
        if self.kind == "all_reduce":
            return dist.all_reduce(self.send, group=self.group, async_op=True)
        if self.kind == "reduce_scatter":
            return dist.reduce_scatter_tensor(self.recv, self.send, group=self.group,
                                              async_op=True)
        assert self.kind == "all_gather", self.kind
        return dist.all_gather_into_tensor(self.recv, self.send, group=self.group,
                                           async_op=True)

    @property
    def nbytes(self) -> int:
        return self.send.numel() * self.send.element_size()


def all_reduce(buf, group, slow_hop=False) -> Collective:
    return Collective("all_reduce", buf, group, slow_hop=slow_hop)


def reduce_scatter(out, buf, group) -> Collective:
    return Collective("reduce_scatter", buf, group, recv=out)


def all_gather(out, buf, group) -> Collective:
    return Collective("all_gather", buf, group, recv=out)


@dataclass
class Phase:
    """The collectives a strategy issues together. ``inline``: waited for at once (module
    docstring), and then the bucket's local work, off the link the bypass prices, unless
    ``common``: a phase every choice of the bucket runs alike (the fast hop's dense
    reduce-scatter), which decides nothing between them. ``switch``: the bucket's local
    work before this phase switched its path (a residual absorbed into a dense message):
    timed apart, the steady price of neither path."""

    collectives: list = field(default_factory=list)
    inline: bool = False
    common: bool = False
    switch: bool = False


Strategy = Generator[Phase, None, Optional[torch.Tensor]]


@dataclass
class _Turn:
    key: str
    expert: bool
    strategy: Strategy
    handles: list
    dense: bool = True   # the bucket goes dense (its transfers time the link in bulk)


class BucketPipeline:
    """The strategies of one bucket group in flight, between ``start_grad_sync`` and
    ``finish_grad_sync`` (module docstring). ``stats`` gets the bytes of every collective
    (sent; dense bytes are the caller's), the time in the strategies' math
    (``compress_s``) and in issuing and waiting (``comm_s``), each bucket's local work
    (its math, and its inline phases but the common ones: collectives inside a
    distributed-optimizer instance, off the link the bypass prices), and the non-finite
    flags;
    each collective on a group of ``timed_links`` (``{id(group): link index}``) is stamped
    at its issue and its completion (the bypass's link model)."""

    def __init__(self, stats: DPSyncStats, timed_links: Optional[dict] = None):
        self.stats = stats
        self.timed_links = timed_links or {}
        self._turns: list = []
        self._phases = 0   # phases issued (a phase's collectives are one transfer)

    def start(self, key: str, expert: bool, strategy: Strategy, dense: bool = True) -> None:
        turn = self._advance(_Turn(key, expert, strategy, [], dense))
        if turn is not None:
            self._turns.append(turn)

    def finish(self) -> None:
        while self._turns:
            turns, self._turns = self._turns, []
            for turn in turns:
                self._wait(turn.handles)
                turn = self._advance(turn)
                if turn is not None:
                    self._turns.append(turn)

    def _wait(self, handles: list, key: Optional[str] = None) -> None:
        t0 = self.stats.clock.stamp()
        for handle in handles:
            handle.wait()
        self.stats.add_time("comm_s", t0, key)

    def _advance(self, turn: _Turn) -> Optional[_Turn]:
        """Run the strategy to its next phase that is not inline and issue that phase;
        None when the strategy has ended."""
        stats = self.stats
        while True:
            t0 = stats.clock.stamp()
            try:
                phase = next(turn.strategy)
            except StopIteration as end:
                stats.add_time("compress_s", t0, turn.key)
                if end.value is not None:
                    stats.add_nonfinite_flag(turn.key, end.value)
                return None
            stats.add_time("compress_s", t0, turn.key, switch=phase.switch)
            t0 = stats.clock.stamp()
            turn.handles = []
            self._phases += 1
            for c in phase.collectives:
                link = self.timed_links.get(id(c.group))
                issued = stats.clock.stamp() if link is not None else None
                turn.handles.append(c.issue())
                if link is not None:
                    stats.add_link_collective(link, c.nbytes, issued,
                                              stats.clock.completion(turn.handles[-1]),
                                              self._phases, turn.dense)
                stats.add_bytes(c.nbytes, 0, turn.expert, c.slow_hop)
                stats.collectives += 1
            if not phase.inline:
                stats.add_time("comm_s", t0)
                return turn
            # an inline phase (inside the instance) is the bucket's local work too: what
            # its choice spends off the priced link
            key = None if phase.common else turn.key
            stats.add_time("comm_s", t0, key)
            self._wait(turn.handles, key)
