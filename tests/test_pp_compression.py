"""Pipeline backward-send compression (EDGC §7) and DAC (§6) on 4 gloo processes, plus
the message protocol in one process."""

import math

import pytest
import torch

from distributed import LAYOUTS, read_jsonl, run_job
from megatron_edgc.compression.activation import ActivationGradSender
from megatron_edgc.patches.p2p import (FLOAT_BYTES, HEADER, CompressingP2PCommunicator,
                                       PipelineRankMismatch, warmup_microbatches)

PP2_M4 = LAYOUTS["tp1-pp2-dp2"] + ["--global-batch-size", "16"]      # 4 micro-batches
SHAPE = (64, 2, 64)                                                  # seq, micro-batch, hidden
N, M = 128, 64


def losses(path):
    return [r["loss"] for r in read_jsonl(path)]


@pytest.mark.parametrize("layout", ["1f1b", "interleaved"])
def test_full_rank_pp_compression_equals_dense(small_model_argv, tmp_path, layout):
    argv = small_model_argv + PP2_M4 + ["--train-iters", "10"]
    if layout == "interleaved":
        argv += ["--virtual-pipeline-model-parallel-size", "2"]
    dense, full = str(tmp_path / "dense.jsonl"), str(tmp_path / "full.jsonl")
    run_job(argv + ["--metrics-file", dense], str(tmp_path / "a"))
    run_job(argv + ["--edgc-pp-compression", "static", "--edgc-pp-rank", "64",
                    "--metrics-file", full], str(tmp_path / "b"))
    a, b = losses(dense), losses(full)
    assert len(a) == len(b) == 10
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)), (a, b)
    rec = read_jsonl(full)[-1]
    # 4 micro-batches x 2 DP ranks of stage 1, each rank-64 factors + header, fp32.
    per_msg = (HEADER + (N + M) * 64) * FLOAT_BYTES
    chunks = 2 if layout == "interleaved" else 1
    msgs = 4 * chunks + (4 * (chunks - 1))   # stage 1 -> 0 every chunk, 0 -> 1 wrap edge
    assert rec["pp_bytes_sent_job"] == 2 * msgs * per_msg
    assert rec["pp_bytes_dense_job"] == 2 * msgs * N * M * 4


def test_static_pp_rank_trains_with_bytes_from_shapes(small_model_argv, tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    results = run_job(small_model_argv + PP2_M4 + [
        "--edgc-pp-compression", "static", "--edgc-pp-rank", "4", "--train-iters", "20",
        "--metrics-file", metrics], str(tmp_path / "out"))
    records = read_jsonl(metrics)
    per_msg = (HEADER + (N + M) * 4) * FLOAT_BYTES
    for r in records:
        assert r["rank_pp"] == 4
        assert r["pp_bytes_sent_job"] == 2 * 4 * per_msg          # 2 DP ranks x 4 messages
        assert r["pp_bytes_dense_job"] == 2 * 4 * N * M * 4
        assert r["pp_bytes_sent"] == 4 * per_msg                   # the logger is stage 1
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    # Sender residual (lazy error propagation) persists on stage 1 only, one per chunk.
    for res in results:
        senders = res["pp_compression"]["senders"]
        assert (list(senders) == [0]) == (res["pp"] == 1)
        if res["pp"] == 1:
            (saved,) = senders[0]["matrices"].values()   # the sender's one matrix
            assert saved["residual"].shape == (N, M) and saved["q"].shape == (M, 4)


def test_a_skipped_iteration_leaves_the_pipeline_senders_as_it_found_them(small_model_argv,
                                                                          tmp_path):
    """Issue 81: the senders take the iteration's outcome from the report the DP units
    take. PP 2 x DP 2, static PP rank 4: a NaN written into DP rank 1's gradient after the
    backward of iteration 5 (its pipeline messages all sent) skips the step; every
    sender's ``E`` and ``Q`` after it are those of the same job stopped after iteration 4,
    bit for bit (the rule rolls the sender back to the iteration's start: the code before
    carried the skipped iteration's last residual into the next)."""
    argv = small_model_argv + PP2_M4 + ["--edgc-pp-compression", "static",
                                        "--edgc-pp-rank", "4", "--train-iters", "8"]
    skipped_metrics = str(tmp_path / "skipped.jsonl")
    stopped = run_job(argv + ["--exit-interval", "4"], str(tmp_path / "stopped"))
    skipped = run_job(["--inject-nan-grad-at", "4"] + argv + [
        "--exit-interval", "5", "--metrics-file", skipped_metrics], str(tmp_path / "skipped"))
    assert [r["skipped"] for r in read_jsonl(skipped_metrics)] == [False] * 4 + [True]
    compared = 0
    for a, b in zip(stopped, skipped):
        assert a["pp"] == b["pp"] and a["dp"] == b["dp"]
        for chunk, sender in a["pp_compression"]["senders"].items():
            for name, want in sender["matrices"].items():
                got = b["pp_compression"]["senders"][chunk]["matrices"][name]
                assert want["residual"].abs().sum() > 0
                assert torch.equal(got["residual"], want["residual"]), (a["pp"], a["dp"])
                assert torch.equal(got["q"], want["q"]), (a["pp"], a["dp"])
                compared += 1
    assert compared == 2   # stage 1's sender on each DP rank


def test_epilogue_only_compresses_the_cooldown(small_model_argv, tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    run_job(small_model_argv + PP2_M4 + [
        "--edgc-pp-compression", "static", "--edgc-pp-rank", "4", "--edgc-pp-epilogue-only",
        "--train-iters", "4", "--metrics-file", metrics], str(tmp_path / "out"))
    # Stage 0's cool-down is its last p - 0 - 1 = 1 backward: 3 dense messages, 1 compressed.
    per_msg = (HEADER + (N + M) * 4) * FLOAT_BYTES
    for r in read_jsonl(metrics):
        assert r["pp_bytes_sent"] == 3 * N * M * 4 + per_msg


def test_message_rules_sender_and_receiver_agree():
    # megatron-core's own warm-up counts: 1F1B p - s - 1, interleaved 2 (p - s - 1) + (V-1) g.
    assert [warmup_microbatches(4, s, 8, 1, 4) for s in range(4)] == [3, 2, 1, 0]
    assert [warmup_microbatches(2, s, 4, 2, 2) for s in range(2)] == [4, 2]
    assert warmup_microbatches(4, 0, 2, 1, 4) == 2           # capped at the micro-batches
    comm = CompressingP2PCommunicator.__new__(CompressingP2PCommunicator)
    comm.pp_size, comm.num_microbatches, comm.num_chunks, comm._group_size = 4, 8, 1, 4
    comm.rank, comm.epilogue_only = 8, True
    # The edge into stage 1 carries 8 messages; stage 1 cools down over its last 2.
    assert [comm.compressed(k, receiver=1) for k in range(8)] == [False] * 6 + [True] * 2
    assert comm.messages_per_iteration(receiver=3) == 0      # nothing wraps without chunks
    comm.epilogue_only = False
    assert all(comm.compressed(k, receiver=1) for k in range(8))
    comm.rank = None
    assert not any(comm.compressed(k, receiver=1) for k in range(8))


def test_mismatched_rank_or_version_is_an_error_not_garbage():
    """The receiver compares the header on the device: a disagreeing message decodes as
    NaN, and check_messages() (once per step) raises naming it."""
    comm = CompressingP2PCommunicator.__new__(CompressingP2PCommunicator)
    comm.pp_size, comm.stage, comm.seed, comm.num_chunks = 2, 1, 0, 1
    comm._send_chunk, comm.senders, comm.rank, comm.table_version = None, {}, 8, 3
    comm._headers = {}
    from megatron_edgc.patches.p2p import PPSendStats
    comm.stats = PPSendStats(stage=1)
    grad = torch.randn(SHAPE)
    payload = comm._pack(grad, k=0)
    receiver = CompressingP2PCommunicator.__new__(CompressingP2PCommunicator)
    receiver.pp_size, receiver.stage, receiver.table_version = 2, 0, 3
    receiver._headers, receiver._received = {}, []
    out = torch.empty(SHAPE)
    receiver._unpack_into(payload, out, k=0, r=8)                       # agrees: decodes
    receiver.check_messages()
    sender = ActivationGradSender(8, seed=0, name="pp-stage1-chunk0")
    p, q = sender.compress(grad)
    assert torch.allclose(out, (p @ q.T).view(SHAPE), atol=1e-6)
    receiver.table_version = 4                                          # stale table
    receiver._unpack_into(payload, out, k=0, r=8)
    assert torch.isnan(out).all()
    with pytest.raises(PipelineRankMismatch, match="version, rank"):
        receiver.check_messages()
    receiver.table_version = 3
    receiver._unpack_into(payload, out, k=1, r=8)                       # other message
    assert torch.isnan(out).all()
    with pytest.raises(PipelineRankMismatch, match="as message 0"):
        receiver.check_messages()
    receiver.check_messages()                                           # read once


def test_nonfinite_backward_send_is_flagged_on_the_device():
    """A NaN in a backward send: the factors go out NaN, the sender keeps its residual and
    Q, and the event appears when the step's stats are resolved."""
    comm = CompressingP2PCommunicator.__new__(CompressingP2PCommunicator)
    comm.pp_size, comm.stage, comm.seed, comm.num_chunks = 2, 1, 0, 1
    comm._send_chunk, comm.senders, comm.rank, comm.table_version = None, {}, 8, 0
    comm._headers = {}
    from megatron_edgc.patches.p2p import PPSendStats
    comm.stats = PPSendStats(stage=1)
    comm._pack(torch.randn(SHAPE), k=0)
    sender = comm.senders[0]
    residual, q = sender.residual.clone(), sender.q.clone()
    bad = torch.randn(SHAPE)
    bad[3, 1, 5] = float("inf")
    payload = comm._pack(bad, k=1)
    assert torch.isnan(payload[HEADER:]).all()
    assert torch.equal(sender.residual, residual) and torch.equal(sender.q, q)
    assert comm.stats.events == []
    comm.stats.resolve()
    assert comm.stats.events == ["non-finite activation gradient in backward message 1 of "
                                 "stage 1: sent as such, residual kept"]


@pytest.mark.parametrize("layout", ["tp1-pp2-dp2", "pp4-dp1"])
def test_dac_and_pp_edgc_share_one_table_everywhere(small_model_argv, tmp_path, layout):
    argv = LAYOUTS["tp1-pp2-dp2"] + ["--global-batch-size", "16"] if layout == "tp1-pp2-dp2" \
        else ["--pipeline-model-parallel-size", "4", "--data-parallel-size", "1",
              "--global-batch-size", "16"]
    metrics = str(tmp_path / "m.jsonl")
    results = run_job(small_model_argv + argv + [
        "--edgc-mode", "edgc", "--edgc-window", "4", "--edgc-iter-sample-rate", "0.5",
        "--edgc-rank-max", "16", "--edgc-rank-min", "4", "--edgc-warmup-max-iters", "8",
        "--edgc-pp-compression", "edgc", "--edgc-pp-rank-max", "32", "--edgc-dac", "on",
        "--train-iters", "24", "--metrics-file", metrics], str(tmp_path / "out"))
    p = 2 if layout == "tp1-pp2-dp2" else 4
    records = read_jsonl(metrics)
    # Warm-up dense to iteration 8; the probe window runs r_max then r_min on all stages.
    assert all(r["rank_dp"] == [None] * p and r["rank_pp"] is None for r in records[:8])
    assert [r["rank_dp"] for r in records[8:12]] == [[16] * p] * 2 + [[4] * p] * 2
    assert all(r["rank_pp"] == 32 for r in records[8:12])
    # From then on DAC: stage 0 keeps its CQM rank, the others never fall below theirs,
    # never exceed r_max, and the job's later stages spend measured slack.
    dac = records[12:]
    for r in dac:
        assert r["rank_dp"][0] == r["rank_cqm"][0]
        assert all(c <= d <= 16 for c, d in zip(r["rank_cqm"], r["rank_dp"]))
        assert len(r["dac_eta_ms"]) == len(r["dac_slack_ms"]) == p
        assert r["dac_slack_ms"][0] == 0.0 and all(s > 0 for s in r["dac_slack_ms"][1:])
        assert all(math.isfinite(t) for t in r["t_b_ms"])
        assert r["pp_bytes_sent_job"] < r["pp_bytes_dense_job"]
    assert any(d > c for r in dac for c, d in zip(r["rank_cqm"][1:], r["rank_dp"][1:]))
    # One table on every rank of the job: DP ranks, PP rank, version, fitted models.
    states = [res["edgc"] for res in results]
    for key in ("dp_table", "pp_rank", "table_version", "controller", "pp_controller",
                "time_models", "slack", "dac_fit"):
        assert all(s[key] == states[0][key] for s in states), key
    assert all(res["pp_compression"]["rank"] == states[0]["pp_rank"]
               and res["pp_compression"]["table_version"] == states[0]["table_version"]
               for res in results)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
