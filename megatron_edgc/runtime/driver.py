"""The EDGC driver: sampled entropy → controllers → DP ranks per stage (with DAC) and the
pipeline rank, the same table on every rank of the job (docs/method.md §2-7).

:class:`~megatron_edgc.runtime.step.EdgcRuntime` calls :meth:`EdgcDriver.before_step` and
:meth:`EdgcDriver.after_step` every iteration. On GDS's iterations each rank reduces its
``β`` sample of each bucket on the device; the runtime's telemetry all-reduce carries the
sums (no collective of their own), so every rank feeds the same per-stage entropies to
its own controller (:class:`~megatron_edgc.control.rank_control.PaperControl` with DAC,
or :class:`~megatron_edgc.runtime.budget.BudgetControl`; with ``--edgc-pp-compression
edgc`` a second one for the pipeline rank) and holds the same table (broadcast from the
first rank once per window; ``--edgc-check-table`` hashes it). ``None`` (warm-up): dense.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_edgc.control.controller import ControllerSettings, RankController
from megatron_edgc.control.entropy import (LAYER_TYPES, GradientSampler, SampledEntropy,
                                           estimate_entropy, layer_type, power_sums)
from megatron_edgc.control.rank_control import PaperControl, RankControl
from megatron_edgc.control.rank_model import RankModel
from megatron_edgc.runtime.budget import BudgetControl
from megatron_edgc.runtime.dac import StageTimeFits
from megatron_edgc.runtime.gradient_stats import GCalibration, dominant_shape, grad_stats


class RankTableMismatch(RuntimeError):
    pass


def _broadcast_ints(values: list, device) -> list:
    """The first rank's list of small ints (None as -1), on every rank of the job."""
    t = torch.tensor([-1 if v is None else int(v) for v in values], dtype=torch.int64,
                     device=device)
    dist.broadcast(t, src=0)
    return [None if v < 0 else v for v in t.tolist()]


def _put_entropy(sums: torch.Tensor, column: int, entropy: torch.Tensor) -> None:
    """``sums[:, column] = [entropy, 1]`` where the entropy is finite, else ``[0, 0]``,
    on the device."""
    finite = torch.isfinite(entropy)
    sums[0, column] = torch.where(finite, entropy, torch.zeros_like(entropy))
    sums[1, column] = finite.to(sums.dtype)


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
        self.entropy = SampledEntropy({
            key: GradientSampler(grad.numel(), grad_sample_rate=e.grad_sample_rate,
                                 seed=cfg.training.seed * 7919 + i, estimator=e.entropy)
            for i, (key, grad) in enumerate(dp_compression.bucket_grads())},
            estimator=e.entropy, moments=e.grad_stats)
        # Every rank builds the rank models of every stage: share the dominant shapes.
        shapes = torch.zeros(num_stages, 2, dtype=torch.float64, device=device)
        shapes[stage] = torch.tensor(dominant_shape(chunks), dtype=torch.float64)
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX)
        self.stage_shapes = [tuple(int(v) for v in row) for row in shapes.tolist()]
        self.settings = ControllerSettings(
            window=e.window, iter_sample_rate=e.iter_sample_rate, rank_max=e.rank_max,
            rank_min=e.rank_min, rank_step=e.rank_step, warmup_eps=e.warmup_eps,
            warmup_windows=e.warmup_windows,
            **dict(zip(("warmup_max_iters", "dense_max_iters"),
                       e.warmup_bounds(cfg.training.train_iters))))
        # PP rank controller (EDGC §7): one rank for every backward send, its own stream.
        pipeline, self.pp_entropy = None, None
        if p2p is not None and e.pp_compression == "edgc":
            n, m = math.prod(activation_shape[:-1]), activation_shape[-1]
            pipeline = RankController(
                dataclasses.replace(self.settings, rank_max=e.pp_rank_max,
                                    rank_min=e.pp_rank_min), [RankModel(n, m)])
            self.pp_entropy = SampledEntropy({"pp": GradientSampler(
                n * m, grad_sample_rate=e.grad_sample_rate,
                seed=cfg.training.seed * 7919 + 7, estimator=e.entropy)}, estimator=e.entropy)
        self.control = self._make_control(chunks, pipeline, lr_at=lr_at, optimizer=optimizer)
        # --edgc-grad-stats (the entropy study): each bucket's parameters by layer type.
        self._typed_grads = None
        if e.grad_stats:
            self._typed_grads = {
                key: [(LAYER_TYPES.index(layer_type(name)), p) for name, p in params]
                for key, params in dp_compression.bucket_params()}
        self._type_sums = torch.zeros(len(LAYER_TYPES), 3, dtype=torch.float64, device=device)
        self._powers = torch.arange(3, dtype=torch.float64, device=device)
        #: the loss scale of this step's gradients (fp16's scaler, float ``[1]`` on the
        #: device; None without one), set by the runtime: GDS measures net of it
        self.loss_scale: Optional[torch.Tensor] = None
        self._full_entropies: list = []
        self._measuring = False
        self._window = 0
        self.entropy_ms = self.full_entropy_ms = 0.0
        self.dp_table: list = [None] * num_stages   # the DP ranks in force (DAC applied)
        self.pp_rank: Optional[int] = None
        self.table_version = 0
        dp_compression.set_rank(None)  # dense until the warm-up ends
        dp_compression.entropy_probe = self._probe
        if pipeline is not None:
            p2p.entropy_probe = self._pp_probe
            p2p.set_rank(None, 0)

    def _make_control(self, chunks, pipeline, *, lr_at, optimizer) -> RankControl:
        """The DP rank controller ``--edgc-controller`` names, with what attaches to it:
        the pipeline rank, DAC (PP > 1) and the calibrated ``g`` (the paper's only)."""
        e = self.cfg.edgc
        if e.controller == "budget":  # per-shape ranks from a time budget
            return BudgetControl.build(self.cfg, self.settings, self.dp_compression,
                                       stage=self.stage, num_stages=self.num_stages,
                                       device=self.device, optimizer=optimizer, lr_at=lr_at,
                                       pipeline=pipeline)
        dac = StageTimeFits(self.num_stages, self.settings) \
            if e.dac_active and self.num_stages > 1 else None
        calibration = GCalibration(chunks, self.dp_compression, self.stage_shapes,
                                   stage=self.stage, device=self.device) \
            if e.g == "calibrated" else None
        return PaperControl(RankController(self.settings,
                                           [RankModel(n, m) for n, m in self.stage_shapes]),
                            alignment=dac, pipeline=pipeline, calibration=calibration)

    @property
    def controller(self) -> RankController:
        """The DP controller's warm-up and window state (its ``state_dict`` is what every
        rank must agree on)."""
        return self.control.controller

    @property
    def dac(self) -> bool:
        """Whether DAC is attached: its fits take every iteration's stage times."""
        return self.control.alignment is not None

    @property
    def time_fits(self):
        """DAC's stage-time fits (the control's alignment), or None: a caller that hands
        the stage times over later than :meth:`after_step` feeds them here."""
        return self.control.alignment

    # ------------------------------------------------------------------ per iteration

    def _probe(self, key: str, grad: torch.Tensor) -> None:
        """GDS's sample of a bucket's gradients before its sync, net of the loss scale
        (:attr:`loss_scale`), as everything measured on the gradients."""
        scale = self.loss_scale
        if self._measuring:
            t0 = time.perf_counter()
            self.entropy.add(key, grad.view(-1), self._window, scale)
            self.entropy_ms += (time.perf_counter() - t0) * 1e3
            if self._typed_grads is not None:
                for t, p in self._typed_grads[key]:
                    sums = power_sums(p.main_grad, order=2)
                    self._type_sums[t] += sums if scale is None else \
                        sums / scale.double() ** self._powers
            self.control.see_gradient(key)
        if self.cfg.edgc.entropy_reference:
            t0 = time.perf_counter()
            full = grad.detach().view(-1).float().clone()  # pre-sync
            self._full_entropies.append(full if scale is None else full.div_(scale))
            self.full_entropy_ms += (time.perf_counter() - t0) * 1e3

    def _pp_probe(self, grad: torch.Tensor) -> None:
        if self._measuring:
            t0 = time.perf_counter()
            self.pp_entropy.reset()  # the step's last probed message is its sample
            self.pp_entropy.add("pp", grad.detach().reshape(-1), self._window, self.loss_scale)
            self.entropy_ms += (time.perf_counter() - t0) * 1e3

    def before_step(self, iteration: int) -> None:
        self._measuring = self.control.should_measure(iteration)
        self._window = self.control.window_of(iteration)
        self.entropy.reset()
        if self.pp_entropy is not None:
            self.pp_entropy.reset()
        self._full_entropies = []
        if self._typed_grads is not None:
            self._type_sums.zero_()
        self.entropy_ms = 0.0
        self.full_entropy_ms = 0.0
        # The DP rank of this iteration: the table, or DAC's two-rank probe after warm-up.
        self.dp_compression.set_rank(
            self.control.rank_in_force(iteration, self.dp_table, self.stage))

    def applied_ranks(self, iteration: int) -> list:
        return self.control.applied_ranks(iteration, self.dp_table)

    def _stage_sums(self, local: float) -> torch.Tensor:
        """``[[Σ value], [count]]`` per stage (and a last column for the pipeline) of this
        rank's contribution; summed over the job they give :meth:`_means_of`."""
        sums = torch.zeros(2, self.num_stages + 1, dtype=torch.float64)
        if math.isfinite(local):
            sums[0, self.stage], sums[1, self.stage] = local, 1.0
        return sums

    def _means_of(self, sums: torch.Tensor, extra: bool = False):
        """The per-stage means of :meth:`_stage_sums` summed over the job (one read)."""
        totals, counts = sums.view(2, self.num_stages + 1).tolist()
        means = [t / c if c > 0 else float("nan") for t, c in zip(totals, counts)]
        return (means[:-1], means[-1]) if extra else means[:-1]

    def _stage_mean(self, local: float):
        """Average a per-rank scalar over each stage's ranks (one all-reduce, all ranks)."""
        sums = self._stage_sums(local).to(self.device)
        dist.all_reduce(sums)
        return self._means_of(sums)

    def entropy_sums(self, on_device: bool = False) -> torch.Tensor:
        """This iteration's sampled entropies as per-stage sums ``[[Σ H], [count]]`` (a
        last column for the pipeline's), flat, for the loop's own telemetry all-reduce (so
        a measured iteration costs no collective of its own): zeros when GDS does not
        measure this iteration. Pass the job-wide sum to :meth:`after_step` as
        ``entropy_sums``.

        The entropies are formed here, on the device, from the step's sums; with
        ``on_device`` the result stays there (no host read), else it is copied to the
        host (where the caller's all-reduce reads its totals anyway)."""
        where = self.device if on_device else "cpu"
        if not self._measuring:
            return torch.zeros(2 * (self.num_stages + 1), dtype=torch.float64, device=where)
        t0 = time.perf_counter()
        sums = torch.zeros(2, self.num_stages + 1, dtype=torch.float64, device=self.device)
        _put_entropy(sums, self.stage, self.entropy.entropy(self.device))
        if self.pp_entropy is not None:
            _put_entropy(sums, self.num_stages, self.pp_entropy.entropy(self.device))
        self.entropy_ms += (time.perf_counter() - t0) * 1e3
        return sums.view(-1).to(where)

    def after_step(self, iteration: int, stage_times: Optional[dict] = None,
                   entropy_sums: Optional[torch.Tensor] = None) -> dict:
        """Feed this iteration's measurements; at a window end decide the next tables.

        ``stage_times`` holds per-stage means over the job (identical on every rank):
        ``t_b_ms``, ``t_p2p_ms`` and ``dp_sync_ms`` (NaN where a stage has none).
        ``entropy_sums``: :meth:`entropy_sums` summed over the job (by the caller's
        all-reduce); without it this method all-reduces the entropies itself.

        Host reads: on a measured iteration the job's mean entropies (the controllers
        decide on host values), at a window end the broadcast table.
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
                entropy_sums = self.entropy_sums(on_device=True)
                dist.all_reduce(entropy_sums)
            entropies, pp_entropy = self._means_of(entropy_sums, extra=True)  # the host read
            self.control.observe(iteration, entropies, pp_entropy)
            if self.pp_entropy is not None:
                record["entropy_pp"] = pp_entropy
            if self._typed_grads is not None:
                record.update(grad_stats(self.entropy.power_sums(), self._type_sums,
                                         stage=self.stage, num_stages=self.num_stages,
                                         device=self.device))
            record["entropy"] = entropies
            record["entropy_ms"] = self.entropy_ms
        self.control.observe_times(iteration, self.dp_table, stage_times)
        record.update(self.control.record(self.dp_table))   # the ranks in force
        record.update(self.control.end_iteration(iteration))
        if self.control.is_window_end(iteration):
            if self.cfg.edgc.check_table:
                self.check_table()
            self._install_tables()
            record["entropy_window_mean"] = self.controller.window_means[-1]
        record.update(self.control.status())
        return record

    # ------------------------------------------------------------------ tables

    def _install_tables(self) -> None:
        """Window end: the control's tables, broadcast from the first rank, installed for
        the next window."""
        self.dp_table, self.pp_rank = self.control.window_end(
            lambda values: _broadcast_ints(values, self.device))
        self.table_version += 1
        if self.control.pipeline is not None:
            self.p2p.set_rank(self.pp_rank, self.table_version)

    def check_table(self) -> None:
        digest = self.control.table_hash()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, digest)
        if len(set(gathered)) != 1:
            bad = [r for r, h in enumerate(gathered) if h != gathered[0]]
            raise RankTableMismatch(f"EDGC rank table differs on ranks {bad} from rank 0: "
                                    f"the DP collectives would disagree in shape")

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"stage_shapes": self.stage_shapes,
                "dp_table": self.control.encode_table(self.dp_table), "pp_rank": self.pp_rank,
                "table_version": self.table_version, **self.control.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.control.load_state_dict(state)
        self.dp_table = self.control.decode_table(state["dp_table"]) if "dp_table" in state \
            else list(self.controller.table)
        self.pp_rank = state.get("pp_rank")
        self.table_version = state.get("table_version", 0)
        self.dp_compression.set_rank(self.dp_table[self.stage])
        if self.control.pipeline is not None:
            self.p2p.set_rank(self.pp_rank, self.table_version)
