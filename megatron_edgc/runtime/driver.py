"""The EDGC driver: sampled entropy → controllers → DP ranks per stage (with DAC) and
the pipeline rank, the same table on every rank of the job.

Every iteration :class:`~megatron_edgc.runtime.step.EdgcRuntime` calls
:meth:`EdgcDriver.before_step` and :meth:`EdgcDriver.after_step`. On the iterations GDS
measures, each rank samples a ``β`` fraction of its local gradient elements
(``entropy_probe`` of the DP patch, before the sync), estimates the entropy, and the
runtime's per-iteration telemetry all-reduce carries the estimates (no collective of
their own) to average them per pipeline stage (over its DP and TP ranks). Every rank
therefore feeds the same per-stage entropies to its own :class:`RankController` and holds
the same rank table (``--edgc-check-table`` verifies that with a hash at each window
end). The entry of this rank's stage is handed to the DP compression; ``None`` (warm-up)
means dense.

With ``--edgc-pp-compression edgc`` a second controller (one entry, its own bounds) is fed
the entropy of the outgoing backward activation gradients (sampled on the same
iterations, averaged over every sending rank) and sets the pipeline rank (EDGC §7).

With DAC (EDGC §6, PP > 1) the DP rank of each stage is the CQM rank raised by the
stage's slack (:mod:`megatron_edgc.runtime.dac`); the table is still broadcast from the
first rank (one small broadcast per window) and is what both ends of every pipeline
message and every DP collective use. The budget controller's inputs are in
:mod:`megatron_edgc.runtime.budget`, the calibrated ``g`` and the entropy study's
statistics in :mod:`megatron_edgc.runtime.gradient_stats`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_edgc.compression.powersgd import matrix_shape
from megatron_edgc.control.controller import ControllerSettings, RankController
from megatron_edgc.control.entropy import (LAYER_TYPES, GradientSampler, estimate_entropy,
                                           layer_type, power_sums)
from megatron_edgc.control.rank_allocation import BudgetRankController
from megatron_edgc.control.rank_model import RankModel
from megatron_edgc.runtime.dac import StageTimeFits, probe_rank
from megatron_edgc.runtime.budget import BudgetFeed
from megatron_edgc.runtime.gradient_stats import (calibrated_rank_models, dominant_shape,
                                                  grad_stats)


class RankTableMismatch(RuntimeError):
    pass


def _broadcast_ints(values: list, device) -> list:
    """The first rank's list of small ints (None as -1), on every rank of the job."""
    t = torch.tensor([-1 if v is None else int(v) for v in values], dtype=torch.int64,
                     device=device)
    dist.broadcast(t, src=0)
    return [None if v < 0 else v for v in t.tolist()]


class EdgcDriver:
    """EDGC's controller state on one rank: what it measures, what it decided, and the
    DP and PP ranks it installs (``dp_compression``: the DP patch; ``p2p``: the PP
    communicator or None; ``lr_at`` and ``optimizer``: the budget controller's)."""

    def __init__(self, cfg, chunks, dp_compression, *, stage: int, num_stages: int,
                 device: torch.device, p2p=None, activation_shape=None, lr_at=None,
                 optimizer=None):
        e = cfg.edgc
        self.cfg, self.dp_compression, self.p2p = cfg, dp_compression, p2p
        self.stage, self.num_stages, self.device = stage, num_stages, device
        self.samplers = {
            key: GradientSampler(grad.numel(), iter_sample_rate=e.iter_sample_rate,
                                 grad_sample_rate=e.grad_sample_rate,
                                 seed=cfg.training.seed * 7919 + i, estimator=e.entropy)
            for i, (key, grad) in enumerate(dp_compression.bucket_grads())}
        # Every rank builds the rank models of every stage: share the dominant shapes.
        shapes = torch.zeros(num_stages, 2, dtype=torch.float64, device=device)
        shapes[stage] = torch.tensor(dominant_shape(chunks), dtype=torch.float64)
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX)
        self.stage_shapes = [tuple(int(v) for v in row) for row in shapes.tolist()]
        self.settings = ControllerSettings(
            window=e.window, iter_sample_rate=e.iter_sample_rate, rank_max=e.rank_max,
            rank_min=e.rank_min, rank_step=e.rank_step, warmup_eps=e.warmup_eps,
            warmup_windows=e.warmup_windows, warmup_max_iters=e.warmup_max_iters)
        self.budget = e.controller == "budget"
        if self.budget:  # per-shape ranks from a byte budget (control/rank_allocation.py)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (stage, sorted(dp_compression.shape_counts().items())))
            stage_groups = [None] * num_stages
            for s, items in gathered:
                if stage_groups[s] is None:
                    stage_groups[s] = [(n, m, c) for (n, m), c in items]
            self.controller = BudgetRankController(
                self.settings, stage_groups, byte_budget=e.byte_budget,
                min_compression_rate=e.min_compression_rate,
                max_step=e.rank_step if e.budget_step_limit == "on" else None)
            dp_compression.track_spectrum(True)
        else:
            self.controller = RankController(self.settings,
                                              [RankModel(n, m) for n, m in self.stage_shapes])
        # --edgc-budget-weight adam: the optimizer whose second moment weighs the errors
        if self.budget and e.budget_weight == "adam" and optimizer is None:
            raise ValueError("--edgc-budget-weight adam needs the optimizer")
        self.budget_feed = BudgetFeed(
            self.controller, dp_compression,
            optimizer=optimizer if e.budget_weight == "adam" else None, lr_at=lr_at,
            schedule=e.budget_schedule, train_iters=cfg.training.train_iters,
            window=e.window, rank_max=e.rank_max, stage=stage, num_stages=num_stages,
            device=device) if self.budget else None
        # For --edgc-g calibrated: this rank's gradient of one dominant-shape matrix.
        self._calib_param = next(
            (p for c in chunks for p in c.module.parameters()
             if matrix_shape(p.shape) == self.stage_shapes[stage]), None)
        self._calib_bucket = None
        if e.g == "calibrated" and self._calib_param is not None:
            ptr = self._calib_param.main_grad.data_ptr()
            self._calib_bucket = next(
                key for key, grad in dp_compression.bucket_grads()
                if grad.data_ptr() <= ptr < grad.data_ptr() + grad.numel() * grad.element_size())
        # --edgc-grad-stats (the entropy study): each bucket's parameters by layer type.
        self._typed_grads = None
        if e.grad_stats:
            self._typed_grads = {
                key: [(LAYER_TYPES.index(layer_type(name)), p) for name, p in params]
                for key, params in dp_compression.bucket_params()}
        self._type_sums = torch.zeros(len(LAYER_TYPES), 3, dtype=torch.float64, device=device)
        self._calib_grad: Optional[torch.Tensor] = None
        self.calibrated_g: Optional[list] = None
        self._full_entropies: list = []
        self._samples: list = []
        self._measuring = False
        self._window = 0
        self.entropy_ms = 0.0
        self.last_entropies: Optional[list] = None
        dp_compression.set_rank(None)  # dense until the warm-up ends
        dp_compression.entropy_probe = self._probe
        # PP rank controller (EDGC §7): one rank for every backward send.
        self.pp_controller = self.pp_sampler = None
        self._pp_sample: Optional[torch.Tensor] = None
        if p2p is not None and e.pp_compression == "edgc":
            n, m = math.prod(activation_shape[:-1]), activation_shape[-1]
            self.pp_controller = RankController(
                dataclasses.replace(self.settings, rank_max=e.pp_rank_max,
                                    rank_min=e.pp_rank_min), [RankModel(n, m)])
            self.pp_sampler = GradientSampler(
                n * m, iter_sample_rate=e.iter_sample_rate, grad_sample_rate=e.grad_sample_rate,
                seed=cfg.training.seed * 7919 + 7, estimator=e.entropy)
            p2p.entropy_probe = self._pp_probe
            p2p.set_rank(None, 0)
        # DAC (EDGC §6).
        self.dac = e.dac_active and num_stages > 1
        self.dp_table: list = [None] * num_stages   # the DP ranks in force (DAC applied)
        self.pp_rank: Optional[int] = None
        self.table_version = 0
        self.time_fits = StageTimeFits(num_stages)

    # ------------------------------------------------------------------ per iteration

    def _probe(self, key: str, grad: torch.Tensor) -> None:
        if self._measuring:
            t0 = time.perf_counter()
            self._samples.append(self.samplers[key].sample(grad.view(-1), self._window).float())
            self.entropy_ms += (time.perf_counter() - t0) * 1e3
            if self._typed_grads is not None:
                for t, p in self._typed_grads[key]:
                    self._type_sums[t] += power_sums(p.main_grad, order=2)
            if key == self._calib_bucket and self.controller.in_warmup:
                self._calib_grad = self._calib_param.main_grad.detach().float().view(
                    self.stage_shapes[self.stage]).clone()
        if self.cfg.edgc.entropy_reference:
            t0 = time.perf_counter()
            self._full_entropies.append(grad.detach().view(-1).float().clone())  # pre-sync
            self.full_entropy_ms += (time.perf_counter() - t0) * 1e3

    def _pp_probe(self, grad: torch.Tensor) -> None:
        if self._measuring:
            t0 = time.perf_counter()
            self._pp_sample = self.pp_sampler.sample(grad.detach().reshape(-1),
                                                     self._window).float()
            self.entropy_ms += (time.perf_counter() - t0) * 1e3

    def before_step(self, iteration: int) -> None:
        self._measuring = self.controller.should_measure(iteration)
        self._window = self.controller.window_of(iteration)
        self._samples = []
        self._pp_sample = None
        self._full_entropies = []
        self._type_sums.zero_()
        self.entropy_ms = 0.0
        self.full_entropy_ms = 0.0
        self.last_entropies = None
        # The DP rank of this iteration: the table, or DAC's two-rank probe after warm-up.
        probe = self.probe_rank(iteration)
        self.dp_compression.set_rank(probe if probe is not None else self.dp_table[self.stage])

    def probe_rank(self, iteration: int) -> Optional[int]:
        """DAC's probe: the window after warm-up runs r_max, then r_min (all stages)."""
        if not self.dac:
            return None
        return probe_rank(iteration, self.controller.warmup_end_iter, self.settings)

    def applied_ranks(self, iteration: int) -> list:
        if self.budget:  # the byte-equivalent uniform rank of each stage's shape ranks
            return [None if r is None else round(r, 2)
                    for r in (self.controller.effective_rank(s) for s in range(self.num_stages))]
        probe = self.probe_rank(iteration)
        return [probe] * self.num_stages if probe is not None else list(self.dp_table)

    def _stage_sums(self, local: float, extra: Optional[float] = None) -> torch.Tensor:
        """``[[Σ value], [count]]`` per stage (and a last column for ``extra``) of this
        rank's contribution; summed over the job they give :meth:`_means_of`."""
        sums = torch.zeros(2, self.num_stages + 1, dtype=torch.float64)
        if math.isfinite(local):
            sums[0, self.stage], sums[1, self.stage] = local, 1.0
        if extra is not None and math.isfinite(extra):
            sums[0, -1], sums[1, -1] = extra, 1.0
        return sums

    def _means_of(self, sums: torch.Tensor, extra: bool = False):
        sums = sums.view(2, self.num_stages + 1)
        means = [(sums[0, s] / sums[1, s]).item() if sums[1, s] > 0 else float("nan")
                 for s in range(self.num_stages + 1)]
        return (means[:-1], means[-1]) if extra else means[:-1]

    def _stage_mean(self, local: float, extra: Optional[float] = None):
        """Average a per-rank scalar over each stage's ranks (one all-reduce, all ranks);
        with ``extra``, also a job-wide mean of it over the ranks where it is finite."""
        sums = self._stage_sums(local, extra).to(self.device)
        dist.all_reduce(sums)
        return self._means_of(sums.cpu(), extra is not None)

    def entropy_sums(self) -> torch.Tensor:
        """This iteration's sampled entropies as per-stage sums, flat, for the loop's own
        telemetry all-reduce (so a measured iteration costs no collective of its own):
        zeros when GDS does not measure this iteration. Pass the job-wide sum to
        :meth:`after_step` as ``entropy_sums``."""
        if not self._measuring:
            return torch.zeros(2 * (self.num_stages + 1), dtype=torch.float64)
        t0 = time.perf_counter()
        local = estimate_entropy(torch.cat(self._samples), self.cfg.edgc.entropy) \
            if self._samples else float("nan")
        pp_local = None
        if self.pp_controller is not None:
            pp_local = estimate_entropy(self._pp_sample, self.cfg.edgc.entropy) \
                if self._pp_sample is not None else float("nan")
        self.entropy_ms += (time.perf_counter() - t0) * 1e3
        return self._stage_sums(local, pp_local).view(-1)

    def _grad_stats(self) -> dict:
        return grad_stats(self._samples, self._type_sums, stage=self.stage,
                          num_stages=self.num_stages, device=self.device)

    def _calibrate(self) -> None:
        """``--edgc-g calibrated``: the controller's rank models from the real gradients."""
        self.controller.rank_models, self.calibrated_g = calibrated_rank_models(
            self._calib_grad, self.stage_shapes, self.controller.rank_models,
            stage=self.stage, device=self.device)

    def after_step(self, iteration: int, stage_times: Optional[dict] = None,
                   entropy_sums: Optional[torch.Tensor] = None) -> dict:
        """Feed this iteration's measurements; at a window end decide the next tables.

        ``stage_times`` holds per-stage means over the job (identical on every rank):
        ``t_b_ms``, ``t_p2p_ms`` and ``dp_sync_ms`` (NaN where a stage has none).
        ``entropy_sums``: :meth:`entropy_sums` summed over the job (by the caller's
        all-reduce); without it this method all-reduces the entropies itself.
        """
        record = {}
        if self.cfg.edgc.entropy_reference and self._full_entropies:
            t0 = time.perf_counter()
            full = estimate_entropy(torch.cat(self._full_entropies), self.cfg.edgc.entropy)
            self.full_entropy_ms += (time.perf_counter() - t0) * 1e3
            record["entropy_full"] = self._stage_mean(full)
            record["entropy_full_ms"] = self.full_entropy_ms
        if self._measuring:
            if entropy_sums is None:
                entropy_sums = self.entropy_sums().to(self.device)
                dist.all_reduce(entropy_sums)
            if self.pp_controller is not None:
                entropies, pp_entropy = self._means_of(entropy_sums.cpu(), extra=True)
                self.pp_controller.observe(iteration, [pp_entropy])
                record["entropy_pp"] = pp_entropy
            else:
                entropies = self._means_of(entropy_sums.cpu())
            self.controller.observe(iteration, entropies)
            self.last_entropies = entropies
            if self._typed_grads is not None:
                record.update(self._grad_stats())
            record["entropy"] = entropies
            record["entropy_ms"] = self.entropy_ms
        if self.dac and stage_times is not None:
            self.time_fits.observe(self.applied_ranks(iteration), stage_times)
        window_end = (iteration + 1) % self.settings.window == 0
        if self.budget:
            record["budget_scale"] = self.controller.budget_scale
            record["rank_dp_shapes"] = [
                None if t is None else {f"{n}x{m}": r for (n, m), r in sorted(t.items())}
                for t in self.dp_table]
            if window_end and not self.controller.in_warmup:
                self.budget_feed.observe_spectrum()
        else:
            record["rank_cqm"] = list(self.controller.table)  # in force this iteration
        was_warmup = self.controller.in_warmup
        if self.budget and window_end and not was_warmup:
            self.budget_feed.set_scale(iteration + 1)
        self.controller.end_iteration(iteration)
        if self.budget and was_warmup and not self.controller.in_warmup:
            # from the window after the r_max window
            self.budget_feed.plan_scales(iteration + 1 + self.settings.window)
        if was_warmup and not self.controller.in_warmup and self.cfg.edgc.g == "calibrated":
            self._calibrate()
            record["g_calibrated"] = self.calibrated_g
        if self.pp_controller is not None:
            self.pp_controller.end_iteration(iteration)
        if window_end:
            if self.cfg.edgc.check_table:
                self.check_table()
            self._decide_tables(iteration)
            record["entropy_window_mean"] = self.controller.window_means[-1]
        record["edgc_warmup"] = self.controller.in_warmup
        if self.controller.warmup_end_iter is not None:
            record["warmup_end_iter"] = self.controller.warmup_end_iter
        record.update(self.time_fits.record())
        return record

    # ------------------------------------------------------------------ tables

    def _decide_tables(self, iteration: int) -> None:
        """Window end: CQM table (+ DAC), PP rank; broadcast; install for the next window."""
        table = list(self.controller.table)
        if self.dac and table[0] is not None:
            table = self.time_fits.align(table, self.settings.rank_max)
        self.time_fits.new_window()
        pp = self.pp_controller.table[0] if self.pp_controller is not None else None
        if self.budget:  # shape ranks, flattened in every stage's shape order
            shapes = [self.controller.shapes_of(s) for s in range(self.num_stages)]
            flat = [None if t is None else t[shape]
                    for t, stage_shapes in zip(table, shapes) for shape in stage_shapes]
            shared = _broadcast_ints(flat + [pp], self.device)
            self.dp_table, k = [], 0
            for t, stage_shapes in zip(table, shapes):
                values = shared[k:k + len(stage_shapes)]
                k += len(stage_shapes)
                self.dp_table.append(None if t is None else dict(zip(stage_shapes, values)))
            self.pp_rank = shared[-1]
        else:
            shared = _broadcast_ints(table + [pp], self.device)
            self.dp_table, self.pp_rank = shared[:-1], shared[-1]
        self.table_version += 1
        if self.pp_controller is not None:
            self.p2p.set_rank(self.pp_rank, self.table_version)

    def check_table(self) -> None:
        digest = self.controller.table_hash()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, digest)
        if len(set(gathered)) != 1:
            bad = [r for r, h in enumerate(gathered) if h != gathered[0]]
            raise RankTableMismatch(f"EDGC rank table differs on ranks {bad} from rank 0: "
                                    f"the DP collectives would disagree in shape")

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"controller": self.controller.state_dict(), "stage_shapes": self.stage_shapes,
                "calibrated_g": self.calibrated_g,
                "pp_controller": self.pp_controller.state_dict()
                if self.pp_controller is not None else None,
                "budget_scales": sorted(self.budget_feed.scales.items())
                if self.budget and self.budget_feed.scales is not None else None,
                "dp_table": BudgetRankController._encode_table(self.dp_table)
                if self.budget else self.dp_table, "pp_rank": self.pp_rank,
                "table_version": self.table_version, **self.time_fits.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        if state.get("calibrated_g"):
            self.calibrated_g = state["calibrated_g"]
            self.controller.rank_models = [
                RankModel(n, m, residuals=c) if c is not None else model
                for (n, m), c, model in zip(self.stage_shapes, self.calibrated_g,
                                            self.controller.rank_models)]
        if self.pp_controller is not None and state.get("pp_controller") is not None:
            self.pp_controller.load_state_dict(state["pp_controller"])
        self.dp_table = list(state.get("dp_table", self.controller.table))
        if self.budget:
            self.dp_table = BudgetRankController._decode_table(self.dp_table)
            scales = state.get("budget_scales")
            self.budget_feed.scales = dict(scales) if scales is not None else None
        self.pp_rank = state.get("pp_rank")
        self.table_version = state.get("table_version", 0)
        self.time_fits.load_state_dict(state)
        self.dp_compression.set_rank(self.dp_table[self.stage])
        if self.pp_controller is not None:
            self.p2p.set_rank(self.pp_rank, self.table_version)
