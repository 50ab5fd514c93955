"""Pay only when it pays (docs/running.md, "Pay only when it pays"): a bucket goes dense when
its compressed sync, each collective over an alpha-beta link ``t(b) = α + b·β`` plus the
compression math, is predicted slower than one all-reduce of the whole bucket in the
dense wire dtype. The same prices make the budget controller's time budget. The figures
are reduced (MAX) over the DP group, so every replica decides alike
(:mod:`megatron_edgc.patches.bypass_planner` decides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class LinkModel:
    """All-reduce time of a buffer of ``b`` bytes on the DP group: ``alpha_s + b · s_per_byte``."""

    alpha_s: float
    s_per_byte: float

    def allreduce_s(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.s_per_byte

    @property
    def gbit_per_s(self) -> float:
        """Payload rate of the all-reduce (bytes of the buffer, not of the wire)."""
        return 8e-9 / self.s_per_byte if self.s_per_byte > 0 else float("inf")

    @classmethod
    def declared(cls, gbit_per_s: float, alpha_s: float = 0.0) -> "LinkModel":
        if gbit_per_s <= 0:
            raise ValueError(f"link rate must be > 0 Gbit/s, got {gbit_per_s}")
        return cls(alpha_s, 8e-9 / gbit_per_s)

    @classmethod
    def fit(cls, sizes: Sequence[float], times: Sequence[float]) -> "LinkModel":
        """Least squares through (bytes, seconds); α and β clamped at 0 (noise on a fast
        link can tilt a two-point fit below zero)."""
        if len(sizes) != len(times) or len(sizes) < 2:
            raise ValueError("need at least two (size, time) measurements")
        n = len(sizes)
        mx, my = sum(sizes) / n, sum(times) / n
        sxx = sum((x - mx) ** 2 for x in sizes)
        if sxx <= 0:
            raise ValueError("measurements need two different sizes")
        beta = max(0.0, sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx)
        alpha = max(0.0, my - beta * mx)
        return cls(alpha, beta)


def compressed_sync_s(link: LinkModel, wire_bytes, math_s: float) -> float:
    """A compressed sync's time: each of its collectives over ``link`` (``wire_bytes``,
    one entry per collective: each pays its latency) plus the compression math. The
    dense sync is ``link.allreduce_s(dense bytes)``; compression pays where it is less."""
    return sum(link.allreduce_s(b) for b in wire_bytes) + math_s


def link_from_collectives(previous: LinkModel, nbytes: Sequence[float],
                          busy_s: Sequence[float]) -> LinkModel:
    """The link a window of the job's own transfers saw (issue 44): ``nbytes`` of each and
    the seconds the link was busy with it.

    Where the sizes span at least 2x (a compressed bucket's factors and its ``Q``, dense
    buckets beside compressed ones), α and β are fitted to them by least squares: the
    job's own per-collective overhead is then α, not the start-up probes'. Otherwise (one
    size, or a fit tilted to β = 0 by noise) α is kept from ``previous`` and the per-byte
    time is what the rest of the busy time paid for the bytes, ``β = (Σt − nα) / Σb``;
    where ``nα`` would explain more than half of the busy time (a window of small
    messages), α is taken as that half instead."""
    if len(nbytes) != len(busy_s) or not nbytes:
        raise ValueError("need one busy time per transfer, and at least one")
    total_b, total_t, n = float(sum(nbytes)), float(sum(busy_s)), len(nbytes)
    if total_b <= 0 or total_t <= 0:
        return previous
    if min(nbytes) > 0 and max(nbytes) >= 2 * min(nbytes):
        fitted = LinkModel.fit(nbytes, busy_s)
        if fitted.s_per_byte > 0:
            return fitted
    alpha = min(previous.alpha_s, 0.5 * total_t / n)
    return LinkModel(alpha, (total_t - n * alpha) / total_b)
