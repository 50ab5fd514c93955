"""EDGC around one training step: the per-rank machinery both front-ends share.

This project's trainer (:mod:`megatron_edgc.training.loop`) and the Megatron-LM plug-in
(:mod:`megatron_edgc.megatron_lm`) build one :class:`EdgcRuntime` after the model, DDP and
optimizer exist, and call it around every step:

    runtime.begin_step(it)                      # ranks in force, bypass decisions, counters
    forward_backward(..., **runtime.schedule_kwargs())
    optimizer step, LR step
    record = runtime.end_step(it, record)       # telemetry all-reduce; controller decides

so the two loops compress, measure and decide identically. It owns the DP compression
(``patches/ddp.py``), the PP communicator (``patches/p2p.py``), the stage timer and the
EDGC driver (``runtime/driver.py``), reduces the step's telemetry over the job, and
registers their state with the checkpoint registry (``runtime/rank_state.py``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_edgc.compression.bypass import LinkModel
from megatron_edgc.compression.powersgd import FACTOR_DTYPES
from megatron_edgc.patches.ddp import DPGradientCompression, megatron_sync_bytes
from megatron_edgc.patches.p2p import CompressingP2PCommunicator
from megatron_edgc.patches.timing import StageTimer
from megatron_edgc.runtime.rank_state import register_rank_state, unregister_rank_state
from megatron_edgc.runtime.driver import EdgcDriver

#: Per-stage timing columns of the per-iteration all-reduce.
STAGE_TIMES = ("t_b_ms", "t_p2p_ms", "dp_sync_ms", "grad_sync_ms", "dp_sync_end_wall")

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
        self.log = log
        e = cfg.edgc
        self.dp_rank = dist.get_rank(dp_group)
        self.iteration = 0
        self._entropy_sums: Optional[torch.Tensor] = None  # the last telemetry all-reduce's
        self.dp_compression = self.edgc = self.p2p = None
        if e.mode != "off":
            self.dp_compression = DPGradientCompression(
                chunks, dp_group, rank=e.rank, min_compression_rate=e.min_compression_rate,
                start_iter=e.start_iter, seed=cfg.training.seed, bypass=e.bypass,
                link=LinkModel.declared(e.link_gbps) if e.link_gbps else None,
                factor_dtype=FACTOR_DTYPES[e.factor_dtype], ef_dtype=FACTOR_DTYPES[e.ef_dtype],
                compress_single_replica=e.compress_single_replica)
            instances = cfg.parallel.num_distributed_optimizer_instances
            hop = "" if instances == 1 else (
                f"; compressing the slow hop only: each rank's shard across {instances} "
                f"distributed-optimizer instances, one factor per matrix per instance (the "
                f"reduce-scatter inside an instance stays dense)")
            grads = "/".join(sorted({str(b.grad_data.dtype).replace("torch.", "")
                                     .replace("bfloat16", "bf16").replace("float32", "fp32")
                                     for c in chunks for b in c.buffers}))
            self.log(f"EDGC: error-feedback state {self.dp_compression.state_bytes() / 2**20:.1f}"
                     f" MiB per rank at rank {e.rank} ({grads} gradients, {e.ef_dtype} "
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
        # megatron-core's own sync: MoE's expert buckets and the slow hop apart
        dense = [megatron_sync_bytes(g) for c in chunks for g in c.bucket_groups]
        expert = [megatron_sync_bytes(g) for c in chunks
                  for g in c.expert_parallel_bucket_groups]
        self.dense_expert_bytes = sum(total for total, _ in expert)
        self.dense_dp_bytes = self.dense_expert_bytes + sum(total for total, _ in dense)
        self.dense_slow_hop_bytes = sum(slow for _, slow in dense + expert)
        self.has_experts = any(c.expert_parallel_bucket_groups for c in chunks)
        self.slow_hop = cfg.parallel.num_distributed_optimizer_instances > 1

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
        if self.dp_compression is not None:
            self.dp_compression.set_iteration(iteration)
        if self.edgc is not None:
            self.edgc.before_step(iteration)
        if self.dp_compression is not None:
            self.dp_compression.prepare_iteration()  # bypass decisions for this rank
        self.begin_schedule()
        if self.p2p is not None and e.pp_compression == "static":
            self.p2p.set_rank(e.pp_rank if iteration >= e.start_iter else None, 0)

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
        """After the optimizer step: adds the telemetry record (one job-wide all-reduce) and
        lets the controller decide the next ranks; returns ``record``.

        The step's device-side records (CUDA event times, non-finite flags, pipeline
        message headers) are read here, once, after the step's work."""
        if self.p2p is not None:
            self.p2p.check_messages()   # a disagreeing pipeline message: raise here
            self.p2p.stats.resolve()
        if self.dp_compression is not None:
            self.dp_compression.stats.resolve()
        record.update(self._dp_sync_record())
        if self.edgc is not None:
            record.update(self.edgc.after_step(iteration, record,
                                               entropy_sums=self._entropy_sums))
        return record

    def rank_per_stage(self, stats) -> Optional[list]:
        """The DP-sync rank in force this iteration, one entry per pipeline stage."""
        if self.edgc is not None:
            return self.edgc.applied_ranks(self.iteration)
        if stats is None or not stats.compressed:
            return None
        return [self.dp_compression.rank] * self.num_stages

    def _dp_sync_record(self) -> dict:
        """DP-sync and pipeline telemetry: this rank's bytes and times, the whole job's
        bytes, and per-stage mean timings — one all-reduce over the job."""
        st = self.dp_compression.stats if self.dp_compression is not None else None
        sent = st.bytes_sent if st else self.dense_dp_bytes
        dense = st.bytes_dense if st else self.dense_dp_bytes
        expert_sent = st.expert_bytes_sent if st else self.dense_expert_bytes
        expert_dense = st.expert_bytes_dense if st else self.dense_expert_bytes
        pps = self.p2p.stats if self.p2p is not None else None
        n_stages = self.num_stages
        check = self.cfg.edgc.check_replicas and self.dp_compression is not None
        mismatches = self.dp_compression.replica_mismatches() if check else 0
        slow_sent = st.slow_hop_bytes_sent if st else self.dense_slow_hop_bytes
        slow_dense = st.slow_hop_bytes_dense if st else self.dense_slow_hop_bytes
        head = [sent, dense, pps.bytes_sent if pps else 0, pps.bytes_dense if pps else 0,
                expert_sent, expert_dense, mismatches, slow_sent, slow_dense]
        times = torch.zeros(len(STAGE_TIMES), 2, n_stages, dtype=torch.float64)
        timing = self.timer.finish()
        values = (timing.backward_ms, timing.send_ms, timing.sync_ms, timing.grad_sync_ms,
                  timing.sync_end_wall)
        for i, v in enumerate(values):
            if math.isfinite(v):
                times[i, 0, self.stage], times[i, 1, self.stage] = v, 1.0
        # the sampled entropies ride along (GDS's per-stage means need no collective of
        # their own)
        entropy = self.edgc.entropy_sums() if self.edgc is not None else \
            torch.zeros(0, dtype=torch.float64)
        totals = torch.cat([torch.tensor(head, dtype=torch.float64), times.view(-1), entropy])
        totals = totals.to(self.device)
        dist.all_reduce(totals)
        totals = totals.cpu()
        self._entropy_sums = totals[totals.numel() - entropy.numel():]
        rec = {"dp_bytes_sent": sent, "dp_bytes_dense": dense,
               "dp_bytes_ratio": sent / dense if dense else 1.0,
               "dp_bytes_sent_job": int(totals[0].item()),
               "dp_bytes_dense_job": int(totals[1].item()),
               "rank_dp": self.rank_per_stage(st)}
        if self.slow_hop:  # the partial distributed optimizer: across instances
            rec.update(dp_slow_hop_bytes_sent=slow_sent, dp_slow_hop_bytes_dense=slow_dense,
                       dp_slow_hop_bytes_sent_job=int(totals[7].item()),
                       dp_slow_hop_bytes_dense_job=int(totals[8].item()))
        if check:  # buckets (job-wide) whose replicas differ in a bit
            rec["dp_replica_mismatches"] = int(totals[6].item())
        if self.has_experts:  # MoE: the expert buckets' share of the above
            rec.update(dp_expert_bytes_sent=expert_sent, dp_expert_bytes_dense=expert_dense,
                       dp_expert_bytes_sent_job=int(totals[4].item()),
                       dp_expert_bytes_dense_job=int(totals[5].item()))
        if pps is not None:
            rec.update(pp_bytes_sent=pps.bytes_sent, pp_bytes_dense=pps.bytes_dense,
                       pp_bytes_sent_job=int(totals[2].item()),
                       pp_bytes_dense_job=int(totals[3].item()), rank_pp=self.p2p.rank)
            for event in pps.events:
                self.log(f"iteration {self.iteration + 1}: {event}")
        sums = totals[len(head):len(head) + times.numel()].view(len(STAGE_TIMES), 2, n_stages)
        stage_times = {key: [(sums[i, 0, s] / sums[i, 1, s]).item() if sums[i, 1, s] > 0
                             else float("nan") for s in range(n_stages)]
                       for i, key in enumerate(STAGE_TIMES)}
        ends = [v for v in stage_times.pop("dp_sync_end_wall") if math.isfinite(v)]
        rec.update(stage_times)  # per-stage means, identical on every rank (DAC reads them)
        if len(ends) > 1:
            rec["dp_sync_end_spread_ms"] = (max(ends) - min(ends)) * 1e3
        if st is not None:
            rec.update(dp_compress_ms=st.compress_s * 1e3, dp_comm_ms=st.comm_s * 1e3,
                       dp_ef_bytes=self.dp_compression.state_bytes(),
                       dp_nonfinite_buckets=st.nonfinite_buckets,
                       dp_bypassed_buckets=st.bypassed_buckets,
                       dp_predicted_saving_ms=st.predicted_saving_s * 1e3,
                       dp_predicted_cost_ms=st.predicted_cost_s * 1e3)
            if self.dp_compression.link is not None:
                rec["dp_link_gbps"] = self.dp_compression.link.gbit_per_s
            if st.events and self.dp_rank == 0:
                for event in st.events:
                    self.log(f"iteration {self.iteration + 1}: {event}")
        return rec
