"""The budget controller at run time (``--edgc-controller budget``, docs/method.md §8):
:class:`BudgetControl` feeds :class:`~megatron_edgc.control.rank_allocation.BudgetRankController`
at every window end after warm-up with the window's column energies per stage and shape
(summed over the job), the optional Adam weights and LR-scheduled budget, and every
stage's DP sync time line from the bypass's cost model.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_edgc.control.controller import ControllerSettings
from megatron_edgc.control.rank_allocation import (BudgetRankController, adam_weights,
                                                   sqrt_lr_scales)
from megatron_edgc.control.rank_control import RankControl


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


class BudgetControl(RankControl):
    """Per-shape DP ranks from a time budget: a table entry is ``{(n, m): rank}`` of the
    stage's compressible shapes. Built by :meth:`build`; fed from this rank's DP
    compression (``optimizer``: for the Adam weights, or None; ``lr_at``: step -> LR)."""

    def __init__(self, controller: BudgetRankController, dp_compression, *, optimizer,
                 lr_at: Optional[Callable], schedule: str, train_iters: int, stage: int,
                 device: torch.device, pipeline=None):
        super().__init__(controller, pipeline=pipeline)
        self.dp_compression, self.optimizer = dp_compression, optimizer
        self.lr_at = lr_at  # step -> LR of the run's schedule (--edgc-budget-schedule lr)
        self.schedule, self.train_iters = schedule, train_iters
        self.rank_max = controller.settings.rank_max
        self.stage, self.device = stage, device
        self.scales: Optional[dict] = None  # window start -> budget scale

    @classmethod
    def build(cls, cfg, settings: ControllerSettings, dp_compression, *, stage: int,
              num_stages: int, device: torch.device, optimizer=None,
              lr_at: Optional[Callable] = None, pipeline=None) -> "BudgetControl":
        """Every stage's shapes gathered over the job (one ``all_gather_object``), the
        spectrum tracked by the DP compression from now on."""
        e = cfg.edgc
        if e.budget_weight == "adam" and optimizer is None:
            raise ValueError("--edgc-budget-weight adam needs the optimizer")
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (stage, sorted(dp_compression.shape_counts().items())))
        stage_groups = [None] * num_stages
        for s, items in gathered:
            if stage_groups[s] is None:
                stage_groups[s] = [(n, m, c) for (n, m), c in items]
        controller = BudgetRankController(
            settings, stage_groups, time_budget=e.time_budget,
            min_compression_rate=e.min_compression_rate,
            max_step=e.rank_step if e.budget_step_limit == "on" else None)
        dp_compression.track_spectrum(True)
        return cls(controller, dp_compression,
                   optimizer=optimizer if e.budget_weight == "adam" else None, lr_at=lr_at,
                   schedule=e.budget_schedule, train_iters=cfg.training.train_iters,
                   stage=stage, device=device, pipeline=pipeline)

    # ------------------------------------------------------------------ RankControl

    def applied_ranks(self, iteration: int, installed: list) -> list:
        """The byte-equivalent uniform rank of each stage's shape ranks."""
        c = self.controller
        return [None if r is None else round(r, 2)
                for r in (c.effective_rank(s) for s in range(self.num_stages))]

    def record(self, installed: list) -> dict:
        return {"budget_scale": self.controller.budget_scale,
                "rank_dp_shapes": [
                    None if t is None else {f"{n}x{m}": r for (n, m), r in sorted(t.items())}
                    for t in installed]}

    def _before_decision(self, iteration: int) -> None:
        if self.is_window_end(iteration) and not self.controller.in_warmup:
            self.observe_spectrum()
            self.price_time()
            self.set_scale(iteration + 1)

    def _warmup_ended(self, iteration: int) -> dict:
        self.plan_scales(iteration + 1 + self.settings.window)  # after the r_max window
        self.price_time()   # measured here (and checkpointed with the DP compression)
        return {}

    def price_time(self) -> None:
        """Window end: every stage's DP sync time line (the bypass's cost model: the link
        in force, refitted or declared, and the timed math), the slowest replica's (MAX
        over the job: one all-reduce), to the controller's time budget."""
        c = self.controller
        lines = torch.zeros(self.num_stages, 2, dtype=torch.float64)
        if c.groups[self.stage]:
            lines[self.stage] = torch.tensor(self.dp_compression.time_line(
                self.rank_max, self.controller.settings.rank_min), dtype=torch.float64)
        lines = lines.to(self.device)
        dist.all_reduce(lines, op=dist.ReduceOp.MAX)
        c.set_time_line([tuple(row) for row in lines.tolist()])

    def _to_ints(self, table: list) -> list:
        """Shape ranks, flattened in every stage's shape order (None for each of a dense
        stage's shapes)."""
        return [None if t is None else t[shape]
                for s, t in enumerate(table) for shape in self.controller.shapes_of(s)]

    def _from_ints(self, values: list, like: list) -> list:
        table, k = [], 0
        for s, t in enumerate(like):
            shapes = self.controller.shapes_of(s)
            table.append(None if t is None else dict(zip(shapes, values[k:k + len(shapes)])))
            k += len(shapes)
        return table

    def encode_table(self, table: list) -> list:
        return BudgetRankController.encode_table(table)

    def decode_table(self, saved: list) -> list:
        return BudgetRankController.decode_table(saved)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "budget_scales": sorted(self.scales.items())
                if self.scales is not None else None}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        scales = state.get("budget_scales")
        self.scales = dict(scales) if scales is not None else None

    # ------------------------------------------------------------------ the feed

    def plan_scales(self, start: int) -> None:
        """At warm-up end: the budget scale of every remaining window (mean 1), from the
        LR schedule at each window's middle; constant schedule: all 1."""
        w, end = self.settings.window, self.train_iters
        if self.schedule != "lr" or self.lr_at is None:
            return
        mids = list(range(start + w // 2, end, w))
        self.scales = dict(zip(range(start, end, w),
                               sqrt_lr_scales([self.lr_at(i) for i in mids])))

    def set_scale(self, next_window_start: int) -> None:
        if self.scales is not None:
            self.controller.budget_scale = self.scales.get(next_window_start,
                                                           self.controller.budget_scale)

    def observe_spectrum(self) -> None:
        """Window end: the window's column energies per stage and shape, summed over the
        job (one all-reduce), to the controller."""
        c = self.controller
        r_max = self.rank_max
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
                    # a stacked experts' entry (name.expertE) has no parameter of its own
                    v = moments.get(id(params[name])) if name in params else None
                    if v is None:
                        continue
                    e2 = g.residual[j].double() ** 2
                    denom = (v.detach().double().view(e2.shape).sqrt() + eps) ** 2
                    acc = out.setdefault(shape, [0.0, 0.0])
                    acc[0] += float((e2 / denom).sum())
                    acc[1] += float(e2.sum())
        return out
