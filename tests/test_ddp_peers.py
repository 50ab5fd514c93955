"""The race's PowerSGD peers (``bench/torch_ddp_peers.py``) on 2 gloo processes: PyTorch's
``powerSGD_hook`` and the same hook in ``bf16_compress_wrapper`` (issue 72: a peer with
bf16 factors, as EDGC's). Same counters, half the bytes: a bf16 all-reduce in the warm-up,
bf16 factors after it; the wrapped hook trains like the fp32 one."""

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
