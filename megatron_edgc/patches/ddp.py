"""PowerSGD on megatron-core's data-parallel gradient sync (EDGC §1): the driver that
patches each bucket group's ``start_grad_sync``/``finish_grad_sync`` and runs one plan per
bucket through the bucket pipeline.

megatron-core (0.13–0.19) reduces gradients per bucket group in
``_ParamAndGradBucketGroup.start_grad_sync`` (scale by ``gradient_scaling_factor``, then
all-reduce, or reduce-scatter for the distributed optimizer, async with
``overlap_grad_reduce``) and waits in ``finish_grad_sync``. With compression on, this
module replaces those two methods on each bucket-group *instance*: start scales as
Megatron does and takes every bucket's strategy (:mod:`~megatron_edgc.patches.dp_plans`:
flat, slow hop, or dense by the bypass) to its first collective; finish runs them to the
end, phase by phase across the buckets (:mod:`~megatron_edgc.patches.dp_pipeline`), so
one bucket's ``Q`` travels while the next is orthonormalized, and leaves the decompressed
average in every bucket's ``grad_data`` on every rank (with the distributed optimizer
each rank reads its shard of it: the all-reduce replaces the reduce-scatter).

Everything after (the tied-embedding sync, clipping, the optimizer) sees an ordinary
reduced gradient — or, where some rank's bucket held a NaN/Inf, a bucket with NaN in it,
which the optimizer's own non-finite handling acts on (error feedback untouched).

Neither method waits for the device: under ``overlap_grad_reduce`` the start runs inside
backward. The non-finite decision is taken on the device, and the step's times and flags
are collected as clock stamps and device tensors (:mod:`~megatron_edgc.patches.dp_stats`).

With compression off nothing is patched, and training is bit-identical to plain
megatron-core. Before ``start_iter``, whenever the rank table says "dense", on a group of
one replica, and when megatron-core asks for ``force_all_reduce`` (core_v0.19's
``training.py`` does, to save weight gradients) the original methods run — the last after
every residual is added into the gradients, so the dense message carries the whole error.
"""

from __future__ import annotations

import logging
import types
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_edgc.compression.bypass import LinkModel
from megatron_edgc.patches import features
from megatron_edgc.patches.bucket_matrices import bucket_matrices, stacked_expert_shapes
from megatron_edgc.patches.bypass_planner import BypassPlanner
from megatron_edgc.patches.debug_dump import DebugDump
from megatron_edgc.patches.dense_fallback import FallbackPolicy
from megatron_edgc.patches.dp_pipeline import BucketPipeline
from megatron_edgc.patches.dp_plans import BucketPlan
from megatron_edgc.patches.dp_stats import DPSyncStats
from megatron_edgc.patches.megatron_buckets import (BUCKET_ATTRIBUTES, GROUP_ATTRIBUTES,
                                                    Reduction, copy_extra_main_grads,
                                                    instances_stream,
                                                    is_first_batch, megatron_sync_bytes,
                                                    reduction_group, require_attributes,
                                                    stream_context)
from megatron_edgc.patches.replica_check import replica_mismatches
from megatron_edgc.patches.timing import IntervalClock

__all__ = ["DPGradientCompression", "DPSyncStats", "megatron_sync_bytes", "reduction_group"]

logger = logging.getLogger(__name__)

def dense_wire_dtype(dense_wire: str, buffer_dtype: torch.dtype) -> torch.dtype:
    """``--edgc-dense-wire``: the dtype a dense sync puts on the wire: bf16 in place of
    fp32 ("bf16", the default); the buffer's own otherwise (never a wider one, nor fp16
    traded for bf16's shorter mantissa)."""
    if dense_wire == "bf16" and buffer_dtype == torch.float32:
        return torch.bfloat16
    return buffer_dtype



class _PendingSync:
    """A bucket group's sync in flight (megatron-core's ``grad_reduce_handle``):
    ``wait()`` runs the pipeline to the end."""

    def __init__(self, finish: Callable[[], None]):
        self._finish = finish

    def wait(self) -> None:
        self._finish()


class DPGradientCompression:
    """One :class:`~megatron_edgc.patches.dp_plans.BucketPlan` per DDP bucket, and the
    patch on every bucket group.

    Each bucket is compressed over the group megatron-core reduces it on (dense buckets
    over DP (×CP), MoE experts' over the expert-data-parallel group; ``dp_group`` is only
    for messages). With Megatron's partial distributed optimizer the instance's
    reduce-scatter stays dense and only this rank's shard is compressed, across instances.

    ``rank`` is a static rank or the controller's entry for this stage, ``None`` meaning
    dense (EDGC's warm-up); compression runs from ``start_iter`` on. ``entropy_probe``,
    when set, is shown every bucket's local gradient before the sync; ``sync_end_hook``,
    when set, is called as each bucket group's sync completes (DAC's timer).

    ``bypass="auto"`` sends a bucket dense when compressing it would not pay
    (:mod:`~megatron_edgc.patches.bypass_planner`), its links refitted every
    ``link_window`` iterations from the collectives the job runs (0: measured once),
    and every ``link_explore`` windows one iteration sent the other way.
    """

    def __init__(self, chunks, dp_group, *, rank: Optional[int], min_compression_rate: float,
                 start_iter: int, seed: int, bypass: str = "off",
                 link: Optional[LinkModel] = None, factor_dtype: torch.dtype = torch.float32,
                 ef_dtype: torch.dtype = torch.float32, compress_single_replica: bool = False,
                 link_window: int = 0, link_explore: int = 0,
                 debug_dump: Optional[str] = None,
                 dense_wire: str = "grad", fallback_iters: int = 20):
        features.require("ddp")
        # 0.16+: start/finish_grad_sync(force_all_reduce=False); 0.13-0.15: no argument
        self._takes_force_all_reduce = features.grad_sync_takes_force_all_reduce()
        self.dp_group = dp_group
        self.rank = rank
        self.start_iter = start_iter
        self.iteration = 0
        self.seed = seed
        self.stats = DPSyncStats()
        self.debug_dump = DebugDump(debug_dump, dist.get_rank()) if debug_dump else None
        self.entropy_probe: Optional[Callable[[str, torch.Tensor], None]] = None
        self.sync_end_hook: Optional[Callable[[], None]] = None
        # buckets reduced over one replica: left to megatron-core unless validating
        self.compress_single_replica = compress_single_replica
        self.bypass = bypass
        self.plans: dict[str, BucketPlan] = {}
        self._group_plans: dict[int, list] = {}   # id(bucket group) -> its plans
        self.bucket_groups = []
        settings = dict(min_compression_rate=min_compression_rate, seed=seed,
                        factor_dtype=factor_dtype, ef_dtype=ef_dtype)
        for ci, chunk in enumerate(chunks):
            names = {p: f"chunk{ci}.{n}" for n, p in chunk.module.named_parameters()}
            stacked = stacked_expert_shapes(chunk.module)
            dense_groups = list(chunk.bucket_groups)
            for gi, group in enumerate(dense_groups + chunk.expert_parallel_bucket_groups):
                require_attributes(group, GROUP_ATTRIBUTES, "_ParamAndGradBucketGroup")
                reduction = Reduction.of(group, expert=gi >= len(dense_groups))
                plans = []
                for bi, bucket in enumerate(group.buckets):
                    require_attributes(bucket, BUCKET_ATTRIBUTES, "_ParamAndGradBucket")
                    key = f"chunk{ci}.group{gi}.bucket{bi}"
                    dense_dtype = dense_wire_dtype(dense_wire, bucket.grad_data.dtype)
                    plans.append(BucketPlan.build(
                        key, bucket, reduction, bucket_matrices(bucket, names, stacked),
                        [(names[p], p) for p in bucket.params_list], rank or 1,
                        dict(settings, device=bucket.grad_data.device,
                             dense_dtype=dense_dtype)))
                    self.plans[key] = plans[-1]
                self._group_plans[id(group)] = plans
                self._patch(group)
                self.bucket_groups.append(group)
        devices = {p.bucket.grad_data.device for p in self.plans.values()}
        self.device = next(iter(devices), None)
        self.stats.clock = IntervalClock(use_cuda=any(d.type == "cuda" for d in devices))
        self.planner = BypassPlanner(self.plans, self.device, link,
                                     window=link_window if bypass == "auto" else 0,
                                     explore=link_explore)
        self._timed_links: dict = {}   # id(process group) -> link index, once measured
        self.dense_keys: frozenset = frozenset()       # buckets sent dense this iteration
        self.fallback_keys: frozenset = frozenset()    # ... of those, by the fallback
        self.fallback = FallbackPolicy(self.plans, fallback_iters)  # factors that failed
        self._rank_setting: tuple = (rank, ())         # what the bypass decisions depend on
        self._prepared = False     # every bucket's warm start allocated at the rank setting
        #: ``((rank setting, explore, planner epoch), BypassDecision)`` in force, or None
        self._decision: Optional[tuple] = None

    # ------------------------------------------------------------------ views

    @property
    def compressors(self) -> dict:
        return {key: plan.compressor for key, plan in self.plans.items()}

    @property
    def link(self) -> Optional[LinkModel]:
        return self.planner.link

    @property
    def active(self) -> bool:
        return self.rank is not None and self.iteration >= self.start_iter

    # ------------------------------------------------------------------ control

    def set_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.stats.reset()
        if self.debug_dump is not None:
            self.debug_dump.iteration = iteration

    def set_loss_scale(self, scale: Optional[torch.Tensor]) -> None:
        """The loss scale of the coming step (fp16's scaler, float ``[1]`` on the device;
        None without one): every bucket reads its residual in that step's units."""
        for plan in self.plans.values():
            plan.compressor.loss_scale = scale

    def after_step(self, applied: bool) -> None:
        """After the optimizer: whether it applied the step (a skip loses nothing:
        :meth:`~megatron_edgc.compression.low_rank_state.LowRankState.after_step`)."""
        for plan in self.plans.values():
            plan.compressor.after_step(applied)

    def prepare_iteration(self) -> None:
        """Before the schedule: the warm starts of a new rank (seeded here, never inside
        backward) and the bypass decisions for this iteration's rank (the first call per
        rank runs collectives on each bucket's group).

        Both only where something can change: the warm starts at the first compressed
        iteration, a new rank setting and a resume; the decisions there too, and where the
        planner's inputs moved (a refit at a window end, an exploring iteration and the
        one after it). Every other iteration reuses the decision in force and writes its
        predictions into the step's telemetry, as deciding again would have."""
        if not self.active:
            self.dense_keys = self.fallback_keys = frozenset()
            return
        if not self._prepared:
            for plan in self.plans.values():
                plan.compressor.prepare()
            self._prepared = True
        self.fallback_keys = self.fallback.dense_at(self.iteration, self.stats.events)
        if self.bypass != "auto":
            self.dense_keys = self.fallback_keys
            return
        first = not self.planner.links
        refitted = self.planner.refresh() if self.planner.refresh_due(self.iteration) else []
        explore = self.planner.explores(self.iteration)
        inputs = (self._rank_setting, explore, self.planner.epoch)
        if self._decision is None or self._decision[0] != inputs:
            in_force = self.planner.in_force
            decision = self.planner.decide(self.rank, self._rank_setting, explore=explore)
            dense = self.planner.in_force
            # deciding may measure a link or the cost model: the inputs as they stand now
            self._decision = ((self._rank_setting, explore, self.planner.epoch), decision)
            if self._can_time_links():
                self._timed_links = self.planner.timed_links()
            for _, old, new, how in refitted:
                self.stats.events.append(
                    f"bypass: link {old.gbit_per_s:.3g} -> {new.gbit_per_s:.3g} Gbit/s "
                    f"(all-reduce payload, {how})")
            if first or dense != in_force:
                how = "declared" if self.planner.declared else \
                    "measured at start-up" if first else "refitted"
                self.stats.events.append(
                    f"bypass at rank {self.rank}: {len(dense)} of {len(self.plans)} buckets "
                    f"sent dense (link {self.link.gbit_per_s:.3g} Gbit/s, {how})")
        decision = self._decision[1]
        decision.into(self.stats)
        self.stats.link_gbps = self.link.gbit_per_s
        self.stats.link_alpha_ms = self.link.alpha_s * 1e3
        self.dense_keys = decision.sent | self.fallback_keys
        for key in self.fallback_keys:   # dense by the fallback: its local work is dense
            self.stats.predicted_local[key] = (True, self.planner.dense_local.get(key, 0.0))

    def _can_time_links(self) -> bool:
        """Whether the collectives can be stamped at completion without waiting: CPU
        tensors (gloo's completion callback) or NCCL (an event on a side stream). gloo on
        CUDA tensors completes only on a host wait: there the start-up link is kept."""
        if not self.stats.clock.use_cuda:
            return True
        return all(dist.get_backend(pg) == "nccl" for pg, _ in self.planner.process_groups())

    def observe_link(self, steps: list) -> None:
        """The link collectives of read steps (``DPSyncStats`` after ``resolve_all``)."""
        for step in steps:
            self.planner.observe(step.link_busy, step.local_s, step.predicted_local)
            step.link_busy = []

    def observe_failures(self, steps: list, iteration: int) -> None:
        """Count the factor failures of read steps (``DPSyncStats`` after ``resolve_all``,
        the last of them iteration ``iteration``, 1-based), each bucket's the MAX over the
        DP group (on the slow hop a failure is one shard's view), into the dense fallback
        (:class:`~megatron_edgc.patches.dense_fallback.FallbackPolicy`). A collective on
        the DP group where the steps compressed: every member reads the same steps at the
        same flush."""
        if not steps or not any(s.compressed for s in steps):
            return
        keys = list(self.plans)
        counts = torch.tensor([float(sum(s.factor_failures.count(k) for s in steps))
                               for k in keys], device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.dp_group)
        self.fallback.observe(dict(zip(keys, counts.tolist())), iteration, steps[-1].events)

    def set_rank(self, rank) -> None:
        """A new rank for every bucket (None: dense; the compressor state is kept); a dict
        ``{(n, m): rank}`` sets one rank per matrix shape (the budget controller)."""
        if isinstance(rank, dict):
            shape_ranks, rank = rank, max(rank.values(), default=1)
        else:
            shape_ranks = None
        self.rank = rank
        setting = (rank, tuple(sorted((shape_ranks or {}).items())))
        if setting != self._rank_setting:
            self._prepared = False   # new groups' warm starts: allocated before the next step
        self._rank_setting = setting
        if rank is not None:
            for plan in self.plans.values():
                plan.compressor.set_rank(rank, shape_ranks)

    def time_line(self, r_hi: int, r_lo: int) -> tuple:
        """``(fixed, per rank)`` seconds of this rank's compressed DP sync per iteration
        under the bypass's cost model (the link in force, the timed math): collectives on
        first use, on every rank alike (the budget controller's time budget)."""
        self.planner.ensure_models(r_hi)
        return self.planner.time_line(r_hi, r_lo)

    def shape_counts(self) -> dict:
        """``{(n, m): number of matrices}`` of this rank's buckets (vectors excluded)."""
        counts: dict = {}
        for plan in self.plans.values():
            for n, m in plan.compressor.matrix_shapes():
                if n > 1 and m > 1:
                    counts[(n, m)] = counts.get((n, m), 0) + 1
        return counts

    def track_spectrum(self, on: bool = True) -> None:
        for plan in self.plans.values():
            plan.compressor.track_spectrum = on

    def pop_spectrum(self) -> dict:
        """``{(n, m): (Σ‖M‖², Σ sorted column energies)}`` over all buckets since the last
        call, then cleared: a float and a CPU tensor (read from the device here, once per
        window)."""
        out: dict = {}
        for plan in self.plans.values():
            comp = plan.compressor
            for shape, (total, cols, _) in comp.spectrum.items():
                if shape in out and out[shape][1].numel() == cols.numel():
                    out[shape] = (out[shape][0] + total, out[shape][1] + cols)
                else:
                    out[shape] = (total, cols.clone())
            comp.spectrum = {}
        return {shape: (float(total), cols.cpu()) for shape, (total, cols) in out.items()}

    def bucket_grads(self):
        """(key, grad_data) of every bucket, in a fixed order."""
        for key, plan in self.plans.items():
            yield key, plan.bucket.grad_data

    def bucket_params(self):
        """(key, [(name, param), ...]) of every bucket, in the order of :meth:`bucket_grads`
        (a stacked-experts parameter once, under its own name)."""
        for key, plan in self.plans.items():
            yield key, list(plan.param_names)

    def replica_mismatches(self) -> int:
        """How many of this rank's buckets hold parameters that differ from another
        replica's in the bucket's reduction group (and inside its instance, on the slow
        hop): bit-exact, collectives on every group; a debug check
        (``--edgc-check-replicas``)."""
        groups = [(pg, [p.bucket for p in self.plans.values()
                        if p.reduction.process_group is pg])
                  for pg, _ in self.planner.process_groups()]
        intra = {id(p.reduction.intra): p.reduction.intra for p in self.plans.values()
                 if p.reduction.slow_hop}
        groups += [(g, [p.bucket for p in self.plans.values() if p.reduction.intra is g])
                   for g in intra.values()]
        return replica_mismatches(groups)

    def state_bytes(self) -> int:
        """Error-feedback residuals and warm-start Q of this rank at the current rank."""
        return sum(p.compressor.state_bytes() for p in self.plans.values())

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"rank": self.rank, **self.fallback.state_dict(),
                "buckets": {k: p.compressor.state_dict() for k, p in self.plans.items()},
                "cost_model": self.planner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._prepared, self._decision = False, None   # a resume: prepare and decide again
        if state["rank"] != self.rank:
            self.set_rank(state["rank"])
        self.fallback.load_state_dict(state)
        if "cost_model" in state:   # the measured link and math: priced as before
            self.planner.load_state_dict(state["cost_model"])
        for key, plan in self.plans.items():
            if key not in state["buckets"]:
                logger.warning("no compressor state for %s in the checkpoint: starting fresh", key)
                continue
            bad = plan.compressor.load_state_dict(state["buckets"][key])
            if bad:
                logger.warning("compressor state of %s did not fit this model: reset", bad)

    # ------------------------------------------------------------------ the patch

    def _patch(self, group) -> None:
        original_start, original_finish = group.start_grad_sync, group.finish_grad_sync
        owner = self

        def original(fn, force_all_reduce):
            if owner._takes_force_all_reduce:
                return fn(force_all_reduce=force_all_reduce)
            return fn()

        def start_grad_sync(self, force_all_reduce: Optional[bool] = False):
            if is_first_batch(self) and self.grad_reduce_handle is not None:
                return  # already dispatched in the first batch (mirrors megatron-core)
            plans = owner._group_plans[id(self)]
            if owner.entropy_probe is not None:
                for plan in plans:
                    owner.entropy_probe(plan.key, plan.bucket.grad_data)
            if owner._megatron_syncs(plans, force_all_reduce):
                if owner.active and force_all_reduce:
                    for plan in plans:   # the dense message carries the whole error,
                        # in the unscaled units megatron-core's sync scales next
                        plan.compressor.absorb_residual(
                            plan.grads(), scale=1.0 / owner._scaling(self, plan))
                owner._count_dense(self, plans[0].reduction)
                return original(original_start, force_all_reduce)
            assert self.grad_reduce_handle is None, \
                "Should not have multiple communication calls outstanding at once"
            owner._start(self)

        def finish_grad_sync(self, force_all_reduce: Optional[bool] = False):
            if isinstance(self.grad_reduce_handle, _PendingSync) or not owner._megatron_syncs(
                    owner._group_plans[id(self)], force_all_reduce):
                self.param_gather_dispatched = False
                if not self.ddp_config.overlap_grad_reduce or is_first_batch(self):
                    start_grad_sync(self, force_all_reduce)
                assert self.grad_reduce_handle is not None, "grad sync was not started"
                self.grad_reduce_handle.wait()
                self.grad_reduce_handle = None
            else:
                original(original_finish, force_all_reduce)
            if owner.sync_end_hook is not None:
                owner.sync_end_hook()

        group.start_grad_sync = types.MethodType(start_grad_sync, group)
        group.finish_grad_sync = types.MethodType(finish_grad_sync, group)

    def _megatron_syncs(self, plans: list, force_all_reduce) -> bool:
        """Whether megatron-core's own sync runs: a group of one replica (nothing goes on
        a wire, compressing would only approximate), ``force_all_reduce`` (a dense
        all-reduce of the whole bucket, as asked), or compression off or not started
        (warm-up) where the dense wire is the buffers' dtype; a narrower dense wire
        (``--edgc-dense-wire bf16`` on fp32 buffers) is this patch's dense strategy."""
        single = plans[0].reduction.size == 1 and not self.compress_single_replica
        if single or force_all_reduce:
            return True
        if self.active:
            return False
        return all(p.compressor.dense_dtype == p.bucket.grad_data.dtype for p in plans)

    def _count_dense(self, group, reduction: Reduction) -> None:
        """The bytes megatron-core's own sync of ``group`` places into collectives (from
        its plans' reductions: no process-group query per step)."""
        pairs = [p.reduction.megatron_bytes(p.bucket) for p in self._group_plans[id(group)]]
        total, slow = sum(t for t, _ in pairs), sum(s for _, s in pairs)
        self.stats.collectives += sum(bool(t) + bool(s) for t, s in pairs)
        self.stats.add_bytes(total - slow, total - slow, reduction.expert)
        self.stats.add_bytes(slow, slow, reduction.expert, slow_hop=True)

    @staticmethod
    def _scaling(group, plan) -> float:
        """The factor megatron-core's sync applies to the bucket: its gradient scaling, and
        with ``average_in_collective`` the AVG over the group (and over the instance first,
        with the partial distributed optimizer), which this patch's SUM applies here."""
        extra = 1.0 / (plan.reduction.size * plan.reduction.intra_size) \
            if group.ddp_config.average_in_collective else 1.0
        return plan.bucket.gradient_scaling_factor * extra

    def _start(self, group) -> None:
        stats = self.stats
        stats.compressed |= self.active   # else the warm-up's dense sync on a narrow wire
        plans = self._group_plans[id(group)]
        reduction = plans[0].reduction
        stream = instances_stream(group, reduction)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        pipeline = BucketPipeline(stats, self._timed_links)
        with stream_context(stream):
            for plan in plans:
                # megatron-core's own part of the sync: not counted as compression time
                copy_extra_main_grads(plan.bucket, into_buffer=True)
                factor = self._scaling(group, plan)
                bypassed = self.active and plan.key in self.dense_keys
                dense = bypassed or not self.active
                in_cast = plan.scales_in_cast(dense)
                if factor != 1.0 and not in_cast:
                    plan.bucket.grad_data *= factor
                total, slow = plan.replaced_bytes
                stats.add_bytes(0, total - slow, reduction.expert)
                stats.add_bytes(0, slow, reduction.expert, slow_hop=True)
                stats.buckets += 1
                if bypassed:
                    stats.bypassed_buckets += 1
                    stats.fallback_buckets += plan.key in self.fallback_keys
                pipeline.start(plan.key, reduction.expert,
                               plan.strategy(dense, self.debug_dump, stats.events,
                                             scale=factor if in_cast else 1.0), dense)

        def finish():
            with stream_context(stream):
                pipeline.finish()
                for plan in plans:
                    copy_extra_main_grads(plan.bucket, into_buffer=False)
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)

        group.grad_reduce_handle = _PendingSync(finish)
