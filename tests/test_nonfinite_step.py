"""The non-finite step guard (patches/nonfinite_step.py): without a loss scaler (fp32, bf16)
megatron-core never skips a step and clips against a NaN norm, so one NaN in one rank's
gradient would reach every weight. Under the guard the step is skipped on every rank,
counted and named, and the run ends finite, exit 0."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from distributed import LAYOUTS, assert_dp_replicas_identical, read_jsonl, run_job

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_nonfinite_norm_leaves_parameters_and_optimizer_state_bit_identical():
    """megatron-core's optimizers (FP32Optimizer, Float16OptimizerWithFloat16Params,
    DistributedOptimizer, ChainedOptimizer; clip_grad 1 and 0): a NaN in one gradient
    makes ``step()`` return False and leaves the parameters, the fp32 main parameters and
    the Adam state bit-identical; the next clean step updates them. Without the guard the
    NaN reaches the weights (the bug)."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "optimizer_guard_runner.py")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["variant"]: r for r in map(json.loads, (line for line in
                                                          proc.stdout.splitlines()
                                                          if line.startswith("{")))}
    from optimizer_guard_runner import VARIANTS

    assert results.keys() == VARIANTS.keys()
    kinds = {r["optimizer"] for r in results.values()}
    assert {"FP32Optimizer", "Float16OptimizerWithFloat16Params", "DistributedOptimizer",
            "ChainedOptimizer"} <= kinds, kinds
    for name, r in results.items():
        assert r["clean_ok"] and r["after_ok"], r
        assert math.isnan(r["nan_norm"]), r
        if name.endswith("unguarded"):   # the bug the guard is for
            assert r["nan_ok"] and not r["params_identical"] and not r["params_finite"], r
            continue
        assert not r["nan_ok"], r
        assert r["params_identical"] and r["state_identical"] and r["state_tensors"] > 0, r
        assert r["lines"] == ["iteration 2: non-finite gradient (grad norm nan): step "
                              "skipped, weights unchanged"], r
        assert r["skipped"] == [2], r
        assert r["params_changed"] and r["params_finite"] and math.isfinite(r["after_norm"])
        assert r["uninstalled"], r
        # megatron-core's own norm where it clips (no read of the guard's own); one read a
        # step where clip_grad is 0 and nothing computes a norm (a ChainedOptimizer does)
        single_clip0 = name.endswith("clip0") and r["optimizer"] != "ChainedOptimizer"
        assert r["own_reads"] == (2 if single_clip0 else 0), r   # after 2 steps


#: the skipped step: iteration 4 (1-based) of 6, on DP rank 1 of both stages
INJECT_AT, ITERS = 3, 6


@pytest.mark.parametrize("precision,mode", [
    ("fp32", "off"), ("bf16", "static"),
    pytest.param("fp32", "static", marks=pytest.mark.extended),
    pytest.param("bf16", "off", marks=pytest.mark.extended)])
def test_a_nan_gradient_is_skipped_once_and_the_run_ends_finite(precision, mode,
                                                                 small_model_argv, tmp_path):
    """A NaN in DP rank 1's gradient at iteration 4 (PP 2 x DP 2, 4 gloo processes): the
    step is skipped on every rank (iteration 4's record says so, alone), rank 0 names it
    once, the summary counts it; every loss and weight stays finite, the DP replicas stay
    bit-identical, and the job exits 0."""
    metrics = str(tmp_path / "m.jsonl")
    argv = (["--inject-nan-grad-at", str(INJECT_AT)] + small_model_argv + LAYOUTS["tp1-pp2-dp2"]
            + ["--train-iters", str(ITERS), "--eval-interval", str(ITERS), "--edgc-mode", mode,
               "--metrics-file", metrics]
            + (["--edgc-rank", "4"] if mode != "off" else [])
            + (["--bf16"] if precision == "bf16" else []))
    results = run_job(argv, str(tmp_path / "out"))      # exit 0 asserted there
    records = read_jsonl(metrics)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert [r["skipped"] for r in records] == [r["iteration"] == INJECT_AT + 1 for r in records]
    assert math.isnan(records[INJECT_AT]["grad_norm"])
    assert all(math.isfinite(r["loss"]) for r in records), [r["loss"] for r in records]
    assert all(math.isfinite(r["grad_norm"]) for r in records if not r["skipped"])
    stdout = open(tmp_path / "out" / "stdout.txt").read()
    line = (f"iteration {INJECT_AT + 1}: non-finite gradient (grad norm nan): step skipped, "
            f"weights unchanged")
    assert stdout.count(line) == 1, stdout[-3000:]
    assert "| 1 skipped |" in stdout, stdout[-3000:]
    for r in results:
        assert all(torch.isfinite(t).all() for t in r["params"].values()), r["pp"]
        if r["summary"]:
            assert r["summary"]["skipped_iterations"] == 1
    assert assert_dp_replicas_identical(results) > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_failed_factorizations_lose_no_step_and_send_the_bucket_dense(precision,
                                                                      small_model_argv,
                                                                      tmp_path):
    """Every Cholesky factorization of iterations 3 and 4 fails as cuSOLVER's do (NaN
    factors), static rank 4, PP 2 x DP 2: a fixed basis stands in, so no step is skipped
    and every loss and weight stays finite; both failures are named, and the bucket
    that kept failing is sent dense from the next read of the flags on; the DP replicas
    stay bit-identical and the job exits 0."""
    metrics = str(tmp_path / "m.jsonl")
    argv = (["--fail-factorizations-at", "2,3"] + small_model_argv + LAYOUTS["tp1-pp2-dp2"]
            + ["--train-iters", str(ITERS), "--eval-interval", str(ITERS), "--edgc-mode",
               "static", "--edgc-rank", "4", "--log-interval", "2", "--metrics-file", metrics]
            + (["--bf16"] if precision == "bf16" else []))
    results = run_job(argv, str(tmp_path / "out"))      # exit 0 asserted there
    records = read_jsonl(metrics)
    assert not any(r["skipped"] for r in records)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    stdout = open(tmp_path / "out" / "stdout.txt").read()
    for it in (3, 4):
        assert f"iteration {it}: failed factorization from finite gradients in chunk0." \
            in stdout, stdout[-3000:]
    assert "compression's factors failed from finite gradients 2 times by iteration 4: " \
        "sent dense (an all-reduce of the bucket, as megatron-core's) from iteration 5 on" \
        in stdout, stdout[-3000:]
    last = records[-1]
    assert last["dp_bytes_sent"] == last["dp_bytes_dense"]    # the fallback: dense
    assert records[1]["dp_bytes_sent"] < records[1]["dp_bytes_dense"]
    for r in results:
        assert all(torch.isfinite(t).all() for t in r["params"].values()), r["pp"]
    assert assert_dp_replicas_identical(results) > 0
