"""EDGC around one training step: the per-rank machinery both front-ends share.

This project's trainer (:mod:`megatron_edgc.training.loop`) and the Megatron-LM plug-in
(:mod:`megatron_edgc.megatron_lm`) build one :class:`EdgcRuntime` after the model, DDP and
optimizer exist, and call it around every step::

    runtime.begin_step(it)                      # ranks in force, bypass decisions, counters
    forward_backward(..., **runtime.schedule_kwargs())
    optimizer step, LR step
    record = runtime.end_step(it, record)       # the outcome settled; controller decides
    runtime.flush()                             # at --log-interval: records filled (job-wide)

Both front-ends call ``end_step`` through
:meth:`~megatron_edgc.runtime.frontend.IterationRecords.end`, before the iteration's end
stamp: the controller's work is inside the timed iteration.

It owns the DP compression, the PP communicator, the stage timer and the EDGC driver, and
registers their state for checkpoints. No step waits for the device: the device-side
records stay unread until :meth:`EdgcRuntime.flush` (one wait, one all-reduce), but on
the steps the controller reads (GDS's, and DAC's window ends), which flush at once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_edgc.compression.bypass import LinkModel
from megatron_edgc.compression.ef_dtype import choose_ef_dtype
from megatron_edgc.compression.matrices import FACTOR_DTYPES
from megatron_edgc.patches.ddp import DPGradientCompression
from megatron_edgc.patches.megatron_buckets import ddp_sync_bytes
from megatron_edgc.patches.dp_stats import DPSyncStats
from megatron_edgc.patches.p2p import CompressingP2PCommunicator, PPSendStats
from megatron_edgc.patches.timing import StageStamps, StageTimer
from megatron_edgc.runtime.rank_state import register_rank_state, unregister_rank_state
from megatron_edgc.runtime.driver import EdgcDriver
from megatron_edgc.runtime.telemetry import JobCounters, TelemetryRow

#: Checkpoint-registry entries of a runtime.
_STATE_NAMES = ("dp_compression", "pp_compression", "edgc")


class EdgcRuntime:
    """EDGC's compression, timing and controller state of one rank.

    ``cfg`` is a validated :class:`~megatron_edgc.config.RunConfig` (its ``edgc``,
    ``training.seed``, ``training.train_iters`` and ``parallel`` sections are read);
    ``chunks`` the DDP-wrapped model chunks, ``model_config`` their TransformerConfig;
    ``dp_group`` the group the DDP buckets reduce over; ``activation_shape`` the shape of a
    pipeline send ``(seq, micro-batch, hidden)``; ``lr_at(step)`` the run's LR at a step;
    ``optimizer`` the megatron-core optimizer (``--edgc-budget-weight adam`` reads its
    second moment).
    """

    def __init__(self, cfg, chunks, model_config, *, dp_group, pp_group, stage: int,
                 num_stages: int, num_microbatches: int, activation_shape: tuple,
                 device: torch.device, lr_at: Optional[Callable[[int], float]] = None,
                 optimizer=None,
                 log: Callable[[str], None] = lambda line: print(line, flush=True)):
        self.cfg, self.stage, self.num_stages, self.device = cfg, stage, num_stages, device
        self.activation_shape = activation_shape
        self.log = log
        e = cfg.edgc
        self.dp_rank = dist.get_rank(dp_group)
        self.iteration = 0
        self._pending: list = []   # _TakenStep of each step since the last flush
        self.dp_compression = self.edgc = self.p2p = None
        fsdp = cfg.parallel.use_megatron_fsdp
        if e.mode != "off" and fsdp:
            from megatron_edgc.patches.fsdp_outer import outer_compression

            self.dp_compression = outer_compression(
                cfg, chunks, *self._ef_dtype(e.ef_dtype, chunks, device), self.log)
            register_rank_state("dp_compression", self.dp_compression.state_dict,
                                self.dp_compression.load_state_dict)
        elif e.mode != "off":
            ef_dtype, ef_note = self._ef_dtype(e.ef_dtype, chunks, device)
            self.dp_compression = DPGradientCompression(
                chunks, dp_group, rank=e.rank, min_compression_rate=e.min_compression_rate,
                start_iter=e.start_iter, seed=cfg.training.seed, bypass=e.bypass,
                link=LinkModel.declared(e.link_gbps, (e.link_latency_ms or 0.0) / 1e3)
                if e.link_gbps else None,
                factor_dtype=FACTOR_DTYPES[e.factor_dtype], ef_dtype=ef_dtype,
                compress_single_replica=e.compress_single_replica,
                link_window=e.link_window, link_explore=e.link_explore,
                debug_dump=e.debug_dump, dense_wire=e.dense_wire,
                fallback_iters=e.fallback_iters)
            instances = cfg.parallel.num_distributed_optimizer_instances
            hop = "" if instances == 1 else (
                f"; compressing the slow hop only: each rank's shard across {instances} "
                f"distributed-optimizer instances, one factor per matrix per instance (the "
                f"reduce-scatter inside an instance stays dense)")
            grads = "/".join(sorted({str(b.grad_data.dtype).replace("torch.", "")
                                     .replace("bfloat16", "bf16").replace("float32", "fp32")
                                     for c in chunks for b in c.buffers}))
            self.log(f"EDGC: error-feedback state {self.dp_compression.state_bytes() / 2**20:.1f}"
                     f" MiB per rank at rank {e.rank} ({grads} gradients, {ef_note} "
                     f"residual, {e.factor_dtype} factors){hop}")
            register_rank_state("dp_compression", self.dp_compression.state_dict,
                                self.dp_compression.load_state_dict)
        # Stage timings (DAC, gradient-sync latency telemetry): stamps only, no numerics.
        self.timer = StageTimer(device.type == "cuda")
        self.timer.install()
        if self.dp_compression is not None:
            self.dp_compression.sync_end_hook = self.timer.mark_sync_end
        if e.pp_compression != "off":
            self.p2p = CompressingP2PCommunicator(
                pp_group, model_config, num_microbatches=num_microbatches,
                num_chunks=len(chunks), epilogue_only=e.pp_epilogue_only,
                seed=cfg.training.seed, timer=self.timer)
            register_rank_state("pp_compression", self.p2p.state_dict,
                                self.p2p.load_state_dict)
        if e.mode == "edgc":
            self.edgc = EdgcDriver(cfg, chunks, self.dp_compression, stage=stage,
                                   num_stages=num_stages, device=device, p2p=self.p2p,
                                   activation_shape=activation_shape, lr_at=lr_at,
                                   optimizer=optimizer)
            register_rank_state("edgc", self.edgc.state_dict, self.edgc.load_state_dict,
                                dp_invariant=True)
        # megatron-core's own sync: MoE's expert buckets, the slow hop and Megatron-FSDP's
        # reduction inside the instance (added to its outer-hop compression's counts) apart
        if fsdp:
            from megatron_edgc.patches.fsdp_outer import hsdp_sync_bytes

            sync = hsdp_sync_bytes(chunks, num_microbatches)
        else:
            sync = ddp_sync_bytes(chunks)
        self.dense_dp_bytes, self.dense_expert_bytes = sync.dp, sync.expert
        self.dense_slow_hop_bytes, self.fsdp_inner_bytes = sync.slow_hop, sync.fsdp_inner
        self.has_experts = sync.has_experts
        self.slow_hop = cfg.parallel.num_distributed_optimizer_instances > 1
        # the controller's entropy sums ride along (GDS's per-stage means need no
        # collective of their own)
        self.row = TelemetryRow(num_stages, self.edgc.entropy_sums().numel()
                                if self.edgc is not None else 0)
        self.tally = CompressionTally(num_stages)
        # fp16's loss scaler: the residuals follow its scale (docs/method.md)
        self.optimizer = optimizer
        self.has_loss_scaler = has_loss_scaler(optimizer)
        self._step_scale: Optional[torch.Tensor] = None
        #: how often the loss scale changed (a device count, read at the summary)
        self.loss_scale_changes: Optional[torch.Tensor] = None

    @staticmethod
    def _grad_dtypes(chunks) -> list:
        """The dtypes of the gradient buffers of ``chunks`` (DDP's, or Megatron-FSDP's)."""
        out = []
        for c in chunks:
            buffer = getattr(c, "param_and_grad_buffer", None)
            if buffer is not None and hasattr(buffer, "parameter_groups"):
                out += [g.main_grad_buffer.data.dtype for g in buffer.parameter_groups
                        if g.main_grad_buffer is not None]
            else:
                out += [b.grad_data.dtype for b in c.buffers]
        return out

    @staticmethod
    def _ef_dtype(setting: str, chunks, device: torch.device) -> tuple:
        """``(dtype, how the log names it)`` of the error-feedback residual: the flag's, or
        for ``auto`` measured here (:func:`~megatron_edgc.compression.ef_dtype.choose_ef_dtype`,
        the timings' MAX over the job, so every rank keeps the same)."""
        if setting != "auto":
            return FACTOR_DTYPES[setting], setting
        shapes = [tuple(p.shape) for c in chunks for p in c.module.parameters() if p.dim() == 2]
        grad_dtype = next(iter(EdgcRuntime._grad_dtypes(chunks)), torch.float32)

        def agree(times: torch.Tensor) -> torch.Tensor:
            times = times.to(device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            return times.cpu()

        dtype, fp32_ms, bf16_ms = choose_ef_dtype(shapes, grad_dtype, device, agree)
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        if not fp32_ms:
            return dtype, f"{name} (auto: on the host)"
        return dtype, (f"{name} (auto: bf16's round trip {bf16_ms:.2f} ms against fp32's "
                       f"{fp32_ms:.2f})")

    def close(self) -> None:
        """Drop this runtime's checkpoint-registry entries."""
        for name in _STATE_NAMES:
            unregister_rank_state(name)

    # ------------------------------------------------------------------ per step

    def timed_finalize(self, finalize_model_grads):
        """``finalize_model_grads`` stamped when the gradients are ready (the loop sets it as
        the model config's ``finalize_model_grads_func``)."""
        return self.timer.timed_finalize(finalize_model_grads)

    def begin_step(self, iteration: int) -> None:
        """Before the forward/backward of step ``iteration`` (0-based)."""
        self.iteration = iteration
        e = self.cfg.edgc
        # the scale this step's gradients carry: the residuals and GDS's sample are net of it
        self._step_scale = self.optimizer.get_loss_scale() if self.has_loss_scaler else None
        if self.p2p is not None:
            self.p2p.loss_scale = self._step_scale
        if self.dp_compression is not None:
            self.dp_compression.set_loss_scale(self._step_scale)
            self.dp_compression.set_iteration(iteration)
        if self.edgc is not None:
            self.edgc.loss_scale = self._step_scale
            self.edgc.before_step(iteration)
        if self.dp_compression is not None:
            if self.link_refits(iteration):
                self.flush()   # the link collectives of the window, read for the refit
            self.dp_compression.prepare_iteration()  # bypass decisions for this rank
        self.begin_schedule()
        if self.p2p is not None and e.pp_compression == "static":
            self.p2p.set_rank(e.pp_rank if iteration >= e.start_iter else None, 0)
        if self.p2p is not None:   # the senders' warm starts, outside backward
            self.p2p.prepare(self.activation_shape, self.device)

    def begin_schedule(self) -> None:
        """Restart the per-iteration counters (again if a step's schedule is re-run)."""
        if self.p2p is not None:
            self.p2p.begin_iteration()
        self.timer.begin_iteration()

    def schedule_kwargs(self) -> dict:
        """Extra arguments of megatron-core's ``forward_backward_func``: its injection
        point for the compressing PP communicator."""
        if self.p2p is None:
            return {}
        from megatron.core.process_groups_config import ProcessGroupCollection

        return dict(p2p_communicator=self.p2p,
                    pg_collection=ProcessGroupCollection.use_mpu_process_groups())

    def end_step(self, iteration: int, record: dict) -> dict:
        """After the optimizer step: takes the step's telemetry, unread, and lets the
        controller decide the next ranks; returns ``record``, whose job-wide telemetry
        :meth:`flush` adds. Flushes at once where the controller reads this step's
        telemetry (:meth:`controller_reads`)."""
        applied = not record.get("skipped")
        if self.dp_compression is not None:   # a skip loses nothing (docs/reliability.md)
            self.dp_compression.after_step(applied)
        if self.p2p is not None:              # ... nor moves the pipeline's senders
            self.p2p.after_step(applied)
        if self._step_scale is not None:
            record["loss_scale"] = self._step_scale
            changed = (self.optimizer.get_loss_scale() != self._step_scale).long().sum()
            self.loss_scale_changes = changed if self.loss_scale_changes is None \
                else self.loss_scale_changes + changed
        step = self._take(iteration, record)
        self._pending.append(step)
        now = self.controller_reads(iteration)
        if now:
            step.observed = True   # the driver reads this step's stage times itself
            self.flush()
        if self.edgc is not None:
            record.update(self.edgc.after_step(
                iteration, record if now else None,
                entropy_sums=step.entropy_job if now else None))
        return record

    def link_refits(self, iteration: int) -> bool:
        """Whether the bypass may refit its links and local work before step ``iteration``
        (a window boundary of ``--edgc-link-window``; a declared link is kept, the local
        work refitted): the steps before it are flushed first. The
        same answer on every rank of the job (the flush is a collective)."""
        e = self.cfg.edgc
        return e.bypass == "auto" and e.link_window > 0 and \
            iteration > 0 and iteration % e.link_window == 0

    def controller_reads(self, iteration: int) -> bool:
        """Whether the EDGC driver reads step ``iteration``'s job-wide telemetry on the host
        right after it: GDS's measured iterations (the entropies feed the controller) and,
        with DAC, window ends (the stage-time fits decide). DAC's other iterations only
        accumulate their times into the fits: :meth:`flush` adds them there."""
        d = self.edgc
        if d is None:
            return False
        return d.control.should_measure(iteration) or (d.dac and d.control.is_window_end(iteration))

    def rank_per_stage(self, stats) -> Optional[list]:
        """The DP-sync rank in force this iteration, one entry per pipeline stage."""
        if self.edgc is not None:
            return self.edgc.applied_ranks(self.iteration)
        if stats is None or not stats.compressed:
            return None
        return [self.dp_compression.rank] * self.num_stages

    def _take(self, iteration: int, record: dict) -> "_TakenStep":
        """The step's telemetry: its host figures now, its device records unread."""
        dp = self.dp_compression.stats.take() if self.dp_compression is not None else None
        pp = received = None
        if self.p2p is not None:
            pp, self.p2p.stats = self.p2p.stats, PPSendStats(stage=self.p2p.stats.stage)
            received = self.p2p.take_received()   # checked at the flush
        check = self.cfg.edgc.check_replicas and self.dp_compression is not None
        return _TakenStep(
            iteration=iteration, record=record, dp=dp, pp=pp, received=received,
            stamps=self.timer.take(), rank_dp=self.rank_per_stage(dp),
            rank_pp=self.p2p.rank if self.p2p is not None else None,
            # a debug check with collectives and a read of its own (--edgc-check-replicas)
            mismatches=self.dp_compression.replica_mismatches() if check else None,
            ef_bytes=self.dp_compression.state_bytes() if dp is not None else None,
            entropy=self.edgc.entropy_sums() if self.edgc is not None else None)

    def flush(self, wait: bool = True) -> None:
        """Read the device records of every step since the last flush and reduce their
        telemetry over the job: one device wait (``wait=False``: the caller has waited),
        one all-reduce, one read; fills each step's record. A collective: every rank calls
        it after the same iterations."""
        steps, self._pending = self._pending, []
        if not steps:
            return
        clock = self.timer.clock
        if wait:
            clock.wait()
        clock.anchor()   # the device is idle: wall times from here
        for step in steps:
            if step.pp is not None:
                self.p2p.check_messages(step.received)   # a disagreeing message: raise here
                step.pp.resolve()
        DPSyncStats.resolve_all([s.dp for s in steps if s.dp is not None], wait=False)
        if self.dp_compression is not None:
            dp = [s.dp for s in steps if s.dp is not None]
            self.dp_compression.observe_link(dp)
            self.dp_compression.observe_failures(dp, steps[-1].iteration + 1)
        rows = torch.stack([self._row(s) for s in steps]).to(self.device)
        dist.all_reduce(rows)
        for step, row in zip(steps, rows.tolist()):
            self._fill(step, row)
            if self.edgc is not None and self.edgc.dac and not step.observed:
                # DAC's fits take each iteration's stage times (the driver's after_step
                # had none to give them): in order, before the window end decides
                self.edgc.time_fits.observe(step.rank_dp, step.record)

    def _counters(self, step: "_TakenStep") -> JobCounters:
        """This rank's byte counters of ``step`` (megatron-core's own without compression)."""
        st, pps = step.dp, step.pp
        inner = self.fsdp_inner_bytes   # Megatron-FSDP's reduction inside the instance
        return JobCounters(
            dp_bytes_sent=st.bytes_sent + inner if st else self.dense_dp_bytes,
            dp_bytes_dense=st.bytes_dense + inner if st else self.dense_dp_bytes,
            pp_bytes_sent=pps.bytes_sent if pps else 0,
            pp_bytes_dense=pps.bytes_dense if pps else 0,
            dp_expert_bytes_sent=st.expert_bytes_sent if st else self.dense_expert_bytes,
            dp_expert_bytes_dense=st.expert_bytes_dense if st else self.dense_expert_bytes,
            dp_replica_mismatches=step.mismatches or 0,
            dp_slow_hop_bytes_sent=st.slow_hop_bytes_sent if st else self.dense_slow_hop_bytes,
            dp_slow_hop_bytes_dense=st.slow_hop_bytes_dense if st else
            self.dense_slow_hop_bytes,
            # every DP replica orthonormalizes the same sum: one rank's count per shard
            dp_factors_stood_in=st.factors_stood_in if st and self.dp_rank == 0 else 0)

    def _row(self, step: "_TakenStep") -> torch.Tensor:
        timing = step.stamps.resolve(self.timer.clock)
        st = step.dp
        times = dict(t_b_ms=timing.backward_ms, t_p2p_ms=timing.send_ms,
                     dp_sync_ms=timing.sync_ms, grad_sync_ms=timing.grad_sync_ms,
                     dp_sync_end_wall=timing.sync_end_wall,
                     dp_fallback_share=st.fallback_buckets / st.buckets
                     if st is not None and st.buckets else float("nan"),
                     dp_dense_share=st.bypassed_buckets / st.buckets
                     if st is not None and st.buckets else float("nan"),
                     dp_switch_share=(st.buckets if st.explored else len(st.switch_s))
                     / st.buckets if st is not None and st.buckets else float("nan"))
        return self.row.pack(self._counters(step), self.stage, times, step.entropy)

    def _fill(self, step: "_TakenStep", row: list) -> None:
        """DP-sync and pipeline telemetry of ``step`` into its record: this rank's bytes and
        times, the whole job's bytes (``row``, summed over the job), per-stage mean times."""
        local, (job, stage_times, entropy) = self._counters(step), self.row.unpack(row)
        step.entropy_job = entropy
        st, pps, rec, it = step.dp, step.pp, step.record, step.iteration + 1
        sent, dense = local.dp_bytes_sent, local.dp_bytes_dense
        rec.update(dp_bytes_sent=sent, dp_bytes_dense=dense,
                   dp_bytes_ratio=sent / dense if dense else 1.0,
                   dp_bytes_sent_job=job.dp_bytes_sent, dp_bytes_dense_job=job.dp_bytes_dense,
                   rank_dp=step.rank_dp)
        if self.slow_hop:  # the partial distributed optimizer: across instances
            rec.update(dp_slow_hop_bytes_sent=local.dp_slow_hop_bytes_sent,
                       dp_slow_hop_bytes_dense=local.dp_slow_hop_bytes_dense,
                       dp_slow_hop_bytes_sent_job=job.dp_slow_hop_bytes_sent,
                       dp_slow_hop_bytes_dense_job=job.dp_slow_hop_bytes_dense)
        if step.mismatches is not None:  # buckets (job-wide) whose replicas differ in a bit
            rec["dp_replica_mismatches"] = job.dp_replica_mismatches
        if self.has_experts:  # MoE: the expert buckets' share of the above
            rec.update(dp_expert_bytes_sent=local.dp_expert_bytes_sent,
                       dp_expert_bytes_dense=local.dp_expert_bytes_dense,
                       dp_expert_bytes_sent_job=job.dp_expert_bytes_sent,
                       dp_expert_bytes_dense_job=job.dp_expert_bytes_dense)
        if pps is not None:
            rec.update(pp_bytes_sent=pps.bytes_sent, pp_bytes_dense=pps.bytes_dense,
                       pp_bytes_sent_job=job.pp_bytes_sent,
                       pp_bytes_dense_job=job.pp_bytes_dense, rank_pp=step.rank_pp)
            for event in pps.events:
                self.log(f"iteration {it}: {event}")
        ends = [v for v in stage_times.pop("dp_sync_end_wall") if math.isfinite(v)]
        rec.update(stage_times)  # per-stage means, identical on every rank (DAC reads them)
        if step.rank_dp is not None:   # a stage whose every bucket was sent dense (the
            # fallback, or the bypass): dense, whatever rank is in force
            rec["rank_dp"] = [None if share >= 1 else r for r, share
                              in zip(step.rank_dp, rec["dp_dense_share"])]
        if st is not None:
            rec["dp_factors_stood_in"] = job.dp_factors_stood_in   # the job's, this step
        # a skipped step applied nothing: compressed or not, it is no compressed iteration
        self.tally.add(step.rank_dp, None if rec.get("skipped") else rec["rank_dp"],
                       job.dp_factors_stood_in, skipped=bool(rec.get("skipped")))
        if len(ends) > 1:
            rec["dp_sync_end_spread_ms"] = (max(ends) - min(ends)) * 1e3
        if st is not None:
            rec.update(dp_compress_ms=st.compress_s * 1e3, dp_comm_ms=st.comm_s * 1e3,
                       dp_ef_bytes=step.ef_bytes,
                       dp_nonfinite_buckets=st.nonfinite_buckets,
                       dp_switch_ms=sum(st.switch_s.values()) * 1e3,
                       dp_bypassed_buckets=st.bypassed_buckets,
                       dp_collectives=st.collectives,
                       dp_predicted_saving_ms=st.predicted_saving_s * 1e3,
                       dp_predicted_cost_ms=st.predicted_cost_s * 1e3)
            if math.isfinite(st.link_gbps):   # the bypass's link in force at this step
                # and its prices of both choices for every bucket it decided
                rec.update(dp_link_gbps=st.link_gbps, dp_link_alpha_ms=st.link_alpha_ms,
                           dp_predicted_dense_ms=st.predicted_dense_s * 1e3,
                           dp_predicted_compressed_ms=st.predicted_compressed_s * 1e3,
                           dp_bypass_explored=st.explored)
            if st.events and self.dp_rank == 0:
                for event in st.events:
                    self.log(f"iteration {it}: {event}")


def has_loss_scaler(optimizer) -> bool:
    """Whether megatron-core's ``optimizer`` scales the loss (fp16: a ``grad_scaler`` on it,
    or on a ``ChainedOptimizer``'s first, whose scale ``get_loss_scale`` returns)."""
    if optimizer is None:
        return False
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return getattr(inner[0], "grad_scaler", None) is not None


class CompressionTally:
    """How much of the job the DP sync compressed, for the end-of-run summary of both
    front-ends: per stage, the iterations with a rank in force (the controller's or the
    static one) and those that compressed (a rank in force, and not every bucket sent
    dense by the fallback), and the matrices whose basis stood in, job-wide."""

    def __init__(self, num_stages: int):
        self.iterations = 0
        self.skipped = 0
        self.with_rank = [0] * num_stages
        self.compressed = [0] * num_stages
        self.factors_stood_in = 0

    def add(self, ranks: Optional[list], compressed: Optional[list], stood_in: int,
            skipped: bool = False) -> None:
        self.iterations += 1
        self.skipped += skipped
        self.factors_stood_in += stood_in
        for i, (r, c) in enumerate(zip(ranks or [None] * len(self.with_rank),
                                       compressed or [None] * len(self.with_rank))):
            self.with_rank[i] += r is not None
            self.compressed[i] += c is not None

    def summary(self) -> dict:
        return {"iterations": self.iterations, "skipped": self.skipped,
                "dp_iterations_with_rank": self.with_rank,
                "dp_iterations_compressed": self.compressed,
                "dp_factors_stood_in": self.factors_stood_in}

    @staticmethod
    def line(summary: dict) -> str:
        """The summary's words, from :meth:`summary`'s dict: ``DP compressed 90/88 of 100
        iterations per stage (90/90 with a rank in force) | 0 factorizations stood in``.
        An iteration compressed: a rank in force, some bucket of the stage compressed (not
        every one sent dense by the bypass or the fallback), and the step applied."""
        per = "/".join(str(c) for c in summary["dp_iterations_compressed"])
        ranked = "/".join(str(c) for c in summary["dp_iterations_with_rank"])
        return (f"DP compressed {per} of {summary['iterations']} iterations per stage "
                f"({ranked} with a rank in force) | {summary['dp_factors_stood_in']} "
                f"factorizations stood in")


@dataclasses.dataclass
class _TakenStep:
    """One step's telemetry between :meth:`EdgcRuntime.end_step` and the flush."""

    iteration: int                         # 0-based
    record: dict                           # the front-end's record, filled at the flush
    dp: Optional[DPSyncStats]              # the DP sync's, unread
    pp: Optional[PPSendStats]              # the pipeline sends', unread
    received: Optional[list]               # the received pipeline headers, unread
    stamps: StageStamps                    # the stage timer's, unread
    rank_dp: Optional[list]                # ranks in force per stage
    rank_pp: Optional[int]
    mismatches: Optional[int]              # --edgc-check-replicas
    entropy: Optional[torch.Tensor]        # the driver's entropy sums (host)
    ef_bytes: Optional[int]                # error-feedback state at the rank in force
    entropy_job: Optional[torch.Tensor] = None   # ... summed over the job, at the flush
    observed: bool = False                 # the driver's after_step had its stage times
