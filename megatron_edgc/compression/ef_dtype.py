"""``--edgc-ef-dtype auto``: the error-feedback residual's dtype per device, from a
measurement at start-up (docs/method.md §8, "bf16 error feedback"): the round trip the
step does on the residual (``M = G + E`` formed, then the local factor and ``E = M − A
Bᵀ`` in one pass, :class:`~megatron_edgc.compression.kernels.ErrorFeedback`) timed on the
model's largest matrices in both dtypes; bf16 where it costs at most
:data:`BF16_MAX_COST` of fp32's on a GPU (its memory is worth it); on the host fp32,
untimed (CPUs convert bf16 in software: BENCHMARKS.md "The error feedback's dtype per
device").
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from megatron_edgc.compression.kernels import ErrorFeedback, ShapeGroup
from megatron_edgc.compression.unit_state import UnitState

#: bf16's error-feedback round trip may cost this much of fp32's, per device kind, and
#: still be chosen: a GPU's memory is worth some time; a host's is not (its bf16 costs
#: 1.3–1.8× there, and a timing under load could flip a run's choice): fp32, untimed.
BF16_MAX_COST = {"cuda": 2.0, "cpu": 1.0}
#: Elements of the timed matrices (the largest shape's, as many as fit; one at least).
SAMPLE_ELEMENTS = 1 << 22
_RANK = 4            # the product's factors; their matmul is not what is compared
_REPEATS = 5


def _round_trip_ms(ef_dtype: torch.dtype, grad_dtype: torch.dtype, shape: tuple,
                   count: int, device: torch.device) -> float:
    """Least ms of one error-feedback round trip on ``count`` matrices of ``shape``,
    with gradients in ``grad_dtype`` (device events on a GPU, the host clock elsewhere)."""
    n, m = shape
    group = ShapeGroup(n, m, list(range(count)), [str(i) for i in range(count)])
    gen = torch.Generator(device=device).manual_seed(0)
    group.residual = torch.randn(count, n, m, device=device, generator=gen).to(ef_dtype)
    source = torch.randn(count, n, m, device=device, generator=gen).to(grad_dtype)
    grads = torch.empty_like(source)
    basis = torch.randn(count, n, _RANK, device=device, generator=gen)
    keep = torch.zeros((), dtype=torch.bool, device=device)
    ef = UnitState(ErrorFeedback(ef_dtype, 64 << 20)).ef   # the unit's rules, as a step
    cuda = device.type == "cuda"
    times = []
    for _ in range(_REPEATS + 1):
        grads.copy_(source)
        views = [(0, count, grads)]
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        else:
            t0 = time.perf_counter()
        ef.form(group, views)
        ef.project_and_take(group, views, basis, True, keep, torch.float32)
        if cuda:
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    return min(times[1:])


def time_ef_dtypes(shapes: Sequence[tuple], grad_dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """``[ms fp32, ms bf16, bf16 / fp32]`` (float64, on the host) of the error-feedback
    round trip on the largest of ``shapes``: as many of them as :data:`SAMPLE_ELEMENTS`
    holds, or a row block of one (an embedding's whole would be gigabytes); zeros
    without shapes."""
    if not shapes:
        return torch.zeros(3, dtype=torch.float64)
    n, m = max(shapes, key=lambda s: s[0] * s[1])
    rows = max(1, min(n, SAMPLE_ELEMENTS // m))
    count = max(1, SAMPLE_ELEMENTS // (rows * m))
    fp32, bf16 = (_round_trip_ms(dtype, grad_dtype, (rows, m), count, device)
                  for dtype in (torch.float32, torch.bfloat16))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return torch.tensor([fp32, bf16, bf16 / fp32], dtype=torch.float64)


def choose_ef_dtype(shapes: Sequence[tuple], grad_dtype: torch.dtype, device: torch.device,
                    agree: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> tuple:
    """``(dtype, ms fp32, ms bf16)``: bf16 where its round trip costs at most
    :data:`BF16_MAX_COST` of fp32's on this kind of device, else fp32. ``agree(times)``
    makes every rank decide alike: the runtime takes the MAX over the job, of each rank's
    ratio too (a rank without matrices times nothing, but joins). Where that limit is 1 or
    less (the host: bf16 halves nothing it lacks), fp32 untimed, so every run there
    decides alike whatever the load."""
    limit = BF16_MAX_COST.get(torch.device(device).type, BF16_MAX_COST["cpu"])
    if limit <= 1.0:
        return torch.float32, 0.0, 0.0
    fp32_ms, bf16_ms, ratio = agree(time_ef_dtypes(shapes, grad_dtype, device)).tolist()
    chosen = torch.bfloat16 if fp32_ms and ratio <= limit else torch.float32
    return chosen, fp32_ms, bf16_ms
