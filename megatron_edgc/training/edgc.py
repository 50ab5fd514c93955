"""EDGC in the training loop: sampled entropy → controller → rank of this stage's DP sync.

Every iteration the loop calls :meth:`EdgcDriver.before_step` and
:meth:`EdgcDriver.after_step`. On the iterations GDS measures, each rank samples a
``β`` fraction of its local gradient elements (``entropy_probe`` of the DP patch, before
the sync), estimates the entropy, and one all-reduce over the whole job averages the
estimates per pipeline stage (over its DP and TP ranks). Every rank therefore feeds the
same per-stage entropies to its own :class:`RankController` and holds the same rank table
(``--edgc-check-table`` verifies that with a hash at each window end). The entry of this
rank's stage is handed to the DP compression; ``None`` (warm-up) means dense.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_edgc.compression.powersgd import matrix_shape
from megatron_edgc.controller import ControllerSettings, RankController
from megatron_edgc.entropy import GradientSampler, estimate_entropy
from megatron_edgc.rank_model import RankModel


class RankTableMismatch(RuntimeError):
    pass


def dominant_shape(chunks) -> tuple[int, int]:
    """The matrix shape holding most of this rank's gradient elements (EDGC §4)."""
    totals: dict = {}
    for chunk in chunks:
        for p in chunk.module.parameters():
            n, m = matrix_shape(p.shape)
            if n > 1 and m > 1:
                totals[(n, m)] = totals.get((n, m), 0) + n * m
    return max(totals, key=lambda k: (totals[k], k)) if totals else (1, 1)


class EdgcDriver:
    def __init__(self, cfg, chunks, dp_compression, *, stage: int, num_stages: int,
                 device: torch.device):
        e = cfg.edgc
        self.cfg, self.dp_compression = cfg, dp_compression
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
        self.controller = RankController(self.settings,
                                         [RankModel(n, m) for n, m in self.stage_shapes])
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

    # ------------------------------------------------------------------ per iteration

    def _probe(self, key: str, grad: torch.Tensor) -> None:
        if self._measuring:
            t0 = time.perf_counter()
            self._samples.append(self.samplers[key].sample(grad.view(-1), self._window).float())
            self.entropy_ms += (time.perf_counter() - t0) * 1e3
            if key == self._calib_bucket and self.controller.in_warmup:
                self._calib_grad = self._calib_param.main_grad.detach().float().view(
                    self.stage_shapes[self.stage]).clone()
        if self.cfg.edgc.entropy_reference:
            t0 = time.perf_counter()
            self._full_entropies.append(grad.detach().view(-1).float().clone())  # pre-sync
            self.full_entropy_ms += (time.perf_counter() - t0) * 1e3

    def before_step(self, iteration: int) -> None:
        self._measuring = self.controller.should_measure(iteration)
        self._window = self.controller.window_of(iteration)
        self._samples = []
        self._full_entropies = []
        self.entropy_ms = 0.0
        self.full_entropy_ms = 0.0
        self.last_entropies = None

    def _stage_mean(self, local: float) -> list:
        """Average a per-rank scalar over each stage's ranks (one all-reduce, all ranks)."""
        sums = torch.zeros(2, self.num_stages, dtype=torch.float64, device=self.device)
        if local == local and abs(local) != float("inf"):
            sums[0, self.stage], sums[1, self.stage] = local, 1.0
        dist.all_reduce(sums)
        return [(sums[0, s] / sums[1, s]).item() if sums[1, s] > 0 else float("nan")
                for s in range(self.num_stages)]

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

    def after_step(self, iteration: int) -> dict:
        record = {}
        if self.cfg.edgc.entropy_reference and self._full_entropies:
            t0 = time.perf_counter()
            full = estimate_entropy(torch.cat(self._full_entropies), self.cfg.edgc.entropy)
            self.full_entropy_ms += (time.perf_counter() - t0) * 1e3
            record["entropy_full"] = self._stage_mean(full)
            record["entropy_full_ms"] = self.full_entropy_ms
        if self._measuring:
            t0 = time.perf_counter()
            local = estimate_entropy(torch.cat(self._samples), self.cfg.edgc.entropy) \
                if self._samples else float("nan")
            self.entropy_ms += (time.perf_counter() - t0) * 1e3
            entropies = self._stage_mean(local)
            self.controller.observe(iteration, entropies)
            self.last_entropies = entropies
            record["entropy"] = entropies
            record["entropy_ms"] = self.entropy_ms
        window_end = (iteration + 1) % self.settings.window == 0
        was_warmup = self.controller.in_warmup
        changed = self.controller.end_iteration(iteration)
        if was_warmup and not self.controller.in_warmup and self.cfg.edgc.g == "calibrated":
            self._calibrate()
            record["g_calibrated"] = self.calibrated_g
        if changed or window_end:
            if self.cfg.edgc.check_table:
                self.check_table()
            self.dp_compression.set_rank(self.controller.table[self.stage])
        if window_end:
            record["entropy_window_mean"] = self.controller.window_means[-1]
        record["rank_table"] = list(self.controller.table)
        record["edgc_warmup"] = self.controller.in_warmup
        if self.controller.warmup_end_iter is not None:
            record["warmup_end_iter"] = self.controller.warmup_end_iter
        return record

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
                "calibrated_g": self.calibrated_g}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        if state.get("calibrated_g"):
            self.calibrated_g = state["calibrated_g"]
            self.controller.rank_models = [
                RankModel(n, m, residuals=c) if c is not None else model
                for (n, m), c, model in zip(self.stage_shapes, self.calibrated_g,
                                            self.controller.rank_models)]
        self.dp_compression.set_rank(self.controller.table[self.stage])
