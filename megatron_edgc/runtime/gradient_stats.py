"""What the driver measures on the real gradients besides GDS's entropy, per stage and
pooled over the stage's ranks (one all-reduce each):

* ``--edgc-g calibrated`` (EDGC §4): at warm-up end, the rank model's ``g`` from the
  singular values of a dominant-shape gradient (:class:`GCalibration`, the paper
  control's :class:`~megatron_edgc.control.rank_control.Calibration`);
* ``--edgc-grad-stats`` (the entropy study, BENCHMARKS.md): skewness, excess kurtosis and
  the Gaussian entropy per layer type.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_edgc.compression.matrices import matrix_shape
from megatron_edgc.control.entropy import LAYER_TYPES, moments_from_power_sums
from megatron_edgc.control.rank_model import RankModel


def dominant_shape(chunks) -> tuple[int, int]:
    """The matrix shape holding most of this rank's gradient elements (EDGC §4)."""
    totals: dict = {}
    for chunk in chunks:
        for p in chunk.module.parameters():
            n, m = matrix_shape(p.shape)
            if n > 1 and m > 1:
                totals[(n, m)] = totals.get((n, m), 0) + n * m
    return max(totals, key=lambda k: (totals[k], k)) if totals else (1, 1)


def calibrated_rank_models(calib_grad, stage_shapes: list, rank_models: list, *, stage: int,
                           device: torch.device) -> tuple[list, list]:
    """``--edgc-g calibrated``: g from the real gradients at warm-up end (EDGC §4).

    The best rank-r relative residual (singular values) of this rank's gradient of a
    dominant-shape matrix (``calib_grad``, or None), for every r, averaged over the
    stage's ranks, becomes the stage's g (made monotone by :class:`RankModel`). Returns
    ``(rank models, curves)``; a stage without a curve keeps its model in ``rank_models``.
    """
    num_stages = len(stage_shapes)
    k_max = max(min(n, m) for n, m in stage_shapes)
    curves = torch.zeros(2, num_stages, k_max + 1, dtype=torch.float64, device=device)
    if calib_grad is not None:
        s2 = torch.linalg.svdvals(calib_grad.double()) ** 2
        tail = torch.cat([s2.flip(0).cumsum(0).flip(0), s2.new_zeros(1)])
        if tail[0] > 0:
            curves[0, stage, :tail.numel()] = (tail / tail[0]).sqrt()
            curves[1, stage] = 1.0
    dist.all_reduce(curves)
    models, calibrated = [], []
    for s, (n, m) in enumerate(stage_shapes):
        k = min(n, m)
        if curves[1, s, 0] > 0:
            curve = (curves[0, s, :k + 1] / curves[1, s, 0]).tolist()
            models.append(RankModel(n, m, residuals=curve))
        else:
            curve = None
            models.append(rank_models[s])
        calibrated.append(curve)
    return models, calibrated


class GCalibration:
    """``--edgc-g calibrated``: this rank's gradient of one dominant-shape matrix of its
    stage, captured on the measured warm-up iterations (the last one counts), and at
    warm-up end every stage's ``g`` from the captures (:func:`calibrated_rank_models`)."""

    def __init__(self, chunks, dp_compression, stage_shapes: list, *, stage: int,
                 device: torch.device):
        self.stage_shapes, self.stage, self.device = stage_shapes, stage, device
        self.param = next((p for c in chunks for p in c.module.parameters()
                           if matrix_shape(p.shape) == stage_shapes[stage]), None)
        self.bucket = None   # the key of the DDP bucket holding the parameter's gradient
        if self.param is not None:
            ptr = self.param.main_grad.data_ptr()
            self.bucket = next(
                key for key, grad in dp_compression.bucket_grads()
                if grad.data_ptr() <= ptr < grad.data_ptr() + grad.numel() * grad.element_size())
        self.grad: Optional[torch.Tensor] = None

    def capture(self, key: str) -> None:
        if key == self.bucket:
            self.grad = self.param.main_grad.detach().float().view(
                self.stage_shapes[self.stage]).clone()

    def fit(self, rank_models: list) -> tuple[list, list]:
        return calibrated_rank_models(self.grad, self.stage_shapes, rank_models,
                                      stage=self.stage, device=self.device)


def grad_stats(sample_sums: Optional[torch.Tensor], type_sums: torch.Tensor, *, stage: int,
               num_stages: int, device: torch.device) -> dict:
    """``--edgc-grad-stats``: skewness and excess kurtosis of the sampled gradient and
    the Gaussian entropy per layer type, per stage, pooled over the stage's ranks (one
    all-reduce of power sums, so the moments are those of the pooled sample).
    ``sample_sums``: this rank's :func:`power_sums` of its sample (order 4, or None);
    ``type_sums``: its power sums per layer type (:data:`LAYER_TYPES`, order 2)."""
    n_types = len(LAYER_TYPES)
    sums = torch.zeros(num_stages, 5 + 3 * n_types, dtype=torch.float64, device=device)
    if sample_sums is not None:
        sums[stage, :5] = sample_sums
    sums[stage, 5:] = type_sums.view(-1)
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
