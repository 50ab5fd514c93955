"""The race's PowerSGD peers (``bench/torch_ddp_peers.py``) on 2 gloo processes: PyTorch's
``powerSGD_hook`` and the same hook in ``bf16_compress_wrapper`` (issue 72: a peer with
bf16 factors, as EDGC's). Same counters, half the bytes: a bf16 all-reduce in the warm-up,
bf16 factors after it; the wrapped hook trains like the fp32 one."""

import json
import os
import sys

import warm
from distributed import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_hook(hook, small_model_argv, tmp_path, *extra):
    metrics = str(tmp_path / f"{hook}{''.join(extra)}.jsonl")
    proc = warm.run([sys.executable, os.path.join(ROOT, "bench", "torch_ddp_peers.py"),
                     "--hook", hook, "--hook-rank", "4", "--hook-start-iter", "2",
                     *small_model_argv, "--data-parallel-size", "2",
                     "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
                     "1", "--global-batch-size", "4", "--train-iters", "6",
                     "--eval-interval", "6", "--metrics-file", metrics, *extra], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_jsonl(metrics), proc.stdout


def test_the_hook_in_the_bf16_wrapper_sends_half_the_bytes_and_trains_alike(small_model_argv,
                                                                             tmp_path):
    fp32, _ = run_hook("powersgd", small_model_argv, tmp_path)
    bf16, out = run_hook("powersgd-bf16", small_model_argv, tmp_path)
    assert "bf16_compress_wrapper(powerSGD_hook) r4" in out
    assert [r["iteration"] for r in bf16] == list(range(1, 7))
    for a, b in zip(fp32, bf16):
        assert 2 * b["dp_bytes_sent_job"] == a["dp_bytes_sent_job"], a["iteration"]
    # the warm-up (2 iterations) sends the parameters; the compressed iterations far less
    assert bf16[0]["dp_bytes_sent_job"] > 10 * bf16[-1]["dp_bytes_sent_job"] > 0
    assert bf16[-1]["rank_dp"] == [4] and bf16[0]["rank_dp"] is None
    assert abs(bf16[-1]["val_loss"] - fp32[-1]["val_loss"]) < 0.02 * fp32[-1]["val_loss"]
    assert bf16[-1]["loss"] < bf16[0]["loss"] - 0.1


def test_the_hook_trains_a_bf16_model(small_model_argv, tmp_path):
    """The race's compressing bf16 peer (issue 80): the bf16-factor hook on a bf16 model
    (every parameter bf16, as Megatron-LM's Float16Module; stepped by torch's AdamW). It
    sends what it sends on an fp32 model and trains like it."""
    fp32, _ = run_hook("powersgd-bf16", small_model_argv, tmp_path)
    bf16, _ = run_hook("powersgd-bf16", small_model_argv, tmp_path, "--bf16")
    assert [r["iteration"] for r in bf16] == list(range(1, 7))
    assert [r["dp_bytes_sent_job"] for r in bf16] == [r["dp_bytes_sent_job"] for r in fp32]
    assert bf16[-1]["loss"] < bf16[0]["loss"] - 0.1
    assert abs(bf16[-1]["val_loss"] - fp32[-1]["val_loss"]) < 0.02 * fp32[-1]["val_loss"]


def in_span(log_dir, rank=0):
    """Per timed iteration of rank ``rank``'s log (tests/timed_span_probe.py): the scalar
    all-reduces over a group of more than one rank inside it, as (numel, dtype)."""
    spans, current = [], None
    with open(os.path.join(log_dir, f"rank{rank}.jsonl")) as fh:
        for event in map(json.loads, fh):
            if event["event"] == "begin":
                current = []
            elif event["event"] == "end":
                spans.append(current)
                current = None
            elif current is not None and event["numel"] == 1 and event["group_size"] > 1:
                current.append((event["numel"], event["dtype"]))
    return spans


def test_a_peer_times_the_same_collectives_as_the_trainer(small_model_argv, tmp_path):
    """Issue 93: a torch peer's timed iteration and the trainer's hold the same scalar
    collectives: the loss's all-reduce over DP inside both (what an iteration that logs its
    loss pays), the telemetry's outside both; the two spans stamped by the same clock."""
    argv = [*small_model_argv, "--data-parallel-size", "2", "--tensor-model-parallel-size",
            "1", "--pipeline-model-parallel-size", "1", "--global-batch-size", "4",
            "--train-iters", "3", "--eval-interval", "3", "--edgc-mode", "off"]
    spans = {}
    for name, script, extra in (("trainer", "pretrain_gpt2_edgc.py", []),
                                ("peer", os.path.join("bench", "torch_ddp_peers.py"),
                                 ["--hook", "allreduce"])):
        logs = tmp_path / name
        logs.mkdir()
        proc = warm.run([sys.executable, os.path.join(ROOT, "tests", "timed_span_probe.py"),
                         str(logs), os.path.join(ROOT, script), *extra, *argv,
                         "--metrics-file", str(tmp_path / f"{name}.jsonl")],
                        cwd=ROOT, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        spans[name] = [in_span(logs, r) for r in (0, 1)]
        assert all(len(s) == 3 for s in spans[name]), (name, spans[name])
    assert spans["trainer"][0][-1] == [(1, "torch.float32")]   # the loss's, nothing else
    assert spans["peer"] == spans["trainer"]
    peer = read_jsonl(str(tmp_path / "peer.jsonl"))
    trainer = read_jsonl(str(tmp_path / "trainer.jsonl"))
    assert [r["loss"] for r in peer] == [r["loss"] for r in trainer]   # reduced alike
