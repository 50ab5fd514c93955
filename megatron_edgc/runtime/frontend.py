"""What both front-ends do around the runtime: this project's trainer
(:mod:`megatron_edgc.training.loop`) and the Megatron-LM plug-in
(:mod:`megatron_edgc.megatron_lm`) take the device, the logging rank, the LR at a step, the
start-up notes and the per-iteration record from here, so that they match.

The record (one JSONL line, the same scalars in TensorBoard) is :class:`IterationRecords`'s:
every iteration is stamped on the device clock and its device values (the loss, the
runtime's telemetry) stay unread until :meth:`IterationRecords.flush` reads all the pending
ones at once, at ``--log-interval`` (nanoGPT reads its loss only when it prints).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron_edgc.patches.nonfinite_step import NonFiniteStepGuard, install_nonfinite_guard
from megatron_edgc.patches.timing import IntervalClock


def compute_device() -> torch.device:
    """This process's device: its current CUDA device (the front-end set it), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_logging_rank() -> bool:
    """Whether this rank writes the records: the last pipeline stage's first DP and TP rank,
    which holds the loss (the records are job-wide after the telemetry all-reduce)."""
    from megatron.core import parallel_state

    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def log_rank0(*args) -> None:
    """Print on the job's first rank (everywhere before a process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def print_notes(cfg) -> None:
    """The start-up summary of what compresses (``cfg.compression_notes``), on rank 0."""
    for note in getattr(cfg, "compression_notes", None) or []:
        log_rank0(note)


def guard_optimizer(optimizer, iteration) -> NonFiniteStepGuard:
    """The non-finite step guard on ``optimizer`` (:mod:`megatron_edgc.patches.nonfinite_step`):
    a step whose reduced gradient is not finite is skipped and counted, whatever the
    precision and ``--edgc-mode`` (off too); rank 0 names each. ``iteration()``: the 1-based
    number of the iteration being stepped."""
    return install_nonfinite_guard(optimizer, iteration, log_rank0)


class NonFiniteWeights(RuntimeError):
    """The weights are not finite at the end of training or at a save (every rank raises
    it: the finding is all-reduced)."""


def local_weights(chunks) -> list:
    """The weights this rank holds, as plain tensors: each chunk's parameters, or under
    Megatron-FSDP the local pieces of its optimizer's main weights (the module's own
    parameters are views of all-gather buckets freed between steps)."""
    out = []
    for chunk in chunks:
        buffer = getattr(chunk, "param_and_grad_buffer", None)
        if buffer is not None and hasattr(buffer, "optimizer_named_parameters"):
            out += [p.detach().to_local() if hasattr(p, "to_local") else p.detach()
                    for _, p in buffer.optimizer_named_parameters]
        else:
            out += [p.detach() for p in chunk.parameters()]
    return out


def check_weights_finite(chunks, when: str, params=None) -> None:
    """Raise :class:`NonFiniteWeights` on every rank if any rank holds a non-finite
    parameter (of ``chunks``, :func:`local_weights`, or the tensors ``params`` where
    given). A collective over the job, with one read: at the end of training and before a
    checkpoint, never per step."""
    if params is None:
        params = local_weights(chunks)
    device = params[0].device if params else compute_device()
    bad = torch.zeros(2, dtype=torch.float64, device=device)   # [any non-finite, its rank]
    for p in params:
        bad[0] += (~torch.isfinite(p)).any().to(torch.float64)
    if dist.is_initialized():
        mine = bad[0] > 0
        bad[1] = torch.where(mine, -float(dist.get_rank()), -float("inf"))
        bad[0] = mine.to(torch.float64)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    found, rank = bad.tolist()
    if found > 0:
        where = f" (first on rank {int(-rank)})" if dist.is_initialized() else ""
        raise NonFiniteWeights(f"non-finite weights {when}{where}: the run's result is not "
                               f"usable")


def lr_at(scheduler, step: int, *, samples_per_step: int = 1,
          param_group: Optional[dict] = None) -> float:
    """The LR megatron-core's ``OptimizerParamScheduler`` gives at iteration ``step`` (its own
    formula, read-only). ``samples_per_step``: what the scheduler counts per iteration (1
    for this project's trainer; Megatron-LM counts samples: the global batch size);
    ``param_group``: the group whose LR overrides apply (none: the scheduler's own)."""
    now = scheduler.num_steps
    try:
        scheduler.num_steps = step * samples_per_step
        return float(scheduler.get_lr(param_group if param_group is not None else {}))
    finally:
        scheduler.num_steps = now


class IterationRecords:
    """The per-iteration records of one rank, the same in both front-ends: ``iteration``,
    ``loss``, ``lr``, ``iter_ms``, ``tokens``, ``tokens_per_s``, ``grad_norm``, ``skipped``,
    the runtime's telemetry and the front-end's ``val_loss`` (``val_ppl`` follows).
    :meth:`begin` and :meth:`end` stamp an iteration on the device clock (``iter_ms``: its
    first work to the runtime's ``end_step`` after its optimizer step, so the controller's
    work is priced in the iteration it follows); values stay device tensors until :meth:`flush`
    reads every pending record at once (one wait, the runtime's collective) and writes
    them to ``writers``.
    """

    def __init__(self, writers: list, runtime=None, *, use_cuda: bool = False):
        self.writers, self.runtime = list(writers), runtime
        self.clock = IntervalClock(use_cuda)
        self._start = None
        self._pending: list = []   # (record, start stamp, end stamp)
        self.skipped = 0           # steps the optimizer did not apply, so far

    def begin(self) -> None:
        """At the start of an iteration's work."""
        self._start = self.clock.stamp()

    def end(self, iteration: int, *, loss, lr: float, grad_norm, skipped: bool,
            tokens: int) -> dict:
        """After the optimizer step: the record of iteration ``iteration`` (1-based), its
        loss and grad norm as floats or 0-dim tensors (read at :meth:`flush`). The
        runtime's :meth:`~megatron_edgc.runtime.step.EdgcRuntime.end_step` (the outcome
        settled, the controller's decision) runs here, before the iteration's end stamp:
        what EDGC does after the step is part of the iteration's time, as the static
        mode's is."""
        record = {"iteration": iteration, "loss": loss, "lr": lr, "iter_ms": None,
                  "tokens": tokens, "tokens_per_s": None,
                  "grad_norm": float("nan") if grad_norm is None else grad_norm,
                  "skipped": skipped, "skipped_so_far": self.skipped + bool(skipped)}
        self.skipped += bool(skipped)
        if self.runtime is not None:
            self.runtime.end_step(iteration - 1, record)
        self._pending.append((record, self._start, self.clock.stamp()))
        return record

    def flush(self) -> list:
        """Read, complete and write the pending records; returns them (oldest first)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        self.clock.wait()
        if self.runtime is not None:
            self.runtime.flush(wait=False)
        records = [record for record, _, _ in pending]
        _read_device_values(records)
        for record, start, end in pending:
            ms = self.clock.ms_between(start, end)
            record["iter_ms"] = ms
            record["tokens_per_s"] = record["tokens"] / (ms / 1e3)
            if "val_loss" in record:
                record["val_ppl"] = math.exp(min(record["val_loss"], 50.0))
            for writer in self.writers:
                writer.write(record)
        return records

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def _read_device_values(records: list) -> None:
    """Replace every tensor value of ``records`` by its float: one read for all of them."""
    slots = [(r, key) for r in records for key, v in r.items() if isinstance(v, torch.Tensor)]
    if not slots:
        return
    device = slots[0][0][slots[0][1]].device
    values = torch.stack([r[key].detach().reshape(()).to(device, torch.float64)
                          for r, key in slots]).tolist()
    for (r, key), value in zip(slots, values):
        r[key] = value
