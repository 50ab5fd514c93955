"""Gradient Data Sampler (GDS, EDGC §2): cheap gradient entropy.

Two levels of sampling: inside a window only every ``round(1/α)``-th iteration is
measured (iteration sampling rate α, default 0.1), and on those a ``β`` fraction of the
stage's gradient elements (gradient sampling rate β, default 0.25), chosen by a seeded
index set that is the same on every DP rank and redrawn each window.

Estimators of the differential entropy (nats):

* ``gaussian`` (the paper's model): ``H = ½ ln(2πe σ̂²)`` from the sample's std;
* ``histogram``: the plug-in estimate ``-Σ p_i ln(p_i / Δ)`` over equal-width bins, for
  the skewed, heavy-tailed gradients of early training.

The local estimate is averaged over the DP group by the caller (one scalar all-reduce),
so every DP rank of a stage takes the same decision.

A step's sample is never assembled: :class:`SampledEntropy` reduces each chunk's sample
to its count, mean and variance on the device as the chunk's gradient is ready, and the
Gaussian entropy comes from their combination when it is read (the histogram estimator
alone needs the samples themselves and keeps them).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

ESTIMATORS = ("gaussian", "histogram")


def gaussian_entropy(sample: torch.Tensor) -> float:
    """Differential entropy of a Gaussian with the sample's variance, in nats."""
    var = sample.float().var(unbiased=True).item()
    if not var > 0.0:
        return float("-inf")
    return 0.5 * math.log(2 * math.pi * math.e * var)


def histogram_entropy(sample: torch.Tensor, bins: Optional[int] = None) -> float:
    """Plug-in differential entropy from a histogram (Freedman–Diaconis-free: sqrt(N) bins)."""
    x = sample.double().flatten()
    n = x.numel()
    if n < 2:
        return float("-inf")
    lo, hi = x.min().item(), x.max().item()
    if not hi > lo:
        return float("-inf")
    bins = bins or max(10, int(math.sqrt(n)))
    counts = torch.histc(x, bins=bins, min=lo, max=hi)
    width = (hi - lo) / bins
    p = counts[counts > 0] / n
    return float(-(p * torch.log(p / width)).sum().item())


def estimate_entropy(sample: torch.Tensor, estimator: str = "gaussian") -> float:
    if estimator == "gaussian":
        return gaussian_entropy(sample)
    if estimator == "histogram":
        return histogram_entropy(sample)
    raise ValueError(f"unknown entropy estimator {estimator!r} (choose {', '.join(ESTIMATORS)})")


class GradientSampler:
    """Which gradient elements of one stage are measured (which iterations: the
    controller's :meth:`~megatron_edgc.control.controller.RankController.should_measure`).

    ``numel`` is the number of gradient elements of the stage (this rank's shard);
    indices depend only on ``(seed, window)``, so all DP ranks draw the same set.
    """

    def __init__(self, numel: int, *, grad_sample_rate: float = 0.25, seed: int = 0,
                 estimator: str = "gaussian"):
        if not 0 < grad_sample_rate <= 1:
            raise ValueError(f"grad_sample_rate must be in (0, 1], got {grad_sample_rate}")
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown entropy estimator {estimator!r}")
        self.numel = int(numel)
        self.grad_sample_rate = grad_sample_rate
        self.seed = seed
        self.estimator = estimator
        self._window = None
        self._indices: Optional[torch.Tensor] = None

    def indices(self, window: int, device=None) -> Optional[torch.Tensor]:
        """The window's element indices on ``device`` (None = all elements, when β = 1).

        ``round(β·numel)`` seeded draws, one in each of as many equal strata of the
        elements, ``⌊(i·numel + U{0..numel−1}) / count⌋`` (every element drawn with
        probability β, as by a uniform draw, with less variance): in order by construction,
        so the gather reads memory in order with no sort, and drawn on the gradients'
        device in O(count) (a host draw and sort of GPT-2 medium's
        89M took 3.3 s per window on the H100). The same on every DP rank, redrawn each
        window. Elements, not blocks: gradient buffers are too structured for block
        samples (measured: 256-element blocks gave 4x the error on real gradients).
        """
        if self.grad_sample_rate >= 1.0:
            return None
        device = torch.device("cpu" if device is None else device)
        if self._window != window or self._indices.device != device:
            count = max(2, int(round(self.grad_sample_rate * self.numel)))
            gen = torch.Generator(device=device).manual_seed(
                (self.seed * 1_000_003 + window) & ((1 << 63) - 1))
            offset = torch.randint(self.numel, (count,), device=device, generator=gen)
            if count * self.numel < 1 << 62:
                self._indices = (torch.arange(count, device=device) * self.numel
                                 + offset) // count
            else:   # i·numel would pass int64: the same strata in float64
                self._indices = ((torch.arange(count, device=device, dtype=torch.float64)
                                  + offset / self.numel) * (self.numel / count)).long()
            self._window = window
        return self._indices

    def sample(self, flat_grad: torch.Tensor, window: int) -> torch.Tensor:
        idx = self.indices(window, flat_grad.device)
        if idx is None:
            return flat_grad
        return flat_grad.index_select(0, idx)


def gaussian_entropy_of(variance: torch.Tensor) -> torch.Tensor:
    """``½ ln(2πe σ²)`` of a variance tensor, on its device: ``-inf`` at 0, NaN below 0 or
    at NaN (:func:`gaussian_entropy` without the host read)."""
    return 0.5 * torch.log(variance * (2 * math.pi * math.e))


class SampledEntropy:
    """One entropy stream of one step (a stage's DP gradient buckets, or the pipeline's
    outgoing activation gradient): the GDS sample of each chunk (``samplers[key]``),
    reduced on the chunk's device as the chunk arrives.

    Per key a slot holds the sample's count, mean and variance about that mean (one fused
    ``var_mean`` over the fp32 sample, whatever the gradient's dtype); :meth:`variance`
    combines the slots in float64 (Chan et al.'s parallel formula:
    ``M2 = Σ_k n_k σ_k² + Σ_k n_k (μ_k − μ)²``, every term non-negative, so no
    cancellation whatever the gradient's mean; raw power sums ``Σx² − (Σx)²/n`` in fp32
    would lose ``(μ/σ)²·2⁻²⁴`` of the variance). Memory: three float64 per key, however
    many elements or chunks are sampled; no value crosses to the host. A key added twice
    in a step (a re-run schedule) is combined into its slot.

    ``estimator="histogram"`` needs the samples themselves: they are kept and
    concatenated when read. ``moments=True`` (the entropy study) also sums
    ``[n, Σx, …, Σx⁴]`` of the samples in float64 (:meth:`power_sums`).
    """

    def __init__(self, samplers: dict, estimator: str = "gaussian", moments: bool = False):
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown entropy estimator {estimator!r}")
        self.samplers = samplers
        self.estimator = estimator
        self.slot_of = {key: i for i, key in enumerate(samplers)}
        self.moments = moments
        self._slots: Optional[torch.Tensor] = None   # [keys, 3]: n, mean, variance (float64)
        self._filled: set = set()                    # keys added since the last reset
        self._samples: list = []                     # the histogram estimator's
        self._power_sums: Optional[torch.Tensor] = None

    def reset(self) -> None:
        """Forget the step's chunks (before a step)."""
        if self._filled and self._slots is not None:
            self._slots.zero_()
        self._filled.clear()
        self._samples = []
        self._power_sums = None

    def add(self, key, flat_grad: torch.Tensor, window: int,
            scale: Optional[torch.Tensor] = None) -> None:
        """Sample ``flat_grad`` (the chunk ``key``, window ``window``'s index set) and
        reduce the sample into the key's slot; device work only. ``scale``: the loss scale
        the gradients carry (float ``[1]`` on the device; None: 1): the sample is taken
        net of it, so the entropy is the gradients' own whatever the scale (a Gaussian's
        would move by ``ln s`` at every change of an fp16 run's scale)."""
        sample = self.samplers[key].sample(flat_grad, window).float()
        if scale is not None:
            sample = sample / scale
        if sample.numel() == 0:
            return
        if self.estimator == "histogram":
            self._samples.append(sample)
        if self.moments:
            sums = power_sums(sample)
            self._power_sums = sums if self._power_sums is None else self._power_sums + sums
        if self._slots is None or self._slots.device != sample.device:
            self._slots = torch.zeros(len(self.slot_of), 3, dtype=torch.float64,
                                      device=sample.device)
        var, mean = torch.var_mean(sample, correction=0)
        stats = torch.stack([mean, var]).double()
        chunk = torch.cat([stats.new_full((1,), float(sample.numel())), stats])
        i = self.slot_of[key]
        if key in self._filled:   # a second chunk of this key this step: combine the two
            chunk = _combine(torch.stack([self._slots[i], chunk]))
        self._slots[i] = chunk
        self._filled.add(key)

    def variance(self) -> Optional[torch.Tensor]:
        """The unbiased variance of every sample added since the last reset (float64, on
        the device), or None when nothing was added."""
        if not self._filled:
            return None
        n, _, var = _combine(self._slots)
        return var * (n / (n - 1))

    def entropy(self, device) -> torch.Tensor:
        """The step's entropy estimate (nats, float64, 0-dim, on ``device``): NaN when
        nothing was sampled; non-finite when the gradient is constant or not finite."""
        if self.estimator == "histogram":
            h = histogram_entropy(torch.cat(self._samples)) if self._samples else math.nan
            return torch.tensor(h, dtype=torch.float64).to(device)
        var = self.variance()
        if var is None:
            return torch.full((), math.nan, dtype=torch.float64, device=device)
        return gaussian_entropy_of(var).to(device)

    def power_sums(self) -> Optional[torch.Tensor]:
        """``[n, Σx, Σx², Σx³, Σx⁴]`` of the step's samples (``moments=True``), or None."""
        return self._power_sums


def _combine(slots: torch.Tensor) -> torch.Tensor:
    """``[n, mean, population variance]`` of the union of the rows' parts (float64)."""
    n, mean, var = slots.unbind(-1)
    total = n.sum()
    mu = (n * mean).sum() / total
    m2 = (n * var).sum() + (n * (mean - mu) ** 2).sum()
    return torch.stack([total, mu, m2 / total])


# ---------------------------------------------------------------------- the entropy study

#: Parameter classes of a GPT model for per-layer-type entropy (``--edgc-grad-stats``).
LAYER_TYPES = ("embedding", "attention", "mlp", "norm")


def layer_type(name: str) -> str:
    """The class of a megatron-core GPT parameter from its name."""
    if "embedding" in name or "output_layer" in name:
        return "embedding"
    if "self_attention" in name and "layernorm" not in name:
        return "attention"
    if ".mlp." in name and "layernorm" not in name:
        return "mlp"
    return "norm"


def power_sums(x: torch.Tensor, order: int = 4) -> torch.Tensor:
    """``[n, Σx, Σx², …, Σx^order]`` in float64 on ``x``'s device (additive over ranks and
    chunks; no host read)."""
    x = x.detach().double().flatten()
    out = [torch.full((), float(x.numel()), dtype=torch.float64, device=x.device)]
    p = x
    for k in range(order):
        if k:
            p = p * x
        out.append(p.sum())
    return torch.stack(out)


def moments_from_power_sums(sums) -> dict:
    """Mean, variance, skewness and excess kurtosis from :func:`power_sums` (order 4),
    and the Gaussian entropy of that variance; NaN where there are too few elements."""
    n, s1, s2, s3, s4 = (float(v) for v in sums[:5])
    nan = float("nan")
    if n < 2:
        return {"mean": nan, "var": nan, "skew": nan, "kurt": nan, "entropy": nan}
    mu = s1 / n
    m2 = s2 / n - mu * mu
    m3 = s3 / n - 3 * mu * s2 / n + 2 * mu ** 3
    m4 = s4 / n - 4 * mu * s3 / n + 6 * mu * mu * s2 / n - 3 * mu ** 4
    if not m2 > 0:
        return {"mean": mu, "var": 0.0, "skew": nan, "kurt": nan, "entropy": float("-inf")}
    return {"mean": mu, "var": m2, "skew": m3 / m2 ** 1.5, "kurt": m4 / m2 ** 2 - 3.0,
            "entropy": 0.5 * math.log(2 * math.pi * math.e * m2)}
