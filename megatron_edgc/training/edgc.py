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

    def before_step(self, iteration: int) -> None:
        self._measuring = self.controller.should_measure(iteration)
        self._window = self.controller.window_of(iteration)
        self._samples = []
        self.entropy_ms = 0.0
        self.last_entropies = None

    def after_step(self, iteration: int) -> dict:
        record = {}
        if self._measuring:
            t0 = time.perf_counter()
            local = estimate_entropy(torch.cat(self._samples), self.cfg.edgc.entropy) \
                if self._samples else float("nan")
            self.entropy_ms += (time.perf_counter() - t0) * 1e3
            sums = torch.zeros(2, self.num_stages, dtype=torch.float64, device=self.device)
            if local == local and abs(local) != float("inf"):
                sums[0, self.stage], sums[1, self.stage] = local, 1.0
            dist.all_reduce(sums)
            entropies = [(sums[0, s] / sums[1, s]).item() if sums[1, s] > 0 else float("nan")
                         for s in range(self.num_stages)]
            self.controller.observe(iteration, entropies)
            self.last_entropies = entropies
            record["entropy"] = entropies
            record["entropy_ms"] = self.entropy_ms
        window_end = (iteration + 1) % self.settings.window == 0
        if self.controller.end_iteration(iteration) or window_end:
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
        return {"controller": self.controller.state_dict(), "stage_shapes": self.stage_shapes}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        self.dp_compression.set_rank(self.controller.table[self.stage])
