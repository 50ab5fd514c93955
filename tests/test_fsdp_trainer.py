"""The trainer under Megatron-FSDP HSDP (issue 94): 4 gloo processes, 2 instances x 2 inner
DP (DP4 TP1 PP1), dense (``--edgc-mode off``) and the outer hop compressed
(``--edgc-mode static``), launched as the other trainer tests launch it."""

import math

import pytest

from distributed import read_jsonl, run_job

ITERS = 6
RANK = 4


def fsdp_argv(small_model_argv, strategy: str) -> list:
    return small_model_argv + [
        "--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
        "--global-batch-size", "16",   # 2 micro-batches a step
        "--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2",
        "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--data-parallel-sharding-strategy", strategy,
        "--train-iters", str(ITERS), "--eval-interval", "100", "--eval-iters", "1",
        "--log-interval", str(ITERS)]


@pytest.fixture(scope="module")
def fsdp_job(small_model_argv, tmp_path_factory):
    """``run(strategy, mode)``: one job each, run once for the module: (results, records)."""
    jobs = {}

    def run(strategy, mode):
        if (strategy, mode) not in jobs:
            tmp = tmp_path_factory.mktemp(f"{strategy}-{mode}")
            metrics = str(tmp / "metrics.jsonl")
            extra = ["--edgc-mode", mode] + (["--edgc-rank", str(RANK)] if mode != "off"
                                             else [])
            results = run_job(fsdp_argv(small_model_argv, strategy) + extra +
                              ["--metrics-file", metrics], str(tmp / "out"))
            jobs[strategy, mode] = (results, read_jsonl(metrics))
        return jobs[strategy, mode]
    return run


def assert_instances_identical(results) -> int:
    """Ranks of the same inner DP rank (one per instance) hold the same weights, bit for
    bit (their outer hop gave both the same sum). Returns the tensors compared."""
    by_inner = {}
    for r in results:
        by_inner.setdefault(r["inner_dp"], []).append(r)
    compared = 0
    for members in by_inner.values():
        assert len(members) == 2
        a, b = members[0]["params"], members[1]["params"]
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].equal(b[name]), name
            compared += 1
    return compared


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_dense_megatron_fsdp_trains(strategy, fsdp_job):
    results, records = fsdp_job(strategy, "off")
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, losses
    assert assert_instances_identical(results) > 0
    for r in records:   # Megatron-FSDP's own: the outer hop as dense as it sends it
        assert r["dp_slow_hop_bytes_sent"] == r["dp_slow_hop_bytes_dense"] > 0
        assert r["dp_bytes_sent"] == r["dp_bytes_dense"] > r["dp_slow_hop_bytes_sent"]


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_static_compresses_the_outer_hop(strategy, fsdp_job):
    _, dense = fsdp_job(strategy, "off")
    results, records = fsdp_job(strategy, "static")
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    for d, r in zip(dense, records):
        assert r["dp_slow_hop_bytes_dense"] == d["dp_slow_hop_bytes_sent"]
        assert r["dp_slow_hop_bytes_sent"] < d["dp_slow_hop_bytes_sent"] / 2, (r, d)
        assert r["rank_dp"] == [RANK]
    losses, dense_losses = [r["loss"] for r in records], [d["loss"] for d in dense]
    assert all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(dense_losses[0], abs=1e-6)   # same weights at step 1
    # measured at iteration 6 (7.62 at the start): no_shard 7.0167 vs dense 7.0225,
    # optim_grads_params 7.0153 vs 7.0229 (|diff| <= 0.008); tolerance about 6x that
    assert abs(losses[-1] - dense_losses[-1]) < 0.05, (losses, dense_losses)
    assert losses[-1] < losses[0] - 0.3
    assert assert_instances_identical(results) > 0
    state = results[0]["compression"]
    assert state["rank"] == RANK and state["buckets"]
