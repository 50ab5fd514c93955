"""Which buckets the bypass sends dense: the link of each reduction group (measured once, or
declared), each bucket's compress + decompress time as ``a + b·rank`` (timed once), and the
decision per rank setting, agreed by every rank that must issue the same collectives
(:mod:`megatron_edgc.compression.bypass` has the rule)."""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_edgc.compression.bypass import LinkModel, compression_saving_s
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


class BypassPlanner:
    """The bypass's decisions for a set of bucket plans (``plans``: key -> BucketPlan)."""

    def __init__(self, plans: dict, device, link: Optional[LinkModel] = None):
        self.plans = plans
        self.device = device
        self.declared = link
        self.link = link          # the dense buckets' link (declared: every group's)
        self.links: dict = {}     # process group -> LinkModel
        self.cost_model: Optional[dict] = None   # bucket key -> (a, b) seconds
        self._agreed: dict = {}   # rank setting -> decisions agreed inside the instances

    def process_groups(self) -> list:
        """``(process group, expert)`` of each distinct reduction group, in bucket order
        (dense before expert on every rank, so every member issues the same order)."""
        seen = {}
        for plan in self.plans.values():
            r = plan.reduction
            seen.setdefault(id(r.process_group), (r.process_group, r.expert))
        return list(seen.values())

    def decide(self, rank: int, rank_setting: tuple, stats) -> frozenset:
        """The keys to send dense at ``rank`` (collectives on first use of a group, a rank
        setting or the cost model: call outside the schedule); the predicted saving and
        cost of the others go into ``stats``."""
        for i, (pg, expert) in enumerate(self.process_groups()):
            if pg not in self.links:
                self.links[pg] = self.declared or measure_link(pg, self.device)
                if self.declared is None:
                    logger.info("bypass: %s all-reduce %.3g Gbit/s, alpha %.3g ms",
                                "expert-DP" if expert else "DP", self.links[pg].gbit_per_s,
                                self.links[pg].alpha_s * 1e3)
            if i == 0:
                self.link = self.links[pg]
        if self.cost_model is None:
            self.cost_model = self._measure_cost_model(rank)
        costs = {key: max(0.0, a + b * rank) for key, (a, b) in self.cost_model.items()}
        dense, savings = set(), {}
        for key, plan in self.plans.items():
            savings[key] = compression_saving_s(self.links[plan.reduction.process_group],
                                                plan.dense_bytes,
                                                plan.compressor.wire_bytes(), 0)
            if savings[key] <= costs[key]:
                dense.add(key)
        dense = self._agree_inside_instances(dense, rank_setting)
        for key in self.plans:
            if key not in dense:
                stats.predicted_saving_s += savings[key]
                stats.predicted_cost_s += costs[key]
        return dense

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

    def _measure_cost_model(self, r1: int) -> dict:
        """Compress + decompress time of every bucket as ``a + b·rank``: timed at ``r1`` and
        at half of it (once; EDGC's later ranks are predicted, not re-timed), on random
        gradients with a scratch compressor (the real state is untouched); the slowest
        replica's times (MAX over each bucket's reduction group)."""
        keys = sorted(self.plans)
        r2 = r1 // 2 if r1 > 1 else 2
        times = []
        for rank in (r1, r2):
            for key in keys:
                scratch = self.plans[key].compressor.fresh(rank)
                grads = self.plans[key].scratch_grads()

                def once():
                    scratch.local_step(grads)

                once()  # allocates Q and the residual
                times.append(min(_timed(once), _timed(once)))
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
