"""Telemetry as data: one JSONL record per iteration, the same scalars in TensorBoard.

Plots and summaries are made from these records, never the reverse. The job-wide figures
of a record come from one all-reduce of a row per iteration (:class:`TelemetryRow`: the
:class:`JobCounters`, the per-stage :data:`STAGE_COLUMNS`, the controller's entropy sums),
done for all the iterations since the last one at ``--log-interval``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

import torch

#: Per-stage columns of the telemetry row (means over each stage's ranks): its times, the
#: share of its DP buckets the fallback sent dense (their factors had failed), the share
#: sent dense for any reason (the fallback or the bypass), and the share that left their
#: steady path (the bypass explored, or a bucket absorbed its residuals going dense).
STAGE_COLUMNS = ("t_b_ms", "t_p2p_ms", "dp_sync_ms", "grad_sync_ms", "dp_sync_end_wall",
                 "dp_fallback_share", "dp_dense_share", "dp_switch_share")


@dataclasses.dataclass
class JobCounters:
    """One iteration's byte counters of one rank; summed over the job by the telemetry
    all-reduce (the record's ``<name>_job``)."""

    dp_bytes_sent: int = 0            # placed into DP collectives
    dp_bytes_dense: int = 0           # what plain megatron-core would place
    pp_bytes_sent: int = 0            # backward pipeline sends
    pp_bytes_dense: int = 0
    dp_expert_bytes_sent: int = 0     # of the DP bytes, the expert buckets' (MoE)
    dp_expert_bytes_dense: int = 0
    dp_replica_mismatches: int = 0    # buckets whose replicas differ (--edgc-check-replicas)
    dp_slow_hop_bytes_sent: int = 0   # of the DP bytes, across distributed-optimizer instances
    dp_slow_hop_bytes_dense: int = 0
    dp_factors_stood_in: int = 0      # matrices whose basis stood in (DP rank 0's count)

    def values(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def from_values(cls, values) -> "JobCounters":
        return cls(*(int(v) for v in values))


class TelemetryRow:
    """One iteration's contribution of one rank to the job-wide all-reduce, a float64 row:
    ``[JobCounters | (Σ value, count) per stage of each STAGE_COLUMNS column | extra]``
    (``extra``: the controller's entropy sums, ``n_extra`` of them, summed as they are)."""

    def __init__(self, num_stages: int, n_extra: int = 0):
        self.num_stages, self.n_extra = num_stages, n_extra
        self.n_counters = len(dataclasses.fields(JobCounters))
        self.n_times = len(STAGE_COLUMNS) * 2 * num_stages
        self.width = self.n_counters + self.n_times + n_extra

    def pack(self, counters: JobCounters, stage: int, times: dict,
             extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The row of this rank (on the host): ``times`` maps STAGE_COLUMNS to this rank's
        values (NaN: none), counted for its ``stage``."""
        sums = torch.zeros(len(STAGE_COLUMNS), 2, self.num_stages, dtype=torch.float64)
        for i, key in enumerate(STAGE_COLUMNS):
            if math.isfinite(times[key]):
                sums[i, 0, stage], sums[i, 1, stage] = times[key], 1.0
        parts = [torch.tensor(counters.values(), dtype=torch.float64), sums.view(-1)]
        if self.n_extra:
            parts.append(extra.to(torch.float64).view(-1))
        return torch.cat(parts)

    def unpack(self, row: list):
        """``(JobCounters, {column: [per-stage mean, NaN where no rank had one]}, extra)`` of
        a row summed over the job (a list of floats; ``extra`` as a host tensor)."""
        counters = JobCounters.from_values(row[:self.n_counters])
        times = row[self.n_counters:self.n_counters + self.n_times]
        n = self.num_stages
        means = {}
        for i, key in enumerate(STAGE_COLUMNS):   # [column, (Σ, count), stage], flat
            at = 2 * i * n
            totals, counts = times[at:at + n], times[at + n:at + 2 * n]
            means[key] = [t / c if c > 0 else float("nan") for t, c in zip(totals, counts)]
        extra = torch.tensor(row[self.n_counters + self.n_times:], dtype=torch.float64)
        return counters, means, extra


class MetricsWriter:
    """Writes records on the logging rank; a no-op elsewhere."""

    def __init__(self, metrics_file: Optional[str], tensorboard_dir: Optional[str],
                 enabled: bool, resume_from: int = 0, *, tb_writer=None, tb_prefix: str = ""):
        """``resume_from`` > 0: continue an earlier run's file after that iteration; its
        records beyond it (a crashed attempt's) are dropped, so every iteration appears
        once. ``tb_writer``: an open TensorBoard writer to add to (Megatron-LM's), its tags
        prefixed with ``tb_prefix``; it is left open."""
        self.enabled = enabled
        self._fh = None
        self._tb = tb_writer
        self._tb_owned = tb_writer is None
        self._prefix = tb_prefix
        if not enabled:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            kept = []
            if resume_from > 0 and os.path.exists(metrics_file):
                with open(metrics_file) as fh:
                    for line in fh:
                        try:
                            if json.loads(line)["iteration"] <= resume_from:
                                kept.append(line if line.endswith("\n") else line + "\n")
                        except (ValueError, KeyError, TypeError):
                            continue  # a torn last line of a killed writer
            tmp = metrics_file + ".tmp"
            with open(tmp, "w") as fh:
                fh.writelines(kept)
            os.replace(tmp, metrics_file)
            self._fh = open(metrics_file, "a", buffering=1)
        if tensorboard_dir and tb_writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._fh is not None:
            self._fh.write(json.dumps(record, default=_jsonable) + "\n")
        if self._tb is not None:
            step = record["iteration"]
            for key, value in record.items():
                if key == "iteration":
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value):
                    self._tb.add_scalar(self._prefix + key, value, step)
                elif isinstance(value, (list, tuple)):
                    for i, v in enumerate(value):
                        if isinstance(v, (int, float)) and math.isfinite(v):
                            self._tb.add_scalar(f"{self._prefix}{key}/stage{i}", v, step)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.flush()
            if self._tb_owned:
                self._tb.close()
            self._tb = None


def _jsonable(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def expert_split(rec: dict) -> str:
    """The DP bytes of a MoE job split into dense and expert buckets (job-wide)."""
    expert = rec["dp_expert_bytes_sent_job"]
    dense = rec["dp_bytes_sent_job"] - expert
    return f"dense {dense / 2**20:.2f} + expert {expert / 2**20:.2f} MiB"


def slow_hop(rec: dict) -> str:
    """The bytes across distributed-optimizer instances (job-wide) and their saving."""
    sent, dense = rec["dp_slow_hop_bytes_sent_job"], rec["dp_slow_hop_bytes_dense_job"]
    saved = 1.0 - sent / dense if dense else 0.0
    return f"slow hop {sent / 2**20:.2f} MiB (saved {100 * saved:.1f}%)"


def format_progress(it: int, total: int, rec: dict) -> str:
    parts = [f"iteration {it:>6d}/{total}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.3e}",
             f"{rec['iter_ms']:8.1f} ms/iter", f"{rec['tokens_per_s']:9.0f} tok/s",
             f"grad norm {rec['grad_norm']:.3f}"]
    if rec.get("rank_dp") is not None:
        parts.append(f"ranks {format_ranks(rec)}")
    if rec.get("entropy") is not None:
        parts.append("H " + "/".join(f"{h:.3f}" for h in rec["entropy"]))
    if "dp_bytes_sent_job" in rec:
        saved = 1.0 - rec["dp_bytes_sent_job"] / max(1, rec["dp_bytes_dense_job"])
        parts.append(f"dp {rec['dp_bytes_sent_job'] / 2**20:.2f} MiB (saved {100 * saved:.1f}%)")
        if "dp_expert_bytes_sent_job" in rec:
            parts.append(expert_split(rec))
        if "dp_slow_hop_bytes_sent_job" in rec:
            parts.append(slow_hop(rec))
    if "dp_link_gbps" in rec:
        parts.append(link_line(rec))
    if "pp_bytes_sent_job" in rec:
        saved = 1.0 - rec["pp_bytes_sent_job"] / max(1, rec["pp_bytes_dense_job"])
        rank = rec.get("rank_pp")
        parts.append(f"pp {'dense' if rank is None else 'r' + str(rank)} "
                     f"{rec['pp_bytes_sent_job'] / 2**20:.2f} MiB (saved {100 * saved:.1f}%)")
    if rec.get("dp_sync_end_spread_ms") is not None:
        parts.append(f"sync spread {rec['dp_sync_end_spread_ms']:.1f} ms")
    if rec.get("loss_scale") is not None:   # fp16's dynamic loss scale
        parts.append(f"loss scale {rec['loss_scale']:g}")
    if rec.get("skipped_so_far"):   # steps not applied: an fp16 overflow, a non-finite norm
        parts.append(f"skipped {rec['skipped_so_far']}" +
                     (" (this one)" if rec.get("skipped") else ""))
    return " | ".join(parts)


def format_ranks(rec: dict) -> str:
    """The DP ranks in force per stage: ``64/dense`` (dense: the warm-up, or every bucket
    of the stage sent dense by the fallback), ``64 (50% dense)`` where the fallback sends
    part of a stage's buckets dense."""
    ranks = rec.get("rank_dp")
    if ranks is None:
        return "dense"
    shares = rec.get("dp_fallback_share") or [0.0] * len(ranks)
    return "/".join("dense" if r is None else
                    f"{r} ({100 * f:.0f}% dense)" if f and math.isfinite(f) else str(r)
                    for r, f in zip(ranks, shares))


def link_line(rec: dict) -> str:
    """The bypass's link in force and how many buckets it sends dense."""
    return f"link {rec['dp_link_gbps']:.3g} Gbit/s, {rec.get('dp_bypassed_buckets', 0)} dense"
