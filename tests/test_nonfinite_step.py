"""The non-finite step guard (patches/nonfinite_step.py): without a loss scaler (fp32, bf16)
megatron-core never skips a step and clips against a NaN norm, so one NaN in one rank's
gradient would reach every weight. Under the guard the step is skipped on every rank,
counted and named, and the run ends finite, exit 0."""

import json
import math
import os
import sys

import pytest
import torch

import warm
from distributed import LAYOUTS, assert_dp_replicas_identical, read_jsonl, run_job

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_nonfinite_norm_leaves_parameters_and_optimizer_state_bit_identical():
    """megatron-core's optimizers (FP32Optimizer, Float16OptimizerWithFloat16Params,
    DistributedOptimizer, ChainedOptimizer; clip_grad 1 and 0): a NaN in one gradient
    makes ``step()`` return False and leaves the parameters, the fp32 main parameters and
    the Adam state bit-identical; the next clean step updates them. Without the guard the
    NaN reaches the weights (the bug)."""
    proc = warm.run([sys.executable, os.path.join(HERE, "optimizer_guard_runner.py")],
                    timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
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


#: Failed factorizations: iterations 3 and 4 (1-based) of 10; the fallback's interval 3
FAIL_AT, FALLBACK_ITERS, FAIL_ITERS = "2,3", 3, 10


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_failed_factorizations_lose_no_step_send_the_bucket_dense_and_it_comes_back(
        precision, small_model_argv, tmp_path):
    """Every Cholesky factorization of iterations 3 and 4 fails as cuSOLVER's do (NaN
    factors), static rank 4, PP 2 x DP 2: a fixed basis stands in, so no step is skipped
    and every loss and weight stays finite; both failures are named; the buckets that
    kept failing are sent dense from the next read of the flags (iteration 4) for
    ``--edgc-fallback-iters`` 3 iterations, shown dense in the records, then compressed
    again, named; the summary counts 7 of 10 iterations compressed per stage and the
    stood-in matrices; the DP replicas stay bit-identical and the job exits 0. fp32: a
    job saved at iteration 6 (inside the dense interval) and resumed gives the same
    records as the whole run: the fallback's state is in the checkpoint."""
    metrics = str(tmp_path / "m.jsonl")
    argv = (small_model_argv + LAYOUTS["tp1-pp2-dp2"]
            + ["--train-iters", str(FAIL_ITERS), "--eval-interval", str(FAIL_ITERS),
               "--edgc-mode", "static", "--edgc-rank", "4", "--log-interval", "2",
               "--edgc-fallback-iters", str(FALLBACK_ITERS)]
            + (["--bf16"] if precision == "bf16" else []))
    results = run_job(["--fail-factorizations-at", FAIL_AT] + argv
                      + ["--metrics-file", metrics], str(tmp_path / "out"))  # exit 0 there
    records = read_jsonl(metrics)
    assert not any(r["skipped"] for r in records)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    stdout = open(tmp_path / "out" / "stdout.txt").read()
    for it in (3, 4):
        assert f"iteration {it}: failed factorization from finite gradients in chunk0." \
            in stdout, stdout[-3000:]
    assert "compression's factors failed from finite gradients 2 times by iteration 4: " \
        "sent dense (an all-reduce of the bucket, as megatron-core's) for iterations 5-7, " \
        "then compressed again" in stdout, stdout[-3000:]
    assert "iteration 8: chunk0.group0.bucket0: compressed again from iteration 8, after " \
        "3 iterations sent dense (its factors had failed)" in stdout, stdout[-3000:]
    dense = [r["iteration"] for r in records if r["dp_bytes_sent"] == r["dp_bytes_dense"]]
    assert dense == [5, 6, 7]
    assert [r["rank_dp"] for r in records] == \
        [[None, None] if r["iteration"] in dense else [4, 4] for r in records]
    assert "ranks dense/dense" in stdout and "ranks 4/4" in stdout
    summary = next(r["summary"] for r in results if r["summary"])["compression"]
    assert summary["dp_iterations_compressed"] == [7, 7]
    assert summary["dp_iterations_with_rank"] == [10, 10]
    assert summary["dp_factors_stood_in"] >= 2 * 2   # two iterations, both stages
    assert sum(r.get("dp_factors_stood_in", 0) for r in records) == \
        summary["dp_factors_stood_in"]
    assert "DP compressed 7/7 of 10 iterations per stage (10/10 with a rank in force) | " \
        f"{summary['dp_factors_stood_in']} factorizations stood in" in stdout
    for r in results:
        assert all(torch.isfinite(t).all() for t in r["params"].values()), r["pp"]
    assert assert_dp_replicas_identical(results) > 0
    if precision != "fp32":
        return
    ckpt, resumed = str(tmp_path / "ck"), str(tmp_path / "resumed.jsonl")
    run_job(["--fail-factorizations-at", FAIL_AT] + argv
            + ["--metrics-file", resumed, "--save", ckpt, "--save-interval", "6",
               "--exit-interval", "6"], str(tmp_path / "first"))
    run_job(argv + ["--metrics-file", resumed, "--load", ckpt], str(tmp_path / "second"))
    keys = ("iteration", "loss", "rank_dp", "dp_bytes_sent", "dp_fallback_share")
    assert [[r[k] for k in keys] for r in read_jsonl(resumed)] == \
        [[r[k] for k in keys] for r in records]
