"""EDGC in the training loop: sampled entropy → controllers → DP ranks per stage (with
DAC) and the pipeline rank.

Every iteration the loop calls :meth:`EdgcDriver.before_step` and
:meth:`EdgcDriver.after_step`. On the iterations GDS measures, each rank samples a
``β`` fraction of its local gradient elements (``entropy_probe`` of the DP patch, before
the sync), estimates the entropy, and the loop's per-iteration telemetry all-reduce
carries the estimates (no collective of their own) to average them per pipeline stage
(over its DP and TP ranks). Every rank therefore feeds the
same per-stage entropies to its own :class:`RankController` and holds the same rank table
(``--edgc-check-table`` verifies that with a hash at each window end). The entry of this
rank's stage is handed to the DP compression; ``None`` (warm-up) means dense.

With ``--edgc-pp-compression edgc`` a second controller (one entry, its own bounds) is fed
the entropy of the outgoing backward activation gradients (sampled on the same
iterations, averaged over every sending rank) and sets the pipeline rank (EDGC §7).

With DAC (EDGC §6, PP > 1) the DP rank of each stage is the CQM rank raised by the
stage's slack: the window after warm-up probes two ranks (first half ``r_max``, second
half ``r_min``) so that each stage's sync time ``T_s(r) = η_s r + c_s`` can be fitted; every
window end refits (decayed least-squares sums over all windows so far) and recomputes
the aligned table from the window's mean backward and send times. The timings come from
one all-reduce per iteration (the loop's), so every rank computes the same table; it is
still broadcast from the first rank (one small broadcast per window) and is what both
ends of every pipeline message and every DP collective use.
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
                                           layer_type, moments_from_power_sums, power_sums)
from megatron_edgc.control.rank_allocation import BudgetRankController, adam_weights, sqrt_lr_scales
from megatron_edgc.control.rank_model import RankModel
from megatron_edgc.control.stage_alignment import LinearTimeModel, aligned_ranks, stage_slack

#: Weight of older windows in the DAC least-squares sums (per window).
DAC_DECAY = 0.5


class RankTableMismatch(RuntimeError):
    pass


def _broadcast_ints(values: list, device) -> list:
    """The first rank's list of small ints (None as -1), on every rank of the job."""
    t = torch.tensor([-1 if v is None else int(v) for v in values], dtype=torch.int64,
                     device=device)
    dist.broadcast(t, src=0)
    return [None if v < 0 else v for v in t.tolist()]


def dominant_shape(chunks) -> tuple[int, int]:
    """The matrix shape holding most of this rank's gradient elements (EDGC §4)."""
    totals: dict = {}
    for chunk in chunks:
        for p in chunk.module.parameters():
            n, m = matrix_shape(p.shape)
            if n > 1 and m > 1:
                totals[(n, m)] = totals.get((n, m), 0) + n * m
    return max(totals, key=lambda k: (totals[k], k)) if totals else (1, 1)


def adam_second_moments(optimizer) -> tuple:
    """``({id(model parameter): exp_avg_sq}, eps)`` of a megatron-core Adam optimizer
    (``ChainedOptimizer``, ``Float16OptimizerWithFloat16Params`` or ``FP32Optimizer``; the
    distributed optimizer shards the state and is refused by the config). Tensors are the
    live state, read at each window end; a parameter without state yet is absent."""
    out, eps = {}, 1e-8
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        groups = getattr(opt, "float16_groups", None)
        masters = getattr(opt, "fp32_from_float16_groups", None)
        pairs = []
        if groups is not None and masters is not None:
            pairs += [(m, p) for mg, pg in zip(groups, masters) for m, p in zip(mg, pg)]
            fp32 = getattr(opt, "fp32_from_fp32_groups", [])
            pairs += [(p, p) for g in fp32 for p in g]
        else:
            pairs += [(p, p) for g in inner.param_groups for p in g["params"]]
        for model_param, state_param in pairs:
            state = inner.state.get(state_param, {})
            if "exp_avg_sq" in state:
                out[id(model_param)] = state["exp_avg_sq"]
        eps = float(inner.param_groups[0].get("eps", eps)) if inner.param_groups else eps
    return out, eps


class EdgcDriver:
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
        self.optimizer = optimizer if self.budget and e.budget_weight == "adam" else None
        if self.budget and e.budget_weight == "adam" and optimizer is None:
            raise ValueError("--edgc-budget-weight adam needs the optimizer")
        self.lr_at = lr_at  # step -> LR of the run's schedule (--edgc-budget-schedule lr)
        self._budget_scales: Optional[dict] = None
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
        self._type_sums = torch.zeros(len(LAYER_TYPES), 3, dtype=torch.float64)
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
        self._fit = [[0.0] * 5 for _ in range(num_stages)]   # n, Σr, Σt, Σr², Σrt
        self._window_times = [[0.0] * 4 for _ in range(num_stages)]  # Σt_b, n, Σt_p2p, n
        self.time_models: Optional[list] = None
        self.slack: Optional[list] = None

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
        end = self.controller.warmup_end_iter
        if not self.dac or end is None or not end <= iteration < end + self.settings.window:
            return None
        first_half = iteration - end < self.settings.window // 2
        return self.settings.rank_max if first_half else self.settings.rank_min

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
        """``--edgc-grad-stats``: skewness and excess kurtosis of the sampled gradient and
        the Gaussian entropy per layer type, per stage, pooled over the stage's ranks (one
        all-reduce of power sums, so the moments are those of the pooled sample)."""
        n_types = len(LAYER_TYPES)
        sums = torch.zeros(self.num_stages, 5 + 3 * n_types, dtype=torch.float64)
        if self._samples:
            sums[self.stage, :5] = power_sums(torch.cat(self._samples))
        sums[self.stage, 5:] = self._type_sums.view(-1)
        sums = sums.to(self.device)
        dist.all_reduce(sums)
        sums = sums.cpu()
        stats = [moments_from_power_sums(row[:5]) for row in sums]
        by_type = {}
        for t, name in enumerate(LAYER_TYPES):
            cols = sums[:, 5 + 3 * t:8 + 3 * t]
            by_type[name] = [moments_from_power_sums([c[0], c[1], c[2], 0.0, 0.0])["entropy"]
                             if c[0] > 0 else float("nan") for c in cols]
        return {"grad_skew": [s["skew"] for s in stats], "grad_kurt": [s["kurt"] for s in stats],
                "entropy_by_type": by_type}

    def _calibrate(self) -> None:
        """``--edgc-g calibrated``: g from the real gradients at warm-up end (EDGC §4).

        The best rank-r relative residual (singular values) of this rank's gradient of a
        dominant-shape matrix, for every r, averaged over the stage's ranks, becomes the
        stage's g (made monotone by :class:`RankModel`).
        """
        k_max = max(min(n, m) for n, m in self.stage_shapes)
        curves = torch.zeros(2, self.num_stages, k_max + 1, dtype=torch.float64,
                             device=self.device)
        if self._calib_grad is not None:
            s2 = torch.linalg.svdvals(self._calib_grad.double()) ** 2
            tail = torch.cat([s2.flip(0).cumsum(0).flip(0), s2.new_zeros(1)])
            if tail[0] > 0:
                curves[0, self.stage, :tail.numel()] = (tail / tail[0]).sqrt()
                curves[1, self.stage] = 1.0
        dist.all_reduce(curves)
        models, self.calibrated_g = [], []
        for s, (n, m) in enumerate(self.stage_shapes):
            k = min(n, m)
            if curves[1, s, 0] > 0:
                curve = (curves[0, s, :k + 1] / curves[1, s, 0]).tolist()
                models.append(RankModel(n, m, residuals=curve))
            else:
                curve = None
                models.append(self.controller.rank_models[s])
            self.calibrated_g.append(curve)
        self.controller.rank_models = models

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
            self._observe_times(self.applied_ranks(iteration), stage_times)
        window_end = (iteration + 1) % self.settings.window == 0
        if self.budget:
            record["budget_scale"] = self.controller.budget_scale
            record["rank_dp_shapes"] = [
                None if t is None else {f"{n}x{m}": r for (n, m), r in sorted(t.items())}
                for t in self.dp_table]
            if window_end and not self.controller.in_warmup:
                self._observe_spectrum()
        else:
            record["rank_cqm"] = list(self.controller.table)  # in force this iteration
        was_warmup = self.controller.in_warmup
        if self.budget and window_end and not was_warmup:
            self._set_budget_scale(iteration + 1)
        self.controller.end_iteration(iteration)
        if self.budget and was_warmup and not self.controller.in_warmup:
            self._plan_budget_scales(iteration + 1 + self.settings.window)  # after the r_max window
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
        if self.time_models is not None:
            record["dac_eta_ms"] = [m.eta for m in self.time_models]
            record["dac_c_ms"] = [m.c for m in self.time_models]
            record["dac_slack_ms"] = self.slack
        return record

    def _plan_budget_scales(self, start: int) -> None:
        """At warm-up end: the budget scale of every remaining window (mean 1), from the
        LR schedule at each window's middle; constant schedule: all 1."""
        w, end = self.settings.window, self.cfg.training.train_iters
        if self.cfg.edgc.budget_schedule != "lr" or self.lr_at is None:
            return
        mids = list(range(start + w // 2, end, w))
        self._budget_scales = dict(zip(range(start, end, w),
                                       sqrt_lr_scales([self.lr_at(i) for i in mids])))

    def _set_budget_scale(self, next_window_start: int) -> None:
        if self._budget_scales is not None:
            self.controller.budget_scale = self._budget_scales.get(
                next_window_start, self.controller.budget_scale)

    def _observe_spectrum(self) -> None:
        """Window end (budget controller): the window's column energies per stage and
        shape, summed over the job (one all-reduce), to the controller."""
        c = self.controller
        r_max = self.settings.rank_max
        width = max(len(g) for g in c.groups) if c.groups else 0
        sums = torch.zeros(self.num_stages, max(width, 1), 4 + r_max, dtype=torch.float64)
        local = self.dp_compression.pop_spectrum()
        adam = self._adam_residual_sums() if self.optimizer is not None else {}
        for g, shape in enumerate(c.shapes_of(self.stage)):
            if shape in local:
                total, cols = local[shape]
                sums[self.stage, g, 0] = total
                sums[self.stage, g, 1] = 1.0
                sums[self.stage, g, 2:2 + cols.numel()] = cols[:r_max]
            if shape in adam:
                sums[self.stage, g, 2 + r_max:] = torch.tensor(adam[shape], dtype=torch.float64)
        sums = sums.to(self.device)
        dist.all_reduce(sums)
        sums = sums.cpu()
        spectra = []
        for s in range(self.num_stages):
            table = c.table[s]
            row = []
            for g, shape in enumerate(c.shapes_of(s)):
                if table is None or sums[s, g, 1] == 0:
                    row.append(None)
                else:
                    r = table[shape]
                    row.append((float(sums[s, g, 0]), sums[s, g, 2:2 + r].tolist()))
            spectra.append(row)
        weights = None
        if self.optimizer is not None:
            weights = []
            for s in range(self.num_stages):
                n = len(c.shapes_of(s))
                weights.append(adam_weights(sums[s, :n, 0].tolist(),
                                            sums[s, :n, 2 + r_max].tolist(),
                                            sums[s, :n, 3 + r_max].tolist()))
        c.observe_spectrum(spectra, weights)

    def _adam_residual_sums(self) -> dict:
        """``{(n, m): [Σ E²/(√v+ε)², Σ E²]}`` over this rank's compressed matrices: the
        error-feedback residual as Adam's update would see it, and plain."""
        moments, eps = adam_second_moments(self.optimizer)
        params = {name: p for _, named in self.dp_compression.bucket_params()
                  for name, p in named}
        out: dict = {}
        for comp in self.dp_compression.compressors.values():
            for shape, g in comp.groups.items():
                if g.residual is None:
                    continue
                for j, name in enumerate(g.names):
                    v = moments.get(id(params[name]))
                    if v is None:
                        continue
                    e2 = g.residual[j].double() ** 2
                    denom = (v.detach().double().view(e2.shape).sqrt() + eps) ** 2
                    acc = out.setdefault(shape, [0.0, 0.0])
                    acc[0] += float((e2 / denom).sum())
                    acc[1] += float(e2.sum())
        return out

    # ------------------------------------------------------------------ DAC and tables

    def _observe_times(self, ranks: list, stage_times: dict) -> None:
        for s in range(self.num_stages):
            r, t = ranks[s], stage_times["dp_sync_ms"][s]
            if r is not None and math.isfinite(t):
                f = self._fit[s]
                f[0] += 1.0
                f[1] += r
                f[2] += t
                f[3] += r * r
                f[4] += r * t
            w = self._window_times[s]
            for i, key in ((0, "t_b_ms"), (2, "t_p2p_ms")):
                v = stage_times[key][s]
                if math.isfinite(v):
                    w[i] += v
                    w[i + 1] += 1.0

    def _fit_models(self) -> Optional[list]:
        """``T_s(r) = η_s r + c_s`` from the decayed least-squares sums. A stage whose
        recent ranks do not spread enough to fit a slope keeps its previous model; None
        until every stage has had one (the probe window provides it)."""
        models = []
        for s, (n, sr, st, srr, srt) in enumerate(self._fit):
            var = srr - sr * sr / n if n else 0.0
            if n >= 2 and var > 1e-6 * n:
                eta = (srt - sr * st / n) / var
                models.append(LinearTimeModel(eta, (st - eta * sr) / n))
            elif self.time_models is not None:
                models.append(self.time_models[s])
            else:
                return None
        return models

    def _decide_tables(self, iteration: int) -> None:
        """Window end: CQM table (+ DAC), PP rank; broadcast; install for the next window."""
        table = list(self.controller.table)
        if self.dac and table[0] is not None:
            models = self._fit_models()
            if models is not None:
                means = [(w[0] / w[1] if w[1] else 0.0, w[2] / w[3] if w[3] else float("nan"))
                         for w in self._window_times]
                sends = [t for _, t in means[1:] if math.isfinite(t)]
                self.slack = stage_slack([tb for tb, _ in means],
                                         sum(sends) / len(sends) if sends else 0.0)
                self.time_models = models
                table = aligned_ranks(table, models, self.slack, self.settings.rank_max)
            for f in self._fit:
                for i in range(5):
                    f[i] *= DAC_DECAY
        self._window_times = [[0.0] * 4 for _ in range(self.num_stages)]
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
                "budget_scales": sorted(self._budget_scales.items())
                if self.budget and self._budget_scales is not None else None,
                "dp_table": BudgetRankController._encode_table(self.dp_table)
                if self.budget else self.dp_table, "pp_rank": self.pp_rank,
                "table_version": self.table_version, "dac_fit": self._fit,
                "dac_window_times": self._window_times,
                "time_models": [(m.eta, m.c) for m in self.time_models]
                if self.time_models is not None else None, "slack": self.slack}

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
            self._budget_scales = dict(scales) if scales is not None else None
        self.pp_rank = state.get("pp_rank")
        self.table_version = state.get("table_version", 0)
        if "dac_fit" in state:
            self._fit = [list(f) for f in state["dac_fit"]]
            self._window_times = [list(w) for w in state["dac_window_times"]]
            self.time_models = [LinearTimeModel(e, c) for e, c in state["time_models"]] \
                if state["time_models"] is not None else None
            self.slack = state["slack"]
        self.dp_compression.set_rank(self.dp_table[self.stage])
        if self.pp_controller is not None:
            self.p2p.set_rank(self.pp_rank, self.table_version)
