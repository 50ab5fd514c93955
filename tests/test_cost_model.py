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


def _kernels(totals: dict, entropy_ms: float = 0.0) -> dict:
    runs = [{"rank": r, "factor_dtype": "fp32", "total": t} for r, t in totals.items()]
    entry = {"runs": runs, "entropy": {"per_iteration_ms": entropy_ms}}
    return {"configs": {key: entry for key in CLUSTERS}}


def test_kernel_time_interpolates_between_measured_ranks():
    from bench.model import kernel_s

    k = _kernels({16: 10.0, 32: 20.0, 64: 60.0})
    key = "gpt2-2.5b-v100x32"
    assert kernel_s(k, key, 16) == pytest.approx(0.010)
    assert kernel_s(k, key, 24) == pytest.approx(0.015)
    assert kernel_s(k, key, 48) == pytest.approx(0.040)
    assert kernel_s(k, key, 8) == pytest.approx(0.010)    # held at the ends
    assert kernel_s(k, key, 128) == pytest.approx(0.060)


def test_measured_kernels_add_to_the_compressed_sync():
    cluster = CLUSTERS["gpt2-12.1b-h100x64"]
    schedule = [(None, 0.5), (32, 0.5)]
    bare = predict(cluster, schedule)
    k = _kernels({16: 10.0, 32: 20.0, 64: 60.0}, entropy_ms=1.0)
    r = predict(cluster, schedule, k)
    # half the iterations pay 20 ms of math, every iteration 1 ms of entropy sampling
    assert r["mean_kernel_s"] == pytest.approx(0.5 * 0.020 + 0.001)
    assert r["mean_sync_s"] == pytest.approx(bare["mean_sync_s"])
    assert 1 - r["comm_reduction_kernels"] == pytest.approx(
        (bare["mean_sync_s"] + r["mean_kernel_s"]) / bare["dense_sync_s"])
    # at the reported link the schedule's sync plus its kernels equals dense (to the α terms)
    import dataclasses
    at = predict(dataclasses.replace(cluster, dp_bandwidth_gbit=r["pays_below_gbit"]),
                 schedule, k)
    assert at["mean_sync_s"] + at["mean_kernel_s"] == pytest.approx(at["dense_sync_s"], rel=0.02)


def test_against_bf16_dense_the_crossover_is_where_the_syncs_meet():
    """Against Megatron's --grad-reduce-in-bf16 (2 bytes per element) the link below which
    compression pays is lower than against fp32 dense, and at that link the schedule's
    sync with bf16 factors plus its kernels equals the bf16 dense sync (to the α terms)."""
    import dataclasses

    cluster = CLUSTERS["gpt2-12.1b-h100x64"]
    schedule = [(None, 0.25), (32, 0.75)]
    k = _kernels({16: 10.0, 32: 20.0, 64: 60.0}, entropy_ms=1.0)
    r = predict(cluster, schedule, k)
    assert 0 < r["pays_below_vs_bf16_gbit"] < r["pays_below_gbit"]
    at = predict(dataclasses.replace(cluster, dp_bandwidth_gbit=r["pays_below_vs_bf16_gbit"]),
                 schedule, k)
    assert at["comm_reduction_vs_bf16"] == pytest.approx(0.0, abs=0.02)


def test_the_committed_gpu_kernels_load_for_both_setups():
    """The model's kernels: today's step as the lent H200 timed it (2026-11-26)."""
    from bench.model import load_kernels

    k = load_kernels()
    assert "H200" in k["device"] and k["date"] == "2026-11-26"
    for key, cluster in CLUSTERS.items():
        r = predict(cluster, [(64, 0.5), (16, 0.5)], k)
        assert 0.005 < r["mean_kernel_s"] < 0.2
        assert r["comm_reduction_kernels"] < r["comm_reduction"]
