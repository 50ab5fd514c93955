"""The budget controller's parts in one process: measured error curves against the SVD
optimum, the greedy allocation against brute force, per-shape ranks in the compressor, and
the controller on scripted spectrum streams (moves, clamps, determinism, state)."""

import itertools
import random

import pytest
import torch

from megatron_edgc.compression.matrices import FLOAT_BYTES
from megatron_edgc.compression.powersgd import BucketCompressor
from megatron_edgc.control.controller import ControllerSettings
from megatron_edgc.control.rank_allocation import (BudgetRankController, adam_weights,
                                                   allocate_ranks, captured_curve, max_rank_of)


def one_rank_step(comp, grads):
    """A DP group of one: the collectives are the identity."""
    bufs, step = comp.start(grads)
    q = comp.middle(step, [b.clone() for b in bufs])
    comp.finish(step, [b.clone() for b in q])
    comp.after_step(applied=True)


def test_measured_curve_matches_the_svd_optimum():
    """Sorted Q column energies give the captured energy at every rank up to the current
    one; on a fixed matrix, after warm-started power steps, it reaches the SVD optimum."""
    torch.manual_seed(0)
    n, m, r = 96, 64, 8
    spectrum = torch.tensor([10.0, 6.0, 4.0, 3.0, 2.0, 1.5, 1.2, 1.0] + [0.3] * 56)
    u, _ = torch.linalg.qr(torch.randn(n, 64))
    v, _ = torch.linalg.qr(torch.randn(m, 64))
    g = (u * spectrum) @ v.T
    comp = BucketCompressor([("w", (n, m))], r, seed=1)
    comp.track_spectrum = True
    for _ in range(12):
        comp.spectrum = {}
        grads = [g.clone()]
        # no error feedback for this check: compare against the plain matrix's optimum
        comp.groups[(n, m)].residual = None if comp.groups[(n, m)].q is None \
            else torch.zeros(1, n, m)
        one_rank_step(comp, grads)
    total, cols, count = comp.spectrum[(n, m)]
    assert count == 1 and abs(total - float((g ** 2).sum())) < 1e-3 * total
    measured = captured_curve(total, cols.tolist())
    s2 = spectrum ** 2
    optimum = [float(s2[:k].sum() / s2.sum()) for k in range(r + 1)]
    for k in range(1, r + 1):
        assert measured[k] <= optimum[k] + 1e-5          # no basis beats the SVD
        assert measured[k] >= optimum[k] - 2e-3, (k, measured[k], optimum[k])
    # and the residual it implies is the error feedback's: ‖E‖² = ‖M‖² − captured(r)
    comp.spectrum = {}
    grads = [g.clone()]
    comp.groups[(n, m)].residual.zero_()
    one_rank_step(comp, grads)
    e = comp.groups[(n, m)].residual[0]
    total, cols, _ = comp.spectrum[(n, m)]
    assert abs(float((e ** 2).sum()) - (total - float(cols.sum()))) < 1e-3 * total


def test_per_shape_ranks_set_bytes_and_keep_state():
    entries = [("a", (64, 32)), ("b", (64, 32)), ("c", (48, 48)), ("bias", (1, 64))]
    comp = BucketCompressor(entries, 8, seed=3)
    grads = [torch.randn(n, m) for _, (n, m) in entries]
    one_rank_step(comp, [g.clone() for g in grads])
    q_before = comp.groups[(64, 32)].q.clone()
    comp.set_rank(8, {(64, 32): 3, (48, 48): 5})
    assert tuple(sum(b) // 4 for b in comp.phase_bytes()) == (2 * 64 * 3 + 48 * 5 + 64 + 1,
                                                           2 * 32 * 3 + 48 * 5)
    assert torch.equal(comp.groups[(64, 32)].q, q_before[:, :, :3])   # trailing columns dropped
    one_rank_step(comp, [g.clone() for g in grads])
    state = comp.state_dict()
    other = BucketCompressor(entries, 8, seed=3)
    other.load_state_dict(state)
    assert other.shape_ranks == {(64, 32): 3, (48, 48): 5}
    assert torch.equal(other.groups[(48, 48)].q, comp.groups[(48, 48)].q)
    # back to uniform: the override is gone, Q regrows with seeded columns
    comp.set_rank(8)
    assert comp.groups[(64, 32)].q.shape == (2, 32, 8) and comp.shape_ranks == {}


def brute_force(groups, curves, budget, r_min):
    best, best_err = None, None
    ranges = [range(min(r_min, hi), hi + 1) for _, _, _, hi in groups]
    for ranks in itertools.product(*ranges):
        cost = sum(c * (n + m) * r * FLOAT_BYTES for (n, m, c, _), r in zip(groups, ranks))
        if cost > budget and any(r > min(r_min, g[3]) for g, r in zip(groups, ranks)):
            continue
        err = sum(c * n * m * (1 - curves[i][r]) for i, ((n, m, c, _), r)
                  in enumerate(zip(groups, ranks)))
        if best_err is None or err < best_err - 1e-12:
            best, best_err = list(ranks), err
    return best, best_err


@pytest.mark.parametrize("seed", range(6))
def test_greedy_allocation_is_optimal_on_convex_curves(seed):
    rng = random.Random(seed)
    groups = [(rng.choice([16, 32, 48]), rng.choice([16, 32]), rng.randint(1, 3), 6)
              for _ in range(3)]
    curves = []
    for _ in groups:  # sorted energies -> concave captured curve (convex error)
        cols = sorted((rng.random() ** 3 for _ in range(6)), reverse=True)
        curves.append(captured_curve(sum(cols) * 1.3, cols))
    full = sum(c * (n + m) * 6 * FLOAT_BYTES for n, m, c, _ in groups)
    for fraction in (0.2, 0.45, 0.7):
        budget = fraction * full
        got = allocate_ranks(groups, curves, budget, r_min=1)
        cost = sum(c * (n + m) * r * FLOAT_BYTES for (n, m, c, _), r in zip(groups, got))
        assert cost <= budget
        want, want_err = brute_force(groups, curves, budget, 1)
        err = sum(c * n * m * (1 - curves[i][r]) for i, ((n, m, c, _), r)
                  in enumerate(zip(groups, got)))
        # greedy on a knapsack may leave a few bytes unused; within one rank step of optimal
        step = max(c * n * m * (curves[i][1] - curves[i][0]) for i, (n, m, c, _)
                   in enumerate(groups))
        assert err <= want_err + step, (got, want)


def test_allocation_clamps():
    groups = [(64, 64, 1, 8), (64, 64, 1, 3)]
    curves = [captured_curve(1.0, [0.1] * 8), captured_curve(1.0, [0.3, 0.2, 0.1])]
    assert allocate_ranks(groups, curves, 0.0, r_min=2) == [2, 2]          # r_min floor
    assert allocate_ranks(groups, curves, 1e12, r_min=1) == [8, 3]         # r_hi ceiling
    assert max_rank_of(128, 128, 64, 2.0) == 32 and max_rank_of(2, 2, 8, 2.0) == 0


def test_step_limited_allocation_moves_at_most_s_per_window():
    groups = [(64, 64, 1, 16), (64, 64, 1, 16), (64, 64, 1, 16)]
    curves = [captured_curve(1.0, [0.5] + [0.01] * 15),     # rank 1 captures it all
              captured_curve(1.0, [0.06] * 16),             # every rank pays
              captured_curve(1.0, [0.03] * 16)]
    per_rank = 128 * FLOAT_BYTES
    free = allocate_ranks(groups, curves, 24 * per_rank, r_min=1)
    assert free[0] == 1 and sum(free) == 24 and free[1] >= 12      # unlimited: jumps
    limited = allocate_ranks(groups, curves, 24 * per_rank, r_min=1, previous=[8, 8, 8],
                             max_step=2)
    assert limited == [6, 10, 8]                # down by s, up by s, the rest where it pays
    # even the lowest allowed ranks exceed the budget: they are kept, not cut further
    assert allocate_ranks(groups, curves, 3 * per_rank, r_min=1, previous=[8, 8, 8],
                          max_step=2) == [6, 6, 6]


SHAPES = [[(512, 128, 4), (8192, 128, 1), (128, 128, 4)], [(384, 128, 4)]]


def make(**kw):
    settings = ControllerSettings(window=4, iter_sample_rate=0.5, rank_max=8, rank_min=1,
                                  rank_step=2, warmup_eps=0.01, warmup_windows=2,
                                  warmup_max_iters=8)
    return BudgetRankController(settings, SHAPES, time_budget=kw.get("budget", 0.5),
                                max_step=kw.get("max_step"))


def energies(decay, r):
    """Column energies c_j = decay^j and a total that leaves 10 % outside rank 8."""
    cols = [decay ** j for j in range(8)]
    return sum(cols) / 0.9, cols[:r]


def drive(c, decay_of, iterations):
    tables = []
    for it in range(iterations):
        tables.append(c.state_dict()["table"])
        if c.should_measure(it):
            c.observe(it, [-5.0, -6.0])
        if (it + 1) % c.settings.window == 0 and not c.in_warmup:
            c.observe_spectrum([[energies(decay_of(s, shape, it), c.table[s][shape])
                                 for g, shape in enumerate(c.shapes_of(s))]
                                for s in range(c.num_stages)])
        c.end_iteration(it)
    return tables


def test_budget_controller_moves_with_the_spectrum():
    c = make()
    # 512x128 gradients are nearly rank one, the others flat: rank moves to the flat ones
    decay = lambda s, shape, it: 0.2 if shape == (512, 128) else 0.95
    tables = drive(c, decay, 24)
    assert all(t == [None, None] for t in tables[:8])
    assert c.warmup_end_iter == 8
    assert tables[8] == [[[128, 128, 8], [512, 128, 8], [8192, 128, 8]], [[384, 128, 8]]]
    final = c.table[0]
    # the concentrated shape sits at 2-3 (the upper-bound extension probes one rank above)
    assert final[(512, 128)] < final[(128, 128)] and final[(512, 128)] <= 3
    assert c.bytes_of(0, final) <= c.budget_bytes(0)
    assert c.effective_rank(0) <= 0.5 * 8 + 1e-9 and c.effective_rank(1) <= 4
    # then the roles swap: 512x128 flattens and the others concentrate; its rank goes up
    c2 = make()
    swap = lambda s, shape, it: ((0.2 if it < 16 else 0.95) if shape == (512, 128)
                                 else (0.95 if it < 16 else 0.2))
    tables = drive(c2, swap, 48)
    assert tables[16][0][1] == [512, 128, final[(512, 128)]]
    assert c2.table[0][(512, 128)] >= final[(512, 128)] + 3, tables[-1]
    assert c2.table[0][(8192, 128)] < tables[16][0][2][2]


def test_time_budget_prices_the_fixed_costs():
    """The budget is time: ``T = fixed + v·width·r``. With no fixed cost it is the budget's
    fraction of the factor bytes at r_max; where latency, the dense rest and the math's
    intercept make a third of T(r_max), a 0.5 budget leaves a quarter of the bytes (the
    cheaper configuration), and where fixed costs reach the budget every shape drops to
    r_min; the allocation then sends fewer bytes, never more."""
    decay = lambda s, shape, it: 0.9
    spent = {}
    for name, lines in (("link", [(0.0, 1e-3), (0.0, 1e-3)]),
                        ("half", [(4e-3, 1e-3), (4e-3, 1e-3)]),
                        ("fixed", [(1.0, 1e-3), (4e-3, 1e-3)])):
        c = make()
        c.set_time_line(lines)
        assert c.fixed_ratio == [f / (v * 8) for f, v in lines]
        drive(c, decay, 24)
        spent[name] = [c.bytes_of(s, c.table[s]) for s in range(2)]
        full = [sum(k * (n + m) * hi * 4 for n, m, k, hi in c.groups[s]) for s in range(2)]
        if name == "link":
            assert [c.byte_fraction(s) for s in range(2)] == [0.5, 0.5]
        if name == "half":
            assert [c.byte_fraction(s) for s in range(2)] == [0.25, 0.25]
        if name == "fixed":
            assert c.byte_fraction(0) == 0.0 and set(c.table[0].values()) == {1}   # r_min
        assert all(b <= max(c.budget_bytes(s), c.bytes_of(s, {
            sh: 1 for sh in c.shapes_of(s)})) for s, b in enumerate(spent[name]))
        assert all(b <= f for b, f in zip(spent[name], full))
    assert spent["half"][0] < spent["link"][0] and spent["fixed"][0] < spent["half"][0]
    assert spent["fixed"][1] == spent["half"][1]          # per stage: its own line


def test_step_limited_budget_controller_moves_by_at_most_s():
    decay = lambda s, shape, it: 0.2 if shape == (512, 128) else 0.95
    free, limited = make(), make(max_step=2)
    free_tables, tables = drive(free, decay, 24), drive(limited, decay, 24)
    jumps = [abs(a[0][1][2] - b[0][1][2]) for a, b in zip(free_tables[8:], free_tables[9:])
             if a and a[0] is not None]
    assert max(jumps) > 2                       # unlimited: 512x128 drops 8 -> 1 at once
    for a, b in zip(tables[8:], tables[9:]):
        for (n, m, ra), (n2, m2, rb) in zip(a[0] + a[1], b[0] + b[1]):
            assert (n, m) == (n2, m2) and abs(ra - rb) <= 2
    assert limited.table[0][(512, 128)] < 8     # still moves where the spectrum says
    assert limited.bytes_of(0, limited.table[0]) <= limited.budget_bytes(0)


def test_extended_curve_is_the_sorted_energies_upper_bound():
    from megatron_edgc.control.rank_allocation import extend_curve
    assert extend_curve([0.0, 0.5, 0.7], 5) == pytest.approx([0.0, 0.5, 0.7, 0.9, 1.0, 1.0])
    assert extend_curve([0.0, 0.5], 1) == [0.0, 0.5]


def test_sqrt_lr_scales_have_mean_one_and_follow_the_lr():
    from megatron_edgc.control.rank_allocation import sqrt_lr_scales
    scales = sqrt_lr_scales([1e-3, 4e-4, 1e-4])
    assert sum(scales) / 3 == pytest.approx(1.0)
    assert scales[0] / scales[2] == pytest.approx(10 ** 0.5)
    c = make()
    c.budget_scale = 1.5
    full = sum(k * (n + m) * 8 * FLOAT_BYTES for n, m, k in SHAPES[0])
    assert c.budget_bytes(0) == pytest.approx(0.75 * full)
    c.budget_scale = 3.0                       # never more than every shape at r_max
    assert c.budget_bytes(0) == pytest.approx(full)


def test_weights_move_rank_to_the_shape_adam_amplifies():
    """Two shapes with identical error curves share the budget evenly by element weight;
    when Adam's gain makes one shape's error weigh 4x, the rank moves to it."""
    groups = [(64, 64, 1, 8), (64, 64, 1, 8)]
    curve = [1 - 0.6 ** r for r in range(9)]
    budget = 8 * (64 + 64) * FLOAT_BYTES           # 8 ranks in all
    assert allocate_ranks(groups, [curve, curve], budget, r_min=1) == [4, 4]
    shifted = allocate_ranks(groups, [curve, curve], budget, r_min=1,
                             weights=[64 * 64, 4 * 64 * 64])
    assert shifted[1] > shifted[0] and sum(shifted) == 8
    # gain per byte equal where 0.6^r0 = 4 * 0.6^r1: r0 - r1 = log 4 / log(1/0.6) ~ 2.7
    assert shifted == [3, 5]


def test_adam_weights_are_element_counts_when_the_residual_looks_like_the_gradient():
    """k·T with v ≈ g² per element recovers the element count; a residual sitting on
    small-v elements (rare rows) weighs more."""
    gen = torch.Generator().manual_seed(0)
    totals, scaled, plain, numels = [], [], [], []
    for n, m, scale in ((64, 32, 1e-3), (128, 32, 5e-2)):
        g = scale * torch.randn(n, m, generator=gen, dtype=torch.float64)
        v = torch.full((n, m), scale ** 2, dtype=torch.float64)
        e = 0.3 * g                                  # residual spread like the gradient
        totals.append(float((g ** 2).sum()))
        scaled.append(float((e ** 2 / v).sum()))
        plain.append(float((e ** 2).sum()))
        numels.append(n * m)
    w = adam_weights(totals, scaled, plain)
    assert w == pytest.approx(numels, rel=0.15)
    # the same residual energy on rows whose second moment is 100x smaller
    skewed = adam_weights(totals, [scaled[0] * 100, scaled[1]], plain)
    assert skewed[0] == pytest.approx(100 * w[0]) and skewed[1] == w[1]
    assert adam_weights(totals, scaled, [plain[0], 0.0]) is None


def test_budget_controller_weights_round_trip():
    c = make()
    weights = [[float(i + 1) for i in range(len(g))] for g in c.groups]
    c.observe_spectrum([[None] * len(g) for g in c.groups], weights=weights)
    state = c.state_dict()
    fresh = make()
    assert fresh.weights == [None, None]
    fresh.load_state_dict(state)
    assert fresh.weights == weights and fresh.state_dict() == state
