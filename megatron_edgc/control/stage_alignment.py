"""Dynamic Alignment Compressor (DAC, EDGC §6): per-stage ranks that finish together.

In 1F1B the last micro-batch's backward runs from stage p-1 down to stage 0, so stage s
finishes its backward earlier than stage 0 by::

    Δ_s = Σ_{j<s} t_b,j + s · t_p2p

(``t_b,j`` the mean micro-batch backward time of stage j, ``t_p2p`` the backward send).
Stage 0's DP gradient sync starts last and ends the iteration. Each stage's compressed
sync time is modelled as ``T_s(r) = η_s r + c_s`` (least squares on measured (rank, time)
pairs), and every later stage spends its slack on a higher rank::

    r_s = clamp( floor((T_0(r_0) + Δ_s - c_s) / η_s),  lower = r_s(CQM),  upper = r_max )

Stage 0 keeps its CQM rank. Pure Python: the caller measures and shares the timings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass
class LinearTimeModel:
    """``T(r) = eta * r + c`` (seconds), fitted by least squares."""

    eta: float
    c: float

    @classmethod
    def fit(cls, ranks: Sequence[float], times: Sequence[float]) -> "LinearTimeModel":
        if len(ranks) != len(times) or not ranks:
            raise ValueError("need matching, non-empty rank and time lists")
        n = len(ranks)
        mr, mt = sum(ranks) / n, sum(times) / n
        var = sum((r - mr) ** 2 for r in ranks)
        if var == 0:  # one distinct rank: no slope information
            return cls(0.0, mt)
        eta = sum((r - mr) * (t - mt) for r, t in zip(ranks, times)) / var
        return cls(eta, mt - eta * mr)

    def predict(self, rank: float) -> float:
        return self.eta * rank + self.c


def stage_slack(backward_times: Sequence[float], p2p_time: float) -> list[float]:
    """``Δ_s`` for every stage: how much earlier than stage 0 stage s finishes backward."""
    slack, acc = [], 0.0
    for s in range(len(backward_times)):
        slack.append(acc + s * p2p_time)
        acc += backward_times[s]
    return slack


def aligned_ranks(cqm_ranks: Sequence[int], models: Sequence[LinearTimeModel],
                  slack: Sequence[float], r_max: int) -> list[int]:
    """EDGC §6's per-stage ranks: stage 0 keeps its CQM rank; stage s takes the largest
    rank whose sync ends when stage 0's does, never below its CQM rank nor above r_max."""
    if not (len(cqm_ranks) == len(models) == len(slack)):
        raise ValueError("one CQM rank, time model and slack per stage")
    deadline = models[0].predict(cqm_ranks[0])  # stage 0's sync, measured from its start
    ranks = [int(cqm_ranks[0])]
    for s in range(1, len(cqm_ranks)):
        m = models[s]
        budget = deadline + slack[s] - m.c
        if m.eta <= 0:
            r = r_max if budget >= 0 else cqm_ranks[s]
        else:
            r = math.floor(budget / m.eta)
        ranks.append(int(max(cqm_ranks[s], min(r_max, r))))
    return ranks
