"""PowerSGD on megatron-core's DP gradient sync, 4 gloo processes."""

import math

import pytest
import torch

from distributed import (LAYOUTS, assert_dp_replicas_identical, compressed_bucket_bytes,
                         read_jsonl, run_job, slow_hop_shard_bytes)
from megatron_edgc.config import parse_config
from megatron_edgc.model_shapes import stage_param_shapes

RANK = 4


@pytest.fixture(scope="module")
def job(small_model_argv, tmp_path_factory):
    """``run(flags)``: one trainer job of ``small_model_argv + flags`` for the module,
    ``(results, records, output dir)``. Tests that assert different things about the same
    configuration pass the same flags and share its one job (issue 71: ``make test``'s
    time)."""
    jobs = {}

    def run(flags):
        key = tuple(flags)
        if key not in jobs:
            tmp = tmp_path_factory.mktemp("job")
            metrics = str(tmp / "m.jsonl")
            results = run_job(small_model_argv + list(flags) + ["--metrics-file", metrics],
                              str(tmp / "out"))
            jobs[key] = (results, read_jsonl(metrics), str(tmp / "out"))
        return jobs[key]
    return run


#: TP1·PP2·DP2 for 10 iterations, dense (megatron-core's own sync): run once, asserted on
#: by test_off_is_untouched_megatron_and_start_iter_switches and by the bypass's test.
OFF_10 = LAYOUTS["tp1-pp2-dp2"] + ["--train-iters", "10", "--edgc-mode", "off"]


def static_from_5(layout: str, wire: str) -> list:
    """10 iterations of ``layout``, static rank 4 from iteration 5 (4 dense iterations:
    ``--edgc-start-iter 4``), the dense sync on ``wire``. TP1·PP2·DP2 on the fp32 wire is
    run once and asserted on by the bf16 dense wire's test and by
    test_off_is_untouched_megatron_and_start_iter_switches."""
    return LAYOUTS[layout] + ["--train-iters", "10", "--edgc-mode", "static", "--edgc-rank",
                              str(RANK), "--edgc-start-iter", "4", "--edgc-dense-wire", wire]


def expected_bytes(result: dict, rank: int, factor_bytes: int = 2, dense_bytes: int = 4) -> int:
    """From the shapes of each DP bucket of one rank's ``result``
    (:func:`distributed.compressed_bucket_bytes`)."""
    return sum(compressed_bucket_bytes(shapes, rank, factor_bytes, dense_bytes)
               for shapes in result["bucket_shapes"])


#: Overlapped reduce and the distributed optimizer together (the version-compat run's DP case).
DP_LAYOUTS = {**LAYOUTS, "tp1-pp2-dp2-overlap-distopt": LAYOUTS["tp1-pp2-dp2-overlap"]
              + ["--use-distributed-optimizer"]}


#: P and Q travel in bf16 by default: factor bytes are half of fp32's, the dense rest and
#: the flag stay fp32, replicas stay bit-identical. The overlapped layout sends fp32
#: factors (``--edgc-factor-dtype fp32``).
FP32_LAYOUT = "tp1-pp2-dp2-overlap"


@pytest.mark.parametrize("layout", [k for k in DP_LAYOUTS if "interleaved" not in k])
def test_static_rank_trains_with_bytes_from_shapes(layout, small_model_argv, tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    fp32 = layout == FP32_LAYOUT
    results = run_job(small_model_argv + DP_LAYOUTS[layout] + [
        "--edgc-mode", "static", "--edgc-rank", str(RANK), "--metrics-file", metrics]
        + (["--edgc-factor-dtype", "fp32"] if fp32 else []), str(tmp_path / "out"))
    records = read_jsonl(metrics)
    losses = [r["loss"] for r in records]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    if "dp1" not in layout:
        assert assert_dp_replicas_identical(results) > 0
    # The logging rank is the last stage, DP rank 0, TP rank 0.
    logger = next(r for r in results if r["pp"] == 1 and r["dp"] == 0 and r["tp"] == 0)
    if "dp1" in layout:  # a DP group of one: nothing to send, nothing approximated
        assert all(r["dp_bytes_sent_job"] == r["dp_bytes_dense_job"] == 0 for r in records)
        assert all(r["rank_dp"] is None for r in records)        # nothing compressed
        return
    factor_bytes = 4 if fp32 else 2
    want = expected_bytes(logger, RANK, factor_bytes)
    want_job = sum(expected_bytes(r, RANK, factor_bytes) for r in results)
    if not fp32:
        assert want < expected_bytes(logger, RANK, 4)
    for rec in records:
        assert rec["dp_bytes_sent"] == want
        assert rec["dp_bytes_sent_job"] == want_job
        assert rec["dp_bytes_dense"] >= 4 * sum(t.numel() for t in logger["params"].values())
        assert rec["rank_dp"] == [RANK, RANK]
        assert rec["dp_bytes_sent"] < rec["dp_bytes_dense"] / 4
    # The start-up check's shapes (from the config alone) are the model's: weight matrices
    # exactly, and the element count of every stage.
    cfg = parse_config(small_model_argv + DP_LAYOUTS[layout] + ["--edgc-mode", "static"])
    predicted = stage_param_shapes(cfg.model, cfg.parallel, cfg.data.tokenizer_vocab_size)
    for r in results:
        real = [tuple(t.shape) for t in r["params"].values()]
        assert sorted(s for s in real if len(s) == 2) == \
            sorted(s for s in predicted[r["pp"]] if len(s) == 2), (r["tp"], r["pp"])
        assert sum(t.numel() for t in r["params"].values()) == \
            sum(math.prod(s) for s in predicted[r["pp"]])


def test_grad_reduce_in_bf16_halves_the_dense_bytes_and_edgc_compresses_its_buffers(
        small_model_argv, tmp_path):
    """``--bf16 --grad-reduce-in-bf16`` (Megatron-LM's flag): the dense sync carries half
    the bytes of the fp32 reduce, and PowerSGD on those bf16 buffers (no fp32 copy of them)
    sends the bytes its shapes give, keeps the DP replicas bit-identical, and ends within
    0.1 nats of the dense bf16 run's loss; its start-up line names the gradient dtype."""
    layout = LAYOUTS["tp1-pp2-dp2-distopt"] + ["--bf16"]
    runs = {}
    # The fp32 reduce's run is asserted on for its bytes alone, which are the buffers'
    # (the same every iteration): 4 iterations instead of 20 (issue 71: make test's time).
    for name, flags in (("fp32-reduce", ["--edgc-mode", "off", "--train-iters", "4"]),
                        ("bf16-reduce", ["--edgc-mode", "off", "--grad-reduce-in-bf16"]),
                        ("static", ["--grad-reduce-in-bf16", "--edgc-mode", "static",
                                    "--edgc-rank", str(RANK)])):
        metrics = str(tmp_path / f"{name}.jsonl")
        results = run_job(small_model_argv + layout + flags + ["--metrics-file", metrics],
                          str(tmp_path / name))
        runs[name] = (results, read_jsonl(metrics))
    fp32_bytes = runs["fp32-reduce"][1][-1]["dp_bytes_sent_job"]
    assert runs["bf16-reduce"][1][-1]["dp_bytes_sent_job"] * 2 == fp32_bytes
    results, records = runs["static"]
    assert assert_dp_replicas_identical(results) > 0
    logger = next(r for r in results if r["pp"] == 1 and r["dp"] == 0 and r["tp"] == 0)
    # the dense rest travels as the buffers do, in bf16, with the factors: one collective
    assert all(rec["dp_bytes_sent"] == expected_bytes(logger, RANK, dense_bytes=2)
               for rec in records)
    assert all(rec["dp_collectives"] == 2 * len(logger["bucket_shapes"]) for rec in records)
    assert all(rec["rank_dp"] == [RANK, RANK] for rec in records)
    dense_loss = runs["bf16-reduce"][1][-1]["val_loss"]
    assert records[-1]["val_loss"] < records[0]["loss"] - 1.0
    assert abs(records[-1]["val_loss"] - dense_loss) < 0.1, (records[-1]["val_loss"], dense_loss)
    assert "(bf16 gradients," in open(tmp_path / "static" / "stdout.txt").read()


@pytest.mark.parametrize("layout", ["tp1-pp2-dp2", "tp1-pp2-dp2-overlap"])
def test_bf16_dense_wire_halves_the_dense_sync_and_saves_a_collective(layout, job):
    """``--edgc-dense-wire bf16`` on fp32 buffers: before compression starts (the warm-up's
    place) each bucket is one bf16 all-reduce, half the bytes of megatron-core's fp32 one;
    compressed, the dense rest joins the bf16 factors: 2 collectives per bucket instead
    of 3, the bytes the shapes give; the replicas stay bit-identical and the loss within
    0.05 of the fp32 wire's; with --overlap-grad-reduce (several buckets, each synced
    during backward) too."""
    (res32, rec32, _), (res16, rec16, _) = (job(static_from_5(layout, wire))
                                            for wire in ("grad", "bf16"))
    assert assert_dp_replicas_identical(res16) > 0
    logger = next(r for r in res16 if r["pp"] == 1 and r["dp"] == 0 and r["tp"] == 0)
    buckets = len(logger["bucket_shapes"])
    for a, b in zip(rec32[:4], rec16[:4]):    # dense: megatron-core's, then ours in bf16
        assert a["dp_collectives"] == b["dp_collectives"] == buckets
        assert b["dp_bytes_sent"] * 2 == a["dp_bytes_sent"] == a["dp_bytes_dense"]
        assert b["rank_dp"] is None
    for a, b in zip(rec32[4:], rec16[4:]):    # compressed
        assert (a["dp_collectives"], b["dp_collectives"]) == (3 * buckets, 2 * buckets)
        assert a["dp_bytes_sent"] == expected_bytes(logger, RANK)
        assert b["dp_bytes_sent"] == expected_bytes(logger, RANK, dense_bytes=2)
    assert rec16[0]["loss"] == rec32[0]["loss"]
    assert abs(rec16[-1]["loss"] - rec32[-1]["loss"]) < 0.05


def test_off_is_untouched_megatron_and_start_iter_switches(job):
    """Mode off and a patched-but-dense run are bit-identical; compression starts at
    --edgc-start-iter and changes the trajectory from there on. (The start at 4 is the
    run the bf16 dense wire's test compares with: rank 4, the fp32 wire, run once; it was
    rank 8 from 5 before issue 71, the same assertions.)"""
    runs = {}
    for name, flags in {"off": OFF_10,
                        "late": LAYOUTS["tp1-pp2-dp2"] + [
                            "--train-iters", "10", "--edgc-mode", "static",
                            "--edgc-start-iter", "10"],
                        "at4": static_from_5("tp1-pp2-dp2", "grad")}.items():
        res, records, _ = job(flags)
        runs[name] = ([r["loss"] for r in records], res, records)
    off_losses, off_res, _ = runs["off"]
    assert runs["late"][0] == off_losses                  # bitwise, 10 iterations
    for a, b in zip(off_res, runs["late"][1]):
        for name, t in a["params"].items():
            assert torch.equal(t, b["params"][name]), name
    at4 = runs["at4"][0]
    assert at4[:4] == off_losses[:4] and at4[4:] != off_losses[4:]
    recs = runs["at4"][2]
    assert all(r["dp_bytes_sent"] == r["dp_bytes_dense"] for r in recs[:4])
    assert all(r["dp_bytes_sent"] < r["dp_bytes_dense"] for r in recs[4:])


def test_nonfinite_bucket_leaves_error_feedback_untouched(small_model_argv, tmp_path):
    """A NaN on one DP rank: decided on the device, the bucket's gradient is non-finite on
    both of its DP ranks (the optimizer sees it, as with dense), and every rank's
    error-feedback state is exactly what it was after the clean iteration 4."""
    base = small_model_argv + LAYOUTS["tp1-pp2-dp2"] + ["--edgc-mode", "static",
                                                        "--edgc-rank", str(RANK)]
    clean = run_job(base + ["--train-iters", "4"], str(tmp_path / "clean"))
    metrics = str(tmp_path / "nan.jsonl")
    poisoned = run_job(["--inject-nan-at", "4"] + base + ["--train-iters", "5",
                                                          "--metrics-file", metrics],
                       str(tmp_path / "nan"))
    last = read_jsonl(metrics)[-1]
    assert last["iteration"] == 5
    assert math.isnan(last["grad_norm"])            # the optimizer sees it, as with dense
    assert all(torch.isnan(b["grad_buffers"][0]).any() for b in poisoned)  # every replica
    for a, b in zip(clean, poisoned):
        for key, bucket in a["compression"]["buckets"].items():
            other = b["compression"]["buckets"][key]
            for name, mat in bucket["matrices"].items():
                assert torch.equal(mat["residual"], other["matrices"][name]["residual"]), name
                assert torch.equal(mat["q"], other["matrices"][name]["q"]), name
    # The stage the NaN was injected into flags it on both of its DP ranks; the logging
    # rank (last stage) reports it when it is that stage.
    assert last["dp_nonfinite_buckets"] >= 1


def test_bypass_sends_dense_when_compression_does_not_pay(job):
    """--edgc-bypass auto: on a declared very fast link every bucket goes dense and training
    is bit-identical to plain megatron-core; on a declared very slow link every bucket is
    compressed (bytes from the shapes); measured, the link and the decisions agree on every
    DP replica. (10 iterations since issue 71, 6 before: the dense run is the one
    test_off_is_untouched_megatron_and_start_iter_switches asserts on, run once.)"""
    static = LAYOUTS["tp1-pp2-dp2"] + ["--train-iters", "10", "--edgc-mode", "static",
                                       "--edgc-rank", str(RANK), "--edgc-bypass", "auto"]
    runs = {}
    for name, flags in {"off": OFF_10,
                        "fast": static + ["--edgc-link-gbps", "1e6"],
                        "slow": static + ["--edgc-link-gbps", "1e-6"],
                        "measured": static}.items():
        res, records, _ = job(flags)
        runs[name] = (records, res)
    off, fast, slow, measured = (runs[k][0] for k in ("off", "fast", "slow", "measured"))
    assert [r["loss"] for r in fast] == [r["loss"] for r in off]
    for a, b in zip(runs["off"][1], runs["fast"][1]):
        for name, t in a["params"].items():
            assert torch.equal(t, b["params"][name]), name
    assert all(r["dp_bytes_sent"] == r["dp_bytes_dense"] and r["dp_bypassed_buckets"] == 1
               for r in fast)
    logger = next(r for r in runs["slow"][1] if r["pp"] == 1 and r["dp"] == 0)
    want = expected_bytes(logger, RANK)
    for r in slow:
        assert r["dp_bytes_sent"] == want and r["dp_bypassed_buckets"] == 0
        assert r["dp_predicted_saving_ms"] > 1e3 * r["dp_predicted_cost_ms"] > 0
    assert [r["loss"] for r in slow] != [r["loss"] for r in off]
    assert_dp_replicas_identical(runs["measured"][1])
    assert all(0 < r["dp_link_gbps"] < 1e4 for r in measured)
    assert all(r["dp_bytes_sent"] in (want, r["dp_bytes_dense"]) for r in measured)


#: MoE on DP 4 (PP 1): 4 experts, EP 2 (each expert on 2 replicas), top-2, alltoall.
MOE = ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
       "--num-experts", "4", "--expert-model-parallel-size", "2"]


def test_moe_experts_compressed_over_expert_dp_with_bytes_from_shapes(small_model_argv,
                                                                      tmp_path):
    """The trainer's MoE model: dense buckets over DP (4), expert buckets over expert-DP
    (2); the bytes of each from the shapes, experts' replicas bit-identical, the loss falls,
    and the start-up check's predicted shapes are the model's."""
    metrics = str(tmp_path / "m.jsonl")
    results = run_job(small_model_argv + MOE + [
        "--edgc-mode", "static", "--edgc-rank", str(RANK), "--metrics-file", metrics],
        str(tmp_path / "out"))
    records = read_jsonl(metrics)
    losses = [r["loss"] for r in records]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert assert_dp_replicas_identical(results) > 0
    assert sorted((r["ep"], r["dp"]) for r in results) == [(0, 0), (0, 2), (1, 1), (1, 3)]
    logger = next(r for r in results if r["dp"] == 0)
    dense = expected_bytes(logger, RANK)
    expert = expected_bytes({"bucket_shapes": logger["expert_bucket_shapes"]}, RANK)
    assert logger["expert_bucket_shapes"] and expert > 0
    # each EP rank holds other experts of the same shapes: the job sends 4 x one rank's
    want_job = sum(expected_bytes(r, RANK) + expected_bytes(
        {"bucket_shapes": r["expert_bucket_shapes"]}, RANK) for r in results)
    assert want_job == 4 * (dense + expert)
    for rec in records:
        assert rec["dp_bytes_sent"] == dense + expert
        assert rec["dp_expert_bytes_sent"] == expert
        assert rec["dp_bytes_sent_job"] == want_job
        assert rec["dp_expert_bytes_sent_job"] == 4 * expert
        assert rec["dp_bytes_sent"] < rec["dp_bytes_dense"] / 4
    cfg = parse_config(small_model_argv + MOE + ["--edgc-mode", "static"])
    predicted = stage_param_shapes(cfg.model, cfg.parallel, cfg.data.tokenizer_vocab_size)
    real = [tuple(t.shape) for t in logger["params"].values()]
    assert sorted(real) == sorted(predicted[0])


#: Megatron's partial distributed optimizer: DP 4 as 2 instances of 2 ranks.
INSTANCES = ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
             "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]


def slow_hop_bytes(result: dict, rank: int) -> tuple:
    """A rank's ``(slow hop, fast hop beyond the reduce-scatter)`` bytes per iteration at
    ``rank``, bf16 factors (:func:`distributed.slow_hop_shard_bytes` over its buckets)."""
    slow = fast = 0
    s, k = result["instance_size"], result["instance_rank"]
    for shapes, offsets, numel in zip(result["bucket_shapes"], result["bucket_offsets"],
                                      result["bucket_numel"]):
        size = numel // s
        a, b = slow_hop_shard_bytes(shapes, offsets, (k * size, (k + 1) * size), s, rank)
        slow, fast = slow + a, fast + b
    return slow, fast


@pytest.mark.parametrize("overlap", [
    False, pytest.param(True, marks=pytest.mark.extended)], ids=["no-overlap", "overlap"])
def test_slow_hop_compression_on_partial_distributed_optimizer(small_model_argv, tmp_path,
                                                              overlap):
    """Only each rank's shard goes compressed across instances: the slow-hop bytes from
    the shard's pieces, the whole bucket dense inside the instance, every replica
    bit-identical, and the loss of Megatron's dense partial distributed optimizer."""
    extra = ["--overlap-grad-reduce", "--bucket-size", "20000"] if overlap else []
    runs = {}
    for mode in ("off", "static"):
        metrics = str(tmp_path / f"{mode}.jsonl")
        results = run_job(small_model_argv + INSTANCES + extra + [
            "--edgc-mode", mode, "--edgc-rank", str(RANK), "--metrics-file", metrics],
            str(tmp_path / mode))
        runs[mode] = (results, read_jsonl(metrics))
    results, records = runs["static"]
    assert sorted((r["dp"], r["instance_rank"]) for r in results) == \
        [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert assert_dp_replicas_identical(results) > 0            # all four: one replica set
    logger = next(r for r in results if r["dp"] == 0)
    slow, fast = slow_hop_bytes(logger, RANK)
    slow_job = sum(slow_hop_bytes(r, RANK)[0] for r in results)
    rs = 4 * sum(logger["bucket_numel"])                     # the dense reduce-scatter
    dense_records = runs["off"][1]
    for rec, off in zip(records, dense_records):
        assert rec["dp_slow_hop_bytes_sent"] == slow
        assert rec["dp_slow_hop_bytes_sent_job"] == slow_job
        assert rec["dp_bytes_sent"] == rs + slow + fast
        assert rec["dp_slow_hop_bytes_dense"] == rs // 2     # the shard, dense
        assert rec["dp_slow_hop_bytes_sent"] < 0.1 * rec["dp_slow_hop_bytes_dense"]
        assert off["dp_bytes_dense"] == rec["dp_bytes_dense"]
    losses, dense = [r["loss"] for r in records], [r["loss"] for r in dense_records]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert abs(losses[-1] - dense[-1]) < 0.1, (losses[-1], dense[-1])


def test_nonfinite_on_the_slow_hop_keeps_the_buckets_error_feedback_on_every_rank(
        small_model_argv, tmp_path):
    """A NaN on one rank with 2 optimizer instances: the instance's reduce-scatter carries
    it into one shard, and the instance's SUM of the P rows carries that shard's flag to
    every rank (the bucket's matrices share one Q across shards). So on all four ranks the
    poisoned bucket keeps its error feedback and warm start exactly as after the clean
    iteration 4, the other buckets are compressed as usual, and the optimizer sees a
    non-finite norm."""
    base = small_model_argv + INSTANCES + ["--edgc-mode", "static", "--edgc-rank", str(RANK)]
    clean = run_job(base + ["--train-iters", "4"], str(tmp_path / "clean"))
    metrics = str(tmp_path / "nan.jsonl")
    poisoned = run_job(["--inject-nan-at", "4"] + base + ["--train-iters", "5",
                                                          "--metrics-file", metrics],
                       str(tmp_path / "nan"))
    assert math.isnan(read_jsonl(metrics)[-1]["grad_norm"])
    same = {}   # bucket -> per rank: residuals and Q bit-identical to the clean run's
    for a, b in zip(sorted(clean, key=lambda r: r["dp"]), sorted(poisoned, key=lambda r: r["dp"])):
        for key, bucket in a["compression"]["buckets"].items():
            mats = b["compression"]["buckets"][key]["matrices"]
            same.setdefault(key, []).append(all(
                torch.equal(mat["residual"], mats[name]["residual"])
                and torch.equal(mat["q"], mats[name]["q"]) for name, mat in bucket["matrices"].items()))
    kept = [key for key, ranks in same.items() if all(ranks)]
    assert kept, same                                         # the bucket the NaN reached
    assert all(not any(ranks) for key, ranks in same.items() if key not in kept), same
