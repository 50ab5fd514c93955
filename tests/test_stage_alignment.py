"""DAC math on synthetic timings."""

import pytest

from megatron_edgc.control.stage_alignment import (LinearTimeModel, aligned_ranks, stage_slack)


def test_fit_exact_and_noisy():
    m = LinearTimeModel.fit([8, 16, 32], [0.010 + 0.001 * r for r in (8, 16, 32)])
    assert m.eta == pytest.approx(0.001) and m.c == pytest.approx(0.010)
    noisy = LinearTimeModel.fit([8, 8, 32, 32], [0.017, 0.019, 0.041, 0.043])
    assert noisy.eta == pytest.approx(0.001) and noisy.c == pytest.approx(0.010)
    flat = LinearTimeModel.fit([16, 16], [0.02, 0.03])
    assert flat.eta == 0.0 and flat.c == pytest.approx(0.025)


def test_slack():
    assert stage_slack([0.010, 0.012, 0.011, 0.009], 0.002) == pytest.approx(
        [0.0, 0.012, 0.026, 0.039])


def test_aligned_ranks():
    models = [LinearTimeModel(0.001, 0.010)] * 4       # 1 ms per rank, 10 ms fixed
    slack = stage_slack([0.008] * 4, 0.001)             # 0, 9, 18, 27 ms
    ranks = aligned_ranks([16, 16, 16, 16], models, slack, r_max=64)
    assert ranks[0] == 16                               # stage 0 keeps its CQM rank
    assert ranks == [16, 25, 34, 43]                    # later stages rise with their slack
    # Never below the CQM rank (a slow stage), never above r_max (a lot of slack).
    slow = [LinearTimeModel(0.001, 0.010), LinearTimeModel(0.004, 0.030)]
    assert aligned_ranks([16, 20], slow, [0.0, 0.001], r_max=64) == [16, 20]
    assert aligned_ranks([16, 16], models[:2], [0.0, 1.0], r_max=64) == [16, 64]
    # A stage whose time does not grow with rank spends its slack at r_max.
    assert aligned_ranks([16, 16], [models[0], LinearTimeModel(0.0, 0.01)], [0.0, 0.01],
                         r_max=32) == [16, 32]
