"""The paper-scale cost model's arithmetic (bench/model.py), against hand-computed values."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.model import (CLUSTERS, allreduce_s, parse_schedule, predict,  # noqa: E402
                         shard_matrices, sync_bytes)


def test_shard_and_bytes():
    mats, rest = shard_matrices(layers=2, hidden=64, ffn=256, vocab=1024, tp=2, pp=1)
    assert mats[:4] == [(96, 64), (64, 32), (128, 64), (64, 128)] and mats[-1] == (512, 64)
    dense, second = sync_bytes(mats, rest, None, 4)
    assert second == 0 and dense == (sum(n * m for n, m in mats) + rest) * 4
    p, q = sync_bytes(mats, rest, 8, 4)
    # every matrix here passes (n+m)·8·2 <= n·m, so all go as P (n·8) and Q (m·8)
    assert p == (sum(n * 8 for n, _ in mats) + rest) * 4
    assert q == sum(m * 8 for _, m in mats) * 4


def test_ring_formula_and_schedule():
    assert allreduce_s(1e9, 4, 8.0, 10.0) == pytest.approx(6 * 1e-5 + 1.5 * 1e9 / 1e9)
    assert allreduce_s(1e9, 1, 8.0, 10.0) == 0.0
    assert parse_schedule("dense:0.5,32:0.5") == [(None, 0.5), (32, 0.5)]
    with pytest.raises(ValueError, match="sum to 1"):
        parse_schedule("32:0.7")


def test_dense_schedule_saves_nothing_and_rank_saves_bytes():
    cluster = CLUSTERS["gpt2-2.5b-v100x32"]
    dense = predict(cluster, [(None, 1.0)])
    assert dense["comm_reduction"] == pytest.approx(0.0, abs=1e-12)
    assert dense["time_reduction"] == pytest.approx(0.0, abs=1e-12)
    assert dense["params"] == pytest.approx(2.49e9, rel=0.01)
    low = predict(cluster, [(32, 1.0)])
    assert 0.8 < low["comm_reduction"] < 1.0 and low["rows"][0][4] < dense["dense_bytes"] / 10
    # at the reported break-even link, dense sync would be 35 % of the iteration
    b = dense["breakeven_gbit"]
    import dataclasses
    slow = predict(dataclasses.replace(cluster, dp_bandwidth_gbit=b), [(None, 1.0)])
    assert slow["sync_share_dense"] == pytest.approx(0.35, rel=1e-6)
