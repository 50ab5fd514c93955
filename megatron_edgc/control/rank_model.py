"""Compression Quantification Model (CQM, EDGC §4): gradient entropy change → rank change.

``g(r)`` is the relative residual of the best rank-``r`` approximation of an ``n x m``
matrix of i.i.d. zero-mean Gaussian entries::

    g(r) = sqrt( sum_{i > r} λ_i / sum_i λ_i ),   g(0) = 1,  g(min(n, m)) = 0

with ``λ_i`` the expected squared singular values, taken from the Marchenko–Pastur law
for the aspect ratio ``c = min(n, m) / max(n, m)`` (the ``k = min(n, m)`` eigenvalues sit
at the law's quantiles ``(k - i + 1/2) / k``). The absolute compression error is about
``σ·sqrt(nm)·g(r)``; keeping it at its level ``(r0, σ0)`` of the last rank change when σ
moves to σ1, with ``σ0 / σ1 = exp(H0 - H1)`` for Gaussian entropy::

    r1 = g^-1( exp(H0 - H1) · g(r0) )   the smallest integer r with g(r) <= that

then ``|r1 - r0| <= step`` and ``r_min <= r1 <= r_max``. The ``calibrated`` variant
replaces the Gaussian ``g`` by residuals measured on real gradients (monotone fit).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy


def marchenko_pastur_eigenvalues(n: int, m: int) -> numpy.ndarray:
    """Expected eigenvalues of ``X Xᵀ / max(n, m)`` for Gaussian X, descending (k values)."""
    k, big = min(n, m), max(n, m)
    c = k / big
    a, b = (1 - math.sqrt(c)) ** 2, (1 + math.sqrt(c)) ** 2
    # CDF of the MP density on a fine grid, midpoint rule (the density is integrable at
    # both ends, and for square matrices singular like x^-1/2 at 0).
    grid = numpy.linspace(a, b, 400_001)
    mid = (grid[1:] + grid[:-1]) / 2
    density = numpy.sqrt(numpy.clip((b - mid) * (mid - a), 0, None)) / (2 * math.pi * c * mid)
    cdf = numpy.concatenate([[0.0], numpy.cumsum(density * numpy.diff(grid))])
    cdf /= cdf[-1]
    quantiles = (numpy.arange(k, 0, -1) - 0.5) / k       # descending eigenvalues
    return numpy.interp(quantiles, cdf, grid)


class RankModel:
    """``g`` and its inverse for one matrix shape; tabulated on the integer grid."""

    def __init__(self, n: int, m: int, residuals: Optional[Sequence[float]] = None):
        self.n, self.m = int(n), int(m)
        self.k = min(self.n, self.m)
        if residuals is None:
            lam = marchenko_pastur_eigenvalues(self.n, self.m)
            tail = numpy.concatenate([numpy.cumsum(lam[::-1])[::-1], [0.0]])  # sum_{i>r}
            self.table = numpy.sqrt(tail / tail[0])
        else:
            self.table = numpy.asarray(residuals, dtype=float)
            if len(self.table) != self.k + 1:
                raise ValueError(f"need g(0..{self.k}), got {len(self.table)} values")
        self.table[0], self.table[-1] = 1.0, 0.0
        self.table = numpy.minimum.accumulate(self.table)  # monotone non-increasing

    @classmethod
    def calibrated(cls, n: int, m: int, measured: dict) -> "RankModel":
        """``g`` from measured relative residuals ``{rank: residual}`` (EDGC §4 option).

        Between measured ranks the curve is interpolated in log space, from g(0) = 1 to
        g(k) = 0, and made monotone.
        """
        k = min(n, m)
        points = {0: 1.0, **{int(r): float(v) for r, v in measured.items() if 0 < r < k}}
        ranks = numpy.array(sorted(points))
        values = numpy.log(numpy.clip([points[r] for r in ranks], 1e-12, None))
        grid = numpy.arange(k + 1)
        inner = numpy.exp(numpy.interp(grid, ranks, values))
        last = ranks[-1]
        if last < k:  # fall linearly from the last measurement to 0 at full rank
            inner[last:] = points[last] * (k - grid[last:]) / (k - last)
        return cls(n, m, residuals=inner)

    def g(self, r: float) -> float:
        r = min(max(int(r), 0), self.k)
        return float(self.table[r])

    def inverse(self, target: float) -> int:
        """The smallest integer r with g(r) <= target."""
        if target >= 1.0:
            return 0
        return int(numpy.argmax(self.table <= target + 1e-15))

    def next_rank(self, r0: int, h0: float, h1: float, *, r_min: int, r_max: int,
                  step: int) -> int:
        """EDGC's update ``r1 = g^-1(exp(H0 - H1) g(r0))``, step-limited and clamped."""
        target = math.exp(h0 - h1) * self.g(r0)
        r1 = self.inverse(target)
        r1 = max(r0 - step, min(r0 + step, r1))
        return max(r_min, min(r_max, r1))
