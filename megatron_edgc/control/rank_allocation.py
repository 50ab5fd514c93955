"""The ``budget`` controller: per-shape DP ranks from a time budget and measured error curves.

An alternative to the paper's CQM (``--edgc-controller budget``), designed from what the
entropy study showed (BENCHMARKS.md, "The entropy question"): the sampled Gaussian entropy
is ``log`` of the local gradient's RMS, which does not fall while a small LM trains, and
under Adam the update is invariant to the gradient's scale anyway, so an entropy (scale)
change says little about how much rank the gradient needs. What does say it is measured
for free by PowerSGD itself: column ``j`` of ``Q_local = Mᵀ P^`` carries the energy the
step captures in basis direction ``j`` (``P^`` is orthonormal), so the sorted column
energies of each matrix shape give its relative residual at every rank up to the current
one (:meth:`BucketCompressor._add_spectrum`).

With those curves the controller spends a fixed time budget where it buys the most
(L-GreCo, Markov et al. 2023, allocates per-layer ranks the same way, offline and by
dynamic programming): minimise ``Σ_g numel_g · ρ_g(r_g)²`` — each shape group's relative
squared residual weighted by its elements, the quantity Adam's per-element normalisation
sees — subject to ``T(r) ≤ budget · T(r_max)``, ``T`` the stage's DP sync time per
iteration under the bypass's cost model: its collectives over the link in force plus the
timed compression math, ``T = fixed + v·Σ_g count_g (n_g + m_g) r_g`` (latency, dense
rest and the math's intercept fixed; bytes and the math's slope per factor element). With
``ρ = fixed / (v·width·r_max)`` the constraint is a byte budget of
``budget − (1 − budget)·ρ`` of the factors at r_max: where the link dominates (ρ → 0)
it is the budget's fraction of the bytes, the ranks spending math to save bytes; where
fixed costs dominate, lower ranks buy little time, and the allocation takes the cheaper
configuration down to ``r_min`` (and the bypass, on the same model, the dense sync where
even that loses). The sorted column
energies make every curve convex, so adding one rank at a time to the group with the best
error saved per byte is optimal (the greedy solution of a separable convex knapsack).

Window by window (EDGC §5's machinery, warm-up unchanged): the first window after warm-up
runs every shape at its largest allowed rank to measure full curves; each later window
end measures every curve up to the rank in force, bounds it above that rank by the last
measured column (:func:`extend_curve`), and reallocates. Every input is all-reduced and
every decision deterministic, so all ranks hold the same table. Pure Python and numpy.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Sequence

from megatron_edgc.compression.matrices import FLOAT_BYTES, is_compressible
from megatron_edgc.control.controller import ControllerSettings, RankController

Shape = tuple  # (n, m)


def max_rank_of(n: int, m: int, rank_max: int, min_compression_rate: float) -> int:
    """The largest rank ``<= rank_max`` at which an ``n x m`` matrix is compressed (0: none)."""
    r = rank_max
    while r >= 1 and not is_compressible(n, m, r, min_compression_rate):
        r -= 1
    return r


def allocate_ranks(groups: Sequence[tuple], captured: Sequence[Sequence[float]],
                   budget_bytes: float, r_min: int, previous: Optional[Sequence[int]] = None,
                   max_step: Optional[int] = None,
                   weights: Optional[Sequence[float]] = None) -> list:
    """Greedy allocation of ranks to shape groups under a byte budget.

    ``groups``: ``(n, m, count, r_hi)`` per group (``r_hi`` its largest allowed rank);
    ``captured[g][r]``: the fraction of the group's energy kept at rank ``r``
    (``r = 0 … r_hi``, non-decreasing). Every group starts at ``min(r_min, r_hi)``; then
    one rank at a time goes to the group whose next rank saves the most weighted error
    per byte, while the budget allows. Ties go to the earlier group. Returns the ranks.

    With ``previous`` ranks and ``max_step``, each group stays within ``max_step`` of its
    previous rank (EDGC's step limit s, §4): it starts at ``previous - max_step`` (or
    ``r_min``) and grows to at most ``previous + max_step``; when even the lowest allowed
    ranks exceed the budget, they are returned (the budget is met a window later).

    ``weights`` (default: each group's element count ``count·n·m``) is what a unit of
    captured-energy fraction is worth per group (``--edgc-budget-weight adam``: the
    group's error as Adam's update sees it, :func:`adam_weights`).
    """
    lo = [min(r_min, g[3]) for g in groups]
    hi = [g[3] for g in groups]
    if previous is not None and max_step is not None:
        lo = [min(max(low, p - max_step), top) for low, p, top in zip(lo, previous, hi)]
        hi = [max(low, min(top, p + max_step)) for low, p, top in zip(lo, previous, hi)]
    ranks = list(lo)
    spent = sum(c * (n + m) * r * FLOAT_BYTES for (n, m, c, _), r in zip(groups, ranks))
    while True:
        best, best_gain = None, 0.0
        for i, ((n, m, count, _), r) in enumerate(zip(groups, ranks)):
            if r >= hi[i]:
                continue
            cost = count * (n + m) * FLOAT_BYTES
            if spent + cost > budget_bytes + 1e-9:
                continue
            weight = count * n * m if weights is None else weights[i]
            gain = weight * (captured[i][r + 1] - captured[i][r]) / cost
            if best is None or gain > best_gain:
                best, best_gain = i, gain
        if best is None:
            return ranks
        n, m, count, _ = groups[best]
        ranks[best] += 1
        spent += count * (n + m) * FLOAT_BYTES


def captured_curve(total: float, column_energies: Sequence[float]) -> list:
    """``[0, c_1/T, (c_1+c_2)/T, …]`` from the sorted column energies, clipped to [0, 1]."""
    out, acc = [0.0], 0.0
    for c in column_energies:
        acc += max(0.0, float(c))
        out.append(min(1.0, acc / total) if total > 0 else 0.0)
    for i in range(1, len(out)):  # monotone against float noise
        out[i] = max(out[i], out[i - 1])
    return out


def extend_curve(fresh: list, r_hi: int) -> list:
    """A captured-energy curve for ranks ``0 … r_hi`` from one measured up to the rank in
    force: above it every step is the last measured one (capped at 1).

    The column energies are sorted, so no unseen column can carry more than the last
    seen one: the extension is an upper bound, which makes the allocation try a higher
    rank wherever the last column still pays, and measure the truth a window later
    (optimism under uncertainty; a stale lower curve would never be revisited). Steps
    that do not increase keep the curve concave, which the greedy allocation needs.
    """
    curve = list(fresh[:r_hi + 1])
    last = curve[-1] - curve[-2] if len(curve) > 1 else 0.0
    while len(curve) < r_hi + 1:
        curve.append(min(1.0, curve[-1] + last))
    return curve


def adam_weights(totals: Sequence[float], scaled: Sequence[float],
                 plain: Sequence[float]) -> Optional[list]:
    """Per-group allocation weights from Adam's view of the error: ``k_g · T_g``.

    ``T_g`` is the group's gradient energy ``Σ‖M‖²`` (the spectrum's total), and
    ``k_g = Σ E²/(√v+ε)² / Σ E²`` the gain of Adam's per-element normalisation on the
    group's current residual ``E`` (``v``: the optimizer's second moment). The error a
    rank leaves in Adam's update is then ``k_g · T_g · (1 − captured_g(r))``, assuming the
    gain does not depend on the rank. Where the residual is spread like the gradient
    (``v ≈ g²``) this is the element count again; it grows where the residual sits on
    elements with a small second moment (rare tokens' embedding rows). None when some
    group has no measured residual (the caller keeps element weights).
    """
    if any(p <= 0 for p in plain):
        return None
    return [t * q / p for t, q, p in zip(totals, scaled, plain)]


def sqrt_lr_scales(lrs: Sequence[float]) -> list:
    """Per-window budget scales ``sqrt(lr_w) / mean_w sqrt(lr_w)`` (mean 1).

    Minimising ``Σ_w lr_w · ε_w`` — each window's compression error weighted by the step
    size that turns it into a weight error — with ``ε ∝ 1 / bytes`` under a fixed total
    gives ``bytes_w ∝ sqrt(lr_w)`` (Lagrange). Measured basis: on the tiny testbed the loss
    gap between static r4 and r8 builds while the LR is high and barely grows in the
    last quarter (BENCHMARKS.md, "The loss–bytes plane").
    """
    roots = [math.sqrt(max(lr, 0.0)) for lr in lrs]
    mean = sum(roots) / len(roots) if roots else 0.0
    return [r / mean if mean > 0 else 1.0 for r in roots]


class BudgetRankController(RankController):
    """Warm-up as the paper's controller; then per-shape ranks from a time budget.

    ``stage_groups[s]`` lists stage ``s``'s compressible matrix shapes as
    ``(n, m, count)``. The table entry of a stage is its shape ranks,
    ``{(n, m): rank}``, or None (dense) during warm-up.
    """

    def __init__(self, settings: ControllerSettings, stage_groups: Sequence[Sequence[tuple]],
                 *, time_budget: float, min_compression_rate: float = 2.0,
                 max_step: Optional[int] = None):
        super().__init__(settings, [None] * len(stage_groups))
        if not 0 < time_budget <= 1:
            raise ValueError(f"time_budget must be in (0, 1], got {time_budget}")
        self.time_budget = time_budget
        #: per stage: its sync's fixed time over its factors' time at r_max (module
        #: docstring; 0 until priced: the budget is then a fraction of the bytes)
        self.fixed_ratio: list = [0.0] * len(stage_groups)
        self.max_step = max_step  # per-shape rank change per window (None: unlimited)
        self.groups = []
        for shapes in stage_groups:
            rows = []
            for n, m, count in shapes:
                hi = max_rank_of(n, m, settings.rank_max, min_compression_rate)
                if hi >= 1:
                    rows.append((int(n), int(m), int(count), hi))
            self.groups.append(sorted(rows))
        # captured[s][g]: fraction of energy kept at rank 0..r_hi (None: never measured)
        self.captured: list = [[None] * len(g) for g in self.groups]
        self.measured_windows = 0
        self.budget_scale = 1.0  # this window's budget / the mean budget (LR schedule)
        # weights[s]: per-group allocation weights (None: element counts), see adam_weights
        self.weights: list = [None] * len(self.groups)

    def shapes_of(self, stage: int) -> list:
        return [(n, m) for n, m, _, _ in self.groups[stage]]

    def full_table(self, stage: int) -> dict:
        return {(n, m): hi for n, m, _, hi in self.groups[stage]}

    def set_time_line(self, stage_lines: Sequence[tuple]) -> None:
        """Each stage's DP sync time as ``(fixed, per rank)`` seconds at uniform ranks (the
        cost model's, :meth:`BypassPlanner.time_line`): the time budget's prices."""
        self.fixed_ratio = [fixed / (slope * self.settings.rank_max) if slope > 0 else 0.0
                            for fixed, slope in stage_lines]

    def byte_fraction(self, stage: int) -> float:
        """The time budget as a fraction of the stage's factor bytes at r_max."""
        f = min(1.0, self.time_budget * self.budget_scale)
        return max(0.0, f - (1.0 - f) * self.fixed_ratio[stage])

    def budget_bytes(self, stage: int) -> float:
        full = sum(c * (n + m) * hi * FLOAT_BYTES for n, m, c, hi in self.groups[stage])
        return self.byte_fraction(stage) * full

    def bytes_of(self, stage: int, table: Optional[dict]) -> Optional[int]:
        """Compressed-factor bytes per iteration of this stage's groups under ``table``."""
        if table is None:
            return None
        return sum(c * (n + m) * table[(n, m)] * FLOAT_BYTES for n, m, c, _ in self.groups[stage])

    def effective_rank(self, stage: int) -> Optional[float]:
        """The uniform rank that would send the same factor bytes as the stage's table."""
        table = self.table[stage]
        if table is None:
            return None
        width = sum(c * (n + m) for n, m, c, _ in self.groups[stage])
        return self.bytes_of(stage, table) / (width * FLOAT_BYTES) if width else 0.0

    def _first_table(self) -> list:
        """Every shape at its largest allowed rank: the first window measures every curve."""
        return [self.full_table(s) for s in range(self.num_stages)]

    def observe_spectrum(self, stage_spectra: Sequence[Sequence[Optional[tuple]]],
                         weights: Optional[Sequence[Optional[list]]] = None) -> None:
        """The window's measured ``(total_energy, sorted column energies)`` per group, in
        :meth:`shapes_of` order (None where a group was not measured), and optionally the
        per-stage allocation weights (None: element counts). Call before the window's
        :meth:`end_iteration`."""
        if weights is not None:
            self.weights = [None if w is None else [float(x) for x in w] for w in weights]
        for s, spectra in enumerate(stage_spectra):
            for g, spec in enumerate(spectra):
                if spec is None:
                    continue
                total, cols = spec
                fresh = captured_curve(total, cols)
                hi = self.groups[s][g][3]
                self.captured[s][g] = extend_curve(fresh, hi)
        self.measured_windows += 1

    def _rank_step(self, means: list) -> None:
        for s in range(self.num_stages):
            curves = self.captured[s]
            if not self.groups[s] or any(c is None for c in curves):
                continue
            table = self.table[s]
            previous = None if table is None else [table[(n, m)] for n, m, _, _ in
                                                   self.groups[s]]
            ranks = allocate_ranks(self.groups[s], curves, self.budget_bytes(s),
                                   self.settings.rank_min, previous, self.max_step,
                                   self.weights[s])
            self.table[s] = {(n, m): r for (n, m, _, _), r in zip(self.groups[s], ranks)}

    # ------------------------------------------------------------------ state

    @staticmethod
    def encode_table(table: list) -> list:
        """A table of per-shape ranks as JSON-able lists ``[[n, m, rank], …]`` per stage
        (the checkpoint form; None stays None)."""
        return [None if t is None else [[n, m, r] for (n, m), r in sorted(t.items())]
                for t in table]

    @staticmethod
    def decode_table(table: list) -> list:
        """Inverse of :meth:`encode_table`."""
        return [None if t is None else {(n, m): r for n, m, r in t} for t in table]

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["table"] = self.encode_table(self.table)
        state.update(captured=copy.deepcopy(self.captured), time_budget=self.time_budget,
                     fixed_ratio=list(self.fixed_ratio),
                     weights=copy.deepcopy(self.weights),
                     measured_windows=self.measured_windows, budget_scale=self.budget_scale,
                     groups=[[list(g) for g in rows] for rows in self.groups])
        return state

    def load_state_dict(self, state: dict) -> None:
        if [[list(g) for g in rows] for rows in self.groups] != state.get("groups"):
            raise ValueError("budget controller state was saved for other matrix shapes")
        state = copy.deepcopy(state)
        state.pop("groups")
        state["table"] = self.decode_table(state["table"])
        super().load_state_dict(state)
