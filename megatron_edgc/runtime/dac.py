"""DAC at run time (EDGC §6, docs/method.md §6): per-stage sync-time fits ``T_s(r) = η_s r +
c_s`` from the probes after warm-up (first half of the window at ``r_max``, second at
``r_min``), refitted at every window end (decayed by :data:`DAC_DECAY`), and the aligned DP
rank table (:func:`~megatron_edgc.control.stage_alignment.aligned_ranks`) from per-stage
means over the job, so every rank computes the same table. :class:`StageTimeFits` is the
:class:`~megatron_edgc.control.rank_control.TableAlignment` the paper's control carries.
"""

from __future__ import annotations

import math
from typing import Optional

from megatron_edgc.control.stage_alignment import LinearTimeModel, aligned_ranks, stage_slack

#: Weight of older windows in the DAC least-squares sums (per window).
DAC_DECAY = 0.5


def probe_rank(iteration: int, warmup_end_iter: Optional[int], settings) -> Optional[int]:
    """DAC's probe: the window after warm-up runs r_max, then r_min (all stages)."""
    end = warmup_end_iter
    if end is None or not end <= iteration < end + settings.window:
        return None
    first_half = iteration - end < settings.window // 2
    return settings.rank_max if first_half else settings.rank_min


class StageTimeFits:
    """The decayed least-squares sums of every stage's (rank, DP-sync time) pairs and the
    current window's backward and send times; :meth:`align` turns them into ranks.
    ``settings`` (the controller's): the probe's ranks and window, and ``r_max``."""

    def __init__(self, num_stages: int, settings=None):
        self.num_stages = num_stages
        self.settings = settings
        self.sums = [[0.0] * 5 for _ in range(num_stages)]          # n, Σr, Σt, Σr², Σrt
        self.window_times = [[0.0] * 4 for _ in range(num_stages)]  # Σt_b, n, Σt_p2p, n
        self.models: Optional[list] = None   # LinearTimeModel per stage, after a fit
        self.slack: Optional[list] = None    # Δ_s (ms) of the last aligned window

    def observe(self, ranks: list, stage_times: dict) -> None:
        """One iteration: the DP rank in force per stage and the per-stage mean times
        (``dp_sync_ms``, ``t_b_ms``, ``t_p2p_ms``; NaN where a stage has none). A stage
        whose buckets left their steady path (``dp_switch_share`` > 0: the bypass explored
        the other choice, or a bucket absorbed its residuals going dense) synced at no
        rank's steady time: its sync time is left out of the fit."""
        switched = stage_times.get("dp_switch_share") or [0.0] * self.num_stages
        for s in range(self.num_stages):
            r, t = ranks[s], stage_times["dp_sync_ms"][s]
            if r is not None and math.isfinite(t) and not switched[s] > 0:
                f = self.sums[s]
                f[0] += 1.0
                f[1] += r
                f[2] += t
                f[3] += r * r
                f[4] += r * t
            w = self.window_times[s]
            for i, key in ((0, "t_b_ms"), (2, "t_p2p_ms")):
                v = stage_times[key][s]
                if math.isfinite(v):
                    w[i] += v
                    w[i + 1] += 1.0

    def fit(self) -> Optional[list]:
        """``T_s(r) = η_s r + c_s`` from the decayed least-squares sums. A stage whose
        recent ranks do not spread enough to fit a slope keeps its previous model; None
        until every stage has had one (the probe window provides it)."""
        models = []
        for s, (n, sr, st, srr, srt) in enumerate(self.sums):
            var = srr - sr * sr / n if n else 0.0
            if n >= 2 and var > 1e-6 * n:
                eta = (srt - sr * st / n) / var
                models.append(LinearTimeModel(eta, (st - eta * sr) / n))
            elif self.models is not None:
                models.append(self.models[s])
            else:
                return None
        return models

    def align(self, table: list, rank_max: int) -> list:
        """Window end: the CQM ``table`` raised by each stage's slack (unchanged until every
        stage has a fit); the sums then decay by :data:`DAC_DECAY`."""
        models = self.fit()
        if models is not None:
            means = [(w[0] / w[1] if w[1] else 0.0, w[2] / w[3] if w[3] else float("nan"))
                     for w in self.window_times]
            sends = [t for _, t in means[1:] if math.isfinite(t)]
            self.slack = stage_slack([tb for tb, _ in means],
                                     sum(sends) / len(sends) if sends else 0.0)
            self.models = models
            table = aligned_ranks(table, models, self.slack, rank_max)
        for f in self.sums:
            for i in range(5):
                f[i] *= DAC_DECAY
        return table

    def new_window(self) -> None:
        self.window_times = [[0.0] * 4 for _ in range(self.num_stages)]

    def probe_rank(self, iteration: int, warmup_end_iter: Optional[int]) -> Optional[int]:
        """The probe window's rank of every stage (:func:`probe_rank`), or None."""
        return probe_rank(iteration, warmup_end_iter, self.settings)

    def window_end(self, table: list) -> list:
        """Window end: the table aligned (once compression runs), and a new window."""
        if table[0] is not None:
            table = self.align(table, self.settings.rank_max)
        self.new_window()
        return table

    def record(self) -> dict:
        """Telemetry of the last fit (empty before the first)."""
        if self.models is None:
            return {}
        return {"dac_eta_ms": [m.eta for m in self.models],
                "dac_c_ms": [m.c for m in self.models], "dac_slack_ms": self.slack}

    def state_dict(self) -> dict:
        return {"dac_fit": self.sums, "dac_window_times": self.window_times,
                "time_models": [(m.eta, m.c) for m in self.models]
                if self.models is not None else None, "slack": self.slack}

    def load_state_dict(self, state: dict) -> None:
        if "dac_fit" in state:
            self.sums = [list(f) for f in state["dac_fit"]]
            self.window_times = [list(w) for w in state["dac_window_times"]]
            self.models = [LinearTimeModel(e, c) for e, c in state["time_models"]] \
                if state["time_models"] is not None else None
            self.slack = state["slack"]
