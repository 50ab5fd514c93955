"""CQM: g(r) from the Marchenko–Pastur law, its inverse, the update rule and its clamps."""


import pytest
import torch

from megatron_edgc.control.rank_model import RankModel


@pytest.mark.parametrize("shape", [(1920, 7680), (128, 512), (300, 200), (64, 64)])
def test_g_monotone_from_one_to_zero(shape):
    m = RankModel(*shape)
    k = min(shape)
    values = [m.g(r) for r in range(k + 1)]
    assert values[0] == 1.0 and values[-1] == 0.0
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert all(a > b for a, b in zip(values[:-1], values[1:]))  # strictly, for Gaussian g


def test_g_matches_simulated_gaussian_svd():
    torch.manual_seed(0)
    n, m = 240, 960
    s2 = torch.linalg.svdvals(torch.randn(n, m, dtype=torch.float64)) ** 2
    simulated = (s2.flip(0).cumsum(0).flip(0) / s2.sum()).sqrt()
    model = RankModel(n, m)
    assert max(abs(simulated[r].item() - model.g(r)) for r in range(n)) < 2e-3


@pytest.mark.parametrize("shape", [(1920, 7680), (100, 40)])
def test_inverse_exact_on_the_integer_grid(shape):
    m = RankModel(*shape)
    for r in range(min(shape) + 1):
        assert m.inverse(m.g(r)) == r


def test_sensitivity_figures_of_the_spec():
    """EDGC.md §4: 1920x7680 at r0 = 64, entropy drops of 0.005/0.01/0.03 nats."""
    m = RankModel(1920, 7680)
    unclamped = dict(r_min=1, r_max=1920, step=1920)
    assert m.next_rank(64, 2.0, 2.0 - 0.005, **unclamped) == 56
    assert m.next_rank(64, 2.0, 2.0 - 0.01, **unclamped) == 47
    assert m.next_rank(64, 2.0, 2.0 - 0.03, **unclamped) == 11


def test_update_rule_directions_and_clamps():
    m = RankModel(1920, 7680)
    kw = dict(r_min=16, r_max=64, step=8)
    assert m.next_rank(48, 1.0, 1.0, **kw) == 48                    # no change → same rank
    assert m.next_rank(48, 1.0, 0.99, **kw) < 48                    # entropy down → rank down
    assert m.next_rank(48, 1.0, 1.01, **kw) > 48                    # entropy up → rank up
    assert m.next_rank(48, 1.0, 0.5, **kw) == 40                    # step limit down
    assert m.next_rank(48, 1.0, 1.5, **kw) == 56                    # step limit up
    assert m.next_rank(20, 1.0, 0.5, **kw) == 16                    # r_min
    assert m.next_rank(60, 1.0, 1.5, **kw) == 64                    # r_max
    small = RankModel(1920, 7680)
    assert small.next_rank(64, 1.0, 1.0 - 0.002, r_min=1, r_max=64, step=100) < 64


def test_calibrated_g_is_monotone_and_hits_measurements():
    measured = {8: 0.5, 16: 0.35, 32: 0.2}
    m = RankModel.calibrated(128, 512, measured)
    for r, v in measured.items():
        assert abs(m.g(r) - v) < 1e-12
    vals = [m.g(r) for r in range(129)]
    assert vals[0] == 1.0 and vals[-1] == 0.0
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    # Correlated gradients compress better than Gaussian theory: calibrated g is lower.
    assert m.g(16) < RankModel(128, 512).g(16)
