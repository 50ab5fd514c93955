"""Which buckets the bypass sends dense: the link of each reduction group, each bucket's
compress + decompress time as ``a + b·rank`` (timed once), and the decision per rank
setting and link, agreed by every rank that must issue the same collectives
(:mod:`megatron_edgc.compression.bypass` has the rule).

The link follows the link (issue 44): measured with probes once at start-up (or
declared, ``--edgc-link-gbps`` and ``--edgc-link-latency-ms``, and then kept), then every ``window`` iterations refitted
from the job's own collectives on the group — their bytes and the time the link was busy
with each, from device stamps read at the flushes (:class:`~megatron_edgc.patches.
dp_stats.DPSyncStats`), MIN over the group's ranks (the last to arrive waits for nobody):
no probe traffic in steady state, one small all-reduce per group and window. The local
work of each choice is refitted the same way (issue 80): a compressed bucket's math from
its own timed steps (the start-up ``a + b·rank`` scaled to them; on the slow hop with
its collectives inside the instance, which the dense path does not run), a dense
bucket's casts likewise, so that a machine whose math runs slower in the job than in the
start-up timing (4 processes on 2 cores, a CPU without native bf16) prices what it runs. A bucket's
decision flips only when the other choice is predicted to win by ``hysteresis`` of the
larger of saving and cost, so an estimate near the boundary does not flap."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_edgc.compression.bypass import (LinkModel, compressed_sync_s,
                                              link_from_collectives)
from megatron_edgc.compression.matrices import FLOAT_BYTES

logger = logging.getLogger(__name__)


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure_link(group, device) -> LinkModel:
    """α and β of an all-reduce on ``group``, from 1 KiB and 4 MiB buffers (a smaller large
    size drowns β in α's noise): mean of three back-to-back all-reduces (which absorbs the
    replicas' skew after the barrier), best of two, slowest replica."""
    sizes = [256, 1 << 20]
    times = []

    def three(buf):
        for _ in range(3):
            dist.all_reduce(buf, group=group)

    for numel in sizes:
        buf = torch.zeros(numel, dtype=torch.float32, device=device)
        dist.all_reduce(buf, group=group)  # connection warm-up
        best = float("inf")
        for _ in range(2):
            dist.barrier(group=group)
            best = min(best, _timed(lambda: three(buf)) / 3)
        times.append(best)
    worst = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return LinkModel.fit([n * FLOAT_BYTES for n in sizes], worst.tolist())


@dataclasses.dataclass(frozen=True)
class BypassDecision:
    """What :meth:`BypassPlanner.decide` chose for one rank setting, link and cost model:
    the keys sent dense and its predictions, the same for every iteration until one of
    them changes (so the caller keeps it and writes it into each step's telemetry)."""

    sent: frozenset                 # keys sent dense (the other way when exploring)
    explored: bool
    predicted_dense_s: float        # every bucket dense
    predicted_compressed_s: float   # every bucket compressed
    predicted_saving_s: float       # of the buckets sent compressed
    predicted_cost_s: float
    predicted_local: dict           # key -> (dense, seconds of local work)

    def into(self, stats) -> None:
        """Add the decision's predictions to a step's :class:`DPSyncStats` (reset)."""
        stats.predicted_dense_s += self.predicted_dense_s
        stats.predicted_compressed_s += self.predicted_compressed_s
        stats.predicted_saving_s += self.predicted_saving_s
        stats.predicted_cost_s += self.predicted_cost_s
        stats.predicted_local.update(self.predicted_local)
        stats.explored = self.explored


class BypassPlanner:
    """The bypass's decisions for a set of bucket plans (``plans``: key -> BucketPlan);
    ``window``: iterations between refits of the measured links (0: never); ``explore``:
    every this many windows, the first iteration sends every bucket the other way (0:
    never), so that both choices stay measured."""

    def __init__(self, plans: dict, device, link: Optional[LinkModel] = None,
                 window: int = 0, hysteresis: float = 0.25, explore: int = 0):
        self.plans = plans
        self.device = device
        #: bumped whenever what a decision depends on may have changed (a link, the
        #: cost model, the local work, a resume): a caller's kept decision is stale
        self.epoch = 0
        self.declared = link
        self.link = link          # the dense buckets' link (declared: every group's)
        self.links: dict = {}     # process group -> LinkModel
        self.window = window      # a declared link is kept; the local work is refitted
        self.hysteresis = hysteresis
        self.explore = explore if self.window else 0
        self.cost_model: Optional[dict] = None   # bucket key -> (a, b) seconds
        self._agreed: dict = {}   # rank setting -> decisions agreed inside the instances
        self._dense: Optional[frozenset] = None  # the decisions in force
        self._samples: dict = {}  # link index -> [(bytes, busy s, dense)] since the refit
        #: process group -> (compressed buckets, the rate their transfers showed) of the
        #: last window, when some of its buckets went compressed
        self._compressed_seen: dict = {}
        self.probe_ratio = 1.5
        #: bucket key -> its dense path's local work (seconds, the job's own; 0 unseen)
        self.dense_local: dict = {}
        #: bucket key -> ("math" | "dense", [samples]) since the refit: a compressed
        #: step's measured / predicted math, a dense step's local seconds
        self._local_samples: dict = {}

    @property
    def links(self) -> dict:
        """process group -> LinkModel (assigning it makes kept decisions stale)."""
        return self._links

    @links.setter
    def links(self, value: dict) -> None:
        self._links = value
        self.epoch += 1

    @property
    def cost_model(self) -> Optional[dict]:
        """bucket key -> (a, b) seconds of its math (assigning it makes kept decisions
        stale)."""
        return self._cost_model

    @cost_model.setter
    def cost_model(self, value: Optional[dict]) -> None:
        self._cost_model = value
        self.epoch += 1

    def process_groups(self) -> list:
        """``(process group, expert)`` of each distinct reduction group, in bucket order
        (dense before expert on every rank, so every member issues the same order)."""
        seen = {}
        for plan in self.plans.values():
            r = plan.reduction
            seen.setdefault(id(r.process_group), (r.process_group, r.expert))
        return list(seen.values())

    def timed_links(self) -> dict:
        """``{id(process group): link index}`` of the groups whose collectives are timed
        for the refits (none when the link is declared or never refitted)."""
        if not self.window or self.declared is not None:
            return {}
        return {id(pg): i for i, (pg, _) in enumerate(self.process_groups())}

    def observe(self, link_busy: list, local_s: dict = None,
                predicted_local: dict = None) -> None:
        """One step's ``(link index, bytes, busy seconds, dense)`` of every timed transfer
        (:attr:`DPSyncStats.link_busy`, read at a flush), and the local work of each
        bucket the bypass priced (:attr:`DPSyncStats.local_s` against
        :attr:`~DPSyncStats.predicted_local`)."""
        for link, nbytes, busy, dense in link_busy:
            self._samples.setdefault(link, []).append((nbytes, busy, dense))
        for key, (dense, predicted) in (predicted_local or {}).items():
            seconds = (local_s or {}).get(key)
            if seconds is None or seconds != seconds:
                continue
            if dense:
                self._local_samples.setdefault(key, []).append(("dense", seconds))
            elif predicted > 0:
                self._local_samples.setdefault(key, []).append(("math", seconds / predicted))

    @property
    def in_force(self) -> frozenset:
        """The keys the decisions in force send dense (whatever an exploring iteration
        sends)."""
        return self._dense or frozenset()

    def explores(self, iteration: int) -> bool:
        """Whether step ``iteration`` sends every bucket the other way: the first
        iteration of every ``explore``-th window after the links are first measured (the
        same answer on every rank). Its transfers and local work are the other choice's
        measurements at the next refit; the decisions in force stay."""
        return bool(self.explore) and bool(self.links) and iteration > 0 and \
            iteration % (self.window * self.explore) == 0

    def refresh_due(self, iteration: int) -> bool:
        """Whether step ``iteration`` starts with a refit (at every window boundary after
        the links are first measured; the same answer on every rank)."""
        return bool(self.window) and bool(self.links) and iteration % self.window == 0

    def refresh(self) -> list:
        """Refit each group's link from the collectives observed since the last refit
        (MIN of each collective's busy time over the group: a collective on every member);
        returns ``[(group, old link, new link, how)]`` of the refitted groups.

        The link prices dense buckets, so it is fitted to the dense buckets' transfers
        only. A compressed bucket's transfers are small: on a slow link they read it
        several times faster than a dense bucket sees it (a 100 Mbit hop: 65 and 124 kB
        in 4-12 ms, 675 kB in 76-109 ms; issue 80), so they never set the link. They tell
        only that the link got faster: where the group's compressed transfers ran
        ``probe_ratio`` times faster than in the window before (same buckets compressed),
        the link is probed as at start-up, and the decision taken from the probe. A group
        with no dense transfer and no such speed-up keeps its link."""
        self.epoch += 1   # the local work is refitted whatever the links do
        changes = []
        for i, (pg, _) in enumerate(self.process_groups()):
            samples = self._samples.pop(i, [])
            if not samples or pg not in self.links:
                continue
            busy = torch.tensor([t if t == t else float("inf") for _, t, _ in samples],
                                dtype=torch.float64, device=self.device)
            dist.all_reduce(busy, op=dist.ReduceOp.MIN, group=pg)
            kept = [(b, t, dense) for (b, _, dense), t in zip(samples, busy.tolist())
                    if t != float("inf")]
            old = self.links[pg]
            dense_seen = [(b, t) for b, t, dense in kept if dense]
            compressed_seen = [(b, t) for b, t, dense in kept if not dense]
            mix = frozenset(k for k, p in self.plans.items()
                            if p.reduction.process_group is pg and k not in (self._dense or ()))
            before = self._compressed_seen.get(pg)
            rate = link_from_collectives(old, *zip(*compressed_seen)).gbit_per_s \
                if compressed_seen else None
            self._compressed_seen[pg] = (mix, rate) if mix and rate is not None else None
            if mix and rate is not None and before is not None and before[0] == mix and \
                    rate >= self.probe_ratio * before[1]:
                # the same on every member: ``rate`` comes from MIN-reduced times
                how = f"probed: the compressed transfers ran {rate / before[1]:.2g}x faster"
                seen = measure_link(pg, self.device)
            elif dense_seen:
                how = f"from the last {len(dense_seen)} dense transfers"
                seen = link_from_collectives(old, *zip(*dense_seen))
            else:
                continue
            self.links[pg] = seen
            changes.append((pg, old, seen, how))
        self._samples = {}
        self._refit_local_work()
        self._agreed = {}
        if changes:
            self.link = self.links[self.process_groups()[0][0]]
        return changes

    def _refit_local_work(self) -> None:
        """Each bucket's local work from its steps since the last refit (median; the
        slowest replica's: MAX over the bucket's group, one all-reduce per group, on every
        member alike): a compressed bucket's math model scaled by measured / predicted, a
        dense bucket's casts taken as measured. A bucket without steps of a kind keeps
        that kind's figure."""
        samples, self._local_samples = self._local_samples, {}
        if self.cost_model is None:
            return
        for pg, _ in self.process_groups():
            keys = sorted(k for k, p in self.plans.items() if p.reduction.process_group is pg)
            fits = torch.full((2, len(keys)), -1.0, dtype=torch.float64)
            for j, key in enumerate(keys):
                for row, kind in enumerate(("math", "dense")):
                    values = sorted(v for k, v in samples.get(key, []) if k == kind)
                    if values:
                        fits[row, j] = values[len(values) // 2]
            fits = fits.to(self.device)
            dist.all_reduce(fits, op=dist.ReduceOp.MAX, group=pg)
            for key, (ratio, dense_s) in zip(keys, fits.t().tolist()):
                if ratio > 0:
                    a, b = self.cost_model[key]
                    self.cost_model[key] = (a * ratio, b * ratio)
                if dense_s >= 0:
                    self.dense_local[key] = dense_s

    def ensure_models(self, rank: int) -> None:
        """The link of every reduction group (measured with probes on first use, or
        declared) and the compression math's cost model (timed at ``rank`` on first use):
        collectives on first use, so call outside the schedule, on every rank alike."""
        for i, (pg, expert) in enumerate(self.process_groups()):
            if pg not in self.links:
                self.epoch += 1
                self.links[pg] = self.declared or measure_link(pg, self.device)
                if self.declared is None:
                    logger.info("bypass: %s all-reduce %.3g Gbit/s, alpha %.3g ms",
                                "expert-DP" if expert else "DP", self.links[pg].gbit_per_s,
                                self.links[pg].alpha_s * 1e3)
            if i == 0:
                self.link = self.links[pg]
        if self.cost_model is None:
            self.cost_model = self._measure_cost_model(rank)

    # -------------------------------------------------------- checkpoint

    def state_dict(self) -> dict:
        """What the next decisions depend on, so that a resumed run decides as the
        uninterrupted one: the links (in :meth:`process_groups` order) and whether they
        were declared, the math's ``a, b`` and the dense local work per bucket, the
        decisions in force (the hysteresis margin's side) and those agreed per rank
        setting, and what the next refit reads (the samples since the last one, each
        group's compressed transfers of the last window)."""
        groups = self.process_groups()
        return {"links": [None if pg not in self.links else
                          [self.links[pg].alpha_s, self.links[pg].s_per_byte]
                          for pg, _ in groups],
                "declared": self.declared is not None,
                "cost_model": None if self.cost_model is None else
                {k: list(v) for k, v in self.cost_model.items()},
                "dense_local": dict(self.dense_local),
                "in_force": None if self._dense is None else sorted(self._dense),
                "agreed": [[setting, sorted(keys)] for setting, keys in self._agreed.items()],
                "link_samples": {i: [list(x) for x in v] for i, v in self._samples.items()},
                "local_samples": {k: [list(x) for x in v]
                                  for k, v in self._local_samples.items()},
                "compressed_seen": [None if self._compressed_seen.get(pg) is None else
                                    [sorted(self._compressed_seen[pg][0]),
                                     self._compressed_seen[pg][1]] for pg, _ in groups]}

    def load_state_dict(self, state: dict) -> None:
        """A link declared now (``--edgc-link-gbps`` at the resume) wins over the
        checkpoint's; a link the checkpoint declared is measured afresh where none is
        declared now. Checkpoints from before the decisions were saved load their models."""
        self.epoch += 1
        groups = self.process_groups()
        measured = self.declared is None and not state.get("declared", False)
        if measured and len(state.get("links", [])) == len(groups):
            for (pg, _), saved in zip(groups, state["links"]):
                if saved is not None:
                    self.links[pg] = LinkModel(*saved)
            if groups and groups[0][0] in self.links:
                self.link = self.links[groups[0][0]]
            self._samples = {int(i): [tuple(x) for x in v]
                             for i, v in state.get("link_samples", {}).items()}
            seen_before = state.get("compressed_seen", [None] * len(groups))
            for (pg, _), seen in zip(groups, seen_before):
                if seen is not None and set(seen[0]) <= set(self.plans):
                    self._compressed_seen[pg] = (frozenset(seen[0]), seen[1])
        cost = state.get("cost_model")
        if cost is None or set(cost) != set(self.plans):
            return
        self.cost_model = {k: tuple(v) for k, v in cost.items()}
        self.dense_local = {k: v for k, v in state.get("dense_local", {}).items()
                            if k in self.plans}
        self._local_samples = {k: [tuple(x) for x in v]
                               for k, v in state.get("local_samples", {}).items()
                               if k in self.plans}
        if state.get("in_force") is not None:
            self._dense = frozenset(state["in_force"]) & frozenset(self.plans)
        self._agreed = {tuple(setting): frozenset(keys) & frozenset(self.plans)
                        for setting, keys in state.get("agreed", [])}

    # -------------------------------------------------------- the one cost model

    def math_seconds(self, key: str, rank: float) -> float:
        """Compress + decompress time of bucket ``key`` at ``rank`` (the timed ``a + b·r``)."""
        a, b = self.cost_model[key]
        return max(0.0, a + b * rank)

    def compressed_seconds(self, key: str, rank: float, compressor=None) -> float:
        """The compressed sync of bucket ``key``: each of its collectives over the link
        in force (its latency and bytes), plus the math at ``rank``; ``compressor`` (default
        the bucket's, at its ranks in force) gives the collectives."""
        plan = self.plans[key]
        link = self.links[plan.reduction.process_group]
        comp = plan.compressor if compressor is None else compressor
        return compressed_sync_s(link, comp.wire_bytes(), self.math_seconds(key, rank))

    def dense_seconds(self, key: str) -> float:
        """The dense sync of bucket ``key``: one all-reduce in the dense wire dtype, and the
        dense path's local work as the job measured it (0 before it was seen)."""
        plan = self.plans[key]
        return self.links[plan.reduction.process_group].allreduce_s(plan.dense_bytes) + \
            self.dense_local.get(key, 0.0)

    def time_line(self, r_hi: int, r_lo: int) -> tuple:
        """``(fixed, per rank)`` seconds of every compressed bucket's sync together, the
        line through the cost model at ``r_lo`` and ``r_hi`` (uniform ranks): what the
        budget controller's time budget is priced in."""
        at = {}
        for rank in (r_hi, r_lo):
            at[rank] = sum(self.compressed_seconds(k, rank, p.compressor.fresh(rank))
                           for k, p in self.plans.items())
        per_rank = max(0.0, (at[r_hi] - at[r_lo]) / (r_hi - r_lo)) if r_hi > r_lo else 0.0
        return max(0.0, at[r_hi] - per_rank * r_hi), per_rank

    def decide(self, rank: int, rank_setting: tuple, explore: bool = False) -> BypassDecision:
        """The keys to send dense at ``rank`` (collectives on first use of a group, a rank
        setting or the cost model: call outside the schedule): where the compressed sync
        (collectives and math) is predicted slower than the dense one (:attr:`in_force`);
        ``explore``: this iteration sends the others dense and these compressed instead.
        The decision holds the predicted saving and cost of the keys sent compressed. It
        stays valid while :attr:`epoch`, the rank setting and ``explore`` do (deciding
        again on the same inputs gives the same keys: the hysteresis keeps what is in
        force)."""
        self.ensure_models(rank)
        dense, savings, costs, dense_s = set(), {}, {}, {}
        total_dense = total_compressed = 0.0
        for key in self.plans:
            costs[key] = self.math_seconds(key, rank)
            dense_s[key] = self.dense_seconds(key)
            compressed_s = self.compressed_seconds(key, rank)
            total_dense += dense_s[key]
            total_compressed += compressed_s
            savings[key] = dense_s[key] - (compressed_s - costs[key])
            # flip the decision in force only on a clear win (no flapping at the boundary)
            margin = 0.0 if self._dense is None else \
                self.hysteresis * max(savings[key], costs[key]) * \
                (1 if key in self._dense else -1)
            if savings[key] <= costs[key] + margin:
                dense.add(key)
        self._dense = self._agree_inside_instances(dense, rank_setting)
        sent = frozenset(self.plans) - self._dense if explore else self._dense
        saving = cost = 0.0
        local = {}
        for key in self.plans:
            if key not in sent:
                saving += savings[key]
                cost += costs[key]
            local[key] = (key in sent, self.dense_local.get(key, 0.0)
                          if key in sent else costs[key])
        return BypassDecision(sent, explore, total_dense, total_compressed, saving, cost,
                              local)

    def _agree_inside_instances(self, dense: set, rank_setting: tuple) -> frozenset:
        """On the slow hop the ranks of an instance hold different shards, so their savings
        and costs differ; but a compressed bucket also runs collectives inside the
        instance, so every rank of it must decide alike: a bucket goes dense where any
        rank of its instance would send it dense (MAX over the instance). The ranks
        holding the same shard in other instances already agree (same bytes, costs and
        link MAX-reduced over their group). Collectives once per rank setting."""
        intra = {id(p.reduction.intra): p.reduction.intra for p in self.plans.values()
                 if p.reduction.slow_hop}
        if not intra:
            return frozenset(dense)
        if rank_setting not in self._agreed:
            agreed = set(dense)
            for group in intra.values():
                keys = sorted(k for k, p in self.plans.items() if p.reduction.intra is group)
                flags = torch.tensor([float(k in dense) for k in keys], device=self.device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
                agreed |= {k for k, f in zip(keys, flags.tolist()) if f > 0}
            self._agreed[rank_setting] = frozenset(agreed)
        return self._agreed[rank_setting]

    def _measure_cost_model(self, r1: int, trials: int = 3) -> dict:
        """Compress + decompress time of every bucket as ``a + b·rank``: timed at ``r1`` and
        at half of it (once; the job's compressed steps rescale it at each refit), on
        random gradients with a scratch compressor (the real state is untouched); the
        slowest replica's times (MAX over each bucket's reduction group).

        Every replica of the group times together, as the job runs the math (a barrier
        before each trial; the median of ``trials``): where replicas share cores (4
        processes on 2), one timing alone or beside an idle peer read 47 ms where the
        job's steps took 65-75 (issue 80)."""
        keys = sorted(self.plans)
        r2 = r1 // 2 if r1 > 1 else 2
        times = []
        for rank in (r1, r2):
            for key in keys:
                scratch = self.plans[key].compressor.fresh(rank)
                grads = self.plans[key].scratch_grads()
                reduction = self.plans[key].reduction
                # the replicas (and, on the slow hop, the instance's ranks) that run it at once
                groups = [g for g in (reduction.intra, reduction.process_group) if g is not None]

                def once():
                    scratch.local_step(grads)

                once()  # allocates Q and the residual
                trial = []
                for _ in range(trials):
                    for group in groups:
                        dist.barrier(group=group)
                    trial.append(_timed(once))
                times.append(sorted(trial)[len(trial) // 2])
        for pg, _ in self.process_groups():
            at = [i for i, key in enumerate(keys)
                  if self.plans[key].reduction.process_group is pg]
            at += [len(keys) + i for i in at]
            worst = torch.tensor([times[i] for i in at], dtype=torch.float64, device=self.device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pg)
            for i, t in zip(at, worst.tolist()):
                times[i] = t
        model = {}
        for key, t1, t2 in zip(keys, times[:len(keys)], times[len(keys):]):
            b = max(0.0, (t1 - t2) / (r1 - r2))
            model[key] = (t1 - b * r1, b)
        return model
