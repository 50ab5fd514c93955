"""EDGC's rank controller: dense warm-up, then window-by-window ranks per pipeline stage.

EDGC §3 (warm-up) and §5 (windows). Fed once per measured iteration with the per-stage
entropies (already averaged over each stage's DP and TP ranks, so identical on every rank
of the job), it returns the rank table: one rank per pipeline stage, or ``None`` for
dense during warm-up. Decisions depend only on what was fed, so every rank that feeds
the same stream holds the same table. Pure Python: no process groups, no megatron.

* Warm-up: dense from iteration 0. At each window end the window-mean entropy of every
  stage is compared with the previous window's; after ``warmup_windows`` consecutive
  windows in which every stage moved by less than ``warmup_eps`` nats (or at
  ``warmup_max_iters``) compression starts at ``r0 = r_max`` with ``H0`` the current
  window's mean. ``dense_max_iters`` bounds the dense part alone: from the first window
  end at or after it, compression runs at ``r_max`` while the rank decisions still wait
  for the stability rule (CQM's entropy-to-rank model holds once the entropy's early
  transient is over; a bounded warm-up that let it act while the entropy still fell
  lowered the rank and cost loss, BENCHMARKS.md "The loss–bytes plane").
* Windows: at each window end ``H1`` = the window's mean → CQM rank
  (:meth:`RankModel.next_rank`); ``H0, r0`` move only when the rank actually changes, so
  slow drifts accumulate. The new table applies from the next iteration.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_edgc.control.rank_model import RankModel


@dataclass
class ControllerSettings:
    window: int = 1000
    iter_sample_rate: float = 0.1
    rank_max: int = 64
    rank_min: Optional[int] = None     # default rank_max // 4
    rank_step: int = 8
    warmup_eps: float = 0.01
    warmup_windows: int = 2
    warmup_max_iters: Optional[int] = None
    dense_max_iters: Optional[int] = None   # the dense part's bound (module docstring)

    def __post_init__(self):
        if self.rank_min is None:
            self.rank_min = max(1, self.rank_max // 4)
        if self.window < 1:
            raise ValueError("window must be >= 1")
        if not 1 <= self.rank_min <= self.rank_max:
            raise ValueError(f"need 1 <= rank_min <= rank_max, got {self.rank_min}, "
                             f"{self.rank_max}")

    @property
    def sample_every(self) -> int:
        return max(1, round(1 / self.iter_sample_rate))


class RankController:
    """The warm-up/window state machine for ``num_stages`` pipeline stages."""

    def __init__(self, settings: ControllerSettings, rank_models: Sequence[RankModel]):
        self.settings = settings
        self.rank_models = list(rank_models)
        self.num_stages = len(self.rank_models)
        self.in_warmup = True
        self.warmup_end_iter: Optional[int] = None
        self.dense_end_iter: Optional[int] = None   # compression from here (r_max)
        self.window_index = 0
        self.window_samples: list[list[float]] = [[] for _ in range(self.num_stages)]
        self.window_means: list[list[float]] = []      # history, one row per window
        self.stable_windows = 0
        self.table: list[Optional[int]] = [None] * self.num_stages
        self.h0: list[Optional[float]] = [None] * self.num_stages
        self.r0: list[Optional[int]] = [None] * self.num_stages

    # ------------------------------------------------------------------ feeding

    def window_of(self, iteration: int) -> int:
        return iteration // self.settings.window

    def should_measure(self, iteration: int) -> bool:
        """GDS iteration sampling: every ``round(1/α)``-th iteration of each window."""
        return (iteration % self.settings.window) % self.settings.sample_every == 0

    def observe(self, iteration: int, stage_entropies: Sequence[float]) -> None:
        assert len(stage_entropies) == self.num_stages
        for s, h in enumerate(stage_entropies):
            if math.isfinite(h):
                self.window_samples[s].append(float(h))

    def end_iteration(self, iteration: int) -> bool:
        """Call after every iteration; at a window end, decide. Returns whether the table
        changed (the new table applies from the next iteration)."""
        w = self.settings.window
        if (iteration + 1) % w:
            return False
        means = [sum(x) / len(x) if x else float("nan") for x in self.window_samples]
        self.window_means.append(means)
        self.window_samples = [[] for _ in range(self.num_stages)]
        self.window_index += 1
        before = list(self.table)
        if self.in_warmup:
            self._warmup_step(iteration, means)
        else:
            self._rank_step(means)
        return self.table != before

    def _warmup_step(self, iteration: int, means: list) -> None:
        st = self.settings
        if len(self.window_means) >= 2:
            prev = self.window_means[-2]
            stable = all(math.isfinite(a) and math.isfinite(b) and abs(a - b) < st.warmup_eps
                         for a, b in zip(means, prev))
            self.stable_windows = self.stable_windows + 1 if stable else 0
        capped = st.warmup_max_iters is not None and iteration + 1 >= st.warmup_max_iters
        if self.stable_windows >= st.warmup_windows or capped:
            self.in_warmup = False
            self.warmup_end_iter = iteration + 1
            if self.dense_end_iter is None:
                self.dense_end_iter = iteration + 1
                self.table = self._first_table()
            self.r0 = [st.rank_max] * self.num_stages
            self.h0 = list(means)
        elif st.dense_max_iters is not None and iteration + 1 >= st.dense_max_iters and \
                self.dense_end_iter is None:
            self.dense_end_iter = iteration + 1
            self.table = self._first_table()

    def _first_table(self) -> list:
        """The table compression starts with: ``r_max`` on every stage."""
        return [self.settings.rank_max] * self.num_stages

    def _rank_step(self, means: list) -> None:
        st = self.settings
        for s, h1 in enumerate(means):
            if not math.isfinite(h1) or self.h0[s] is None or not math.isfinite(self.h0[s]):
                continue
            r1 = self.rank_models[s].next_rank(self.r0[s], self.h0[s], h1, r_min=st.rank_min,
                                               r_max=st.rank_max, step=st.rank_step)
            if r1 != self.r0[s]:
                self.r0[s], self.h0[s] = r1, h1
            self.table[s] = r1

    # ------------------------------------------------------------------ state

    def table_hash(self) -> str:
        """A digest of everything that decides future tables (for cross-rank checks)."""
        return hashlib.sha256(json.dumps(self.state_dict(), sort_keys=True).encode()).hexdigest()

    def state_dict(self) -> dict:
        return copy.deepcopy({
            "in_warmup": self.in_warmup, "warmup_end_iter": self.warmup_end_iter,
            "dense_end_iter": self.dense_end_iter,
            "window_index": self.window_index, "window_samples": self.window_samples,
            "window_means": self.window_means, "stable_windows": self.stable_windows,
            "table": self.table, "h0": self.h0, "r0": self.r0})

    def load_state_dict(self, state: dict) -> None:
        if len(state["table"]) != self.num_stages:
            raise ValueError(f"controller state has {len(state['table'])} stages, this job "
                             f"{self.num_stages}")
        for key, value in copy.deepcopy(state).items():
            setattr(self, key, value)
        if "dense_end_iter" not in state:   # saved before the dense bound existed
            self.dense_end_iter = self.warmup_end_iter
