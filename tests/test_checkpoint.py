"""Checkpoint-resume exactness through the real command line (plain launch, 4 processes)."""

import os
import shutil
import sys

import pytest

import warm
from distributed import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pretrain(argv, timeout=300):
    proc = warm.run([sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"), *argv],
                    timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("variant", [
    ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
     "--data-parallel-size", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"],
    ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
     "--use-distributed-optimizer", "--overlap-grad-reduce"],
    ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
     "--edgc-mode", "static", "--edgc-rank", "4"],
    # the paper's controller on the DP sync and the pipeline sends (its DP-only state is a
    # subset of this one)
    # DAC's ranks follow measured times, so they are not reproducible run to run: off here.
    ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
     "--global-batch-size", "16", "--edgc-mode", "edgc", "--edgc-window", "2",
     "--edgc-iter-sample-rate", "1.0", "--edgc-rank-max", "8", "--edgc-warmup-max-iters", "4",
     "--edgc-dac", "off", "--edgc-pp-compression", "edgc", "--edgc-pp-rank-max", "8"],
    # the budget controller: the checkpoint at 5 falls inside its first measured window; its
    # time budget is priced by measurement at warm-up end (iteration 4), so two jobs differ
    # as DAC's would: the measured prices are checkpointed, and the job resumed from the
    # uninterrupted run's own checkpoint must continue it exactly
    ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
     "--edgc-mode", "edgc", "--edgc-controller", "budget", "--edgc-time-budget", "0.5",
     "--edgc-window", "2", "--edgc-iter-sample-rate", "1.0", "--edgc-rank-max", "8",
     "--edgc-rank-min", "1", "--edgc-warmup-max-iters", "4"],
    # MoE, EP 2 on DP 4: a model file per EP rank (its experts), experts' residuals per rank
    ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4", "--num-experts", "4",
     "--expert-model-parallel-size", "2", "--edgc-mode", "static", "--edgc-rank", "4"],
    # Megatron's partial distributed optimizer, 2 instances of 2: shard residuals per rank;
    # with bf16 training and bf16 gradient buffers (--grad-reduce-in-bf16): EDGC's step on
    # bf16 buckets resumes exactly too
    ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
     "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
     "--edgc-mode", "static", "--edgc-rank", "4", "--bf16", "--grad-reduce-in-bf16"],
    # fp16 with a dynamic loss scale that doubles at iterations 4, 7 and 10 (across the
    # checkpoint at 5), the distributed optimizer (its shard state carries no scaler) and
    # the pipeline's compression: the scaler, the DP and PP residuals and their units
    # resume together
    ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
     "--use-distributed-optimizer", "--edgc-mode", "static", "--edgc-rank", "4",
     "--edgc-pp-compression", "static", "--edgc-pp-rank", "4", "--fp16",
     "--initial-loss-scale", "1024", "--loss-scale-window", "3"],
], ids=["tp1-pp2-dp2-dropout", "distopt-overlap", "powersgd-rank4", "edgc-pp-compression",
        "budget-controller", "moe-ep2", "instances-2-bf16-buffers", "fp16-scale-changes"])
def test_resume_reproduces_uninterrupted_losses(variant, small_model_argv, tmp_path):
    base = small_model_argv + variant + ["--train-iters", "10", "--eval-interval", "5"]
    full = str(tmp_path / "full.jsonl")
    pretrain(base + ["--metrics-file", full, "--save", str(tmp_path / "ck_full"),
                     "--save-interval", "5"])
    # The interrupted run: stops after 5 iterations, then a new job resumes from there.
    first = str(tmp_path / "first.jsonl")
    pretrain(base + ["--train-iters", "10", "--metrics-file", first,
                     "--save", str(tmp_path / "ck"), "--save-interval", "5",
                     "--exit-interval", "5"])
    assert [r["iteration"] for r in read_jsonl(first)] == [1, 2, 3, 4, 5]
    resumed = str(tmp_path / "resumed.jsonl")
    measured_prices = "budget" in variant
    if measured_prices:   # the uninterrupted run's iteration 5 in place of the first's
        shutil.rmtree(tmp_path / "ck" / "iter_0000005")
        shutil.copytree(tmp_path / "ck_full" / "iter_0000005", tmp_path / "ck" / "iter_0000005")
    out = pretrain(base + ["--metrics-file", resumed, "--load", str(tmp_path / "ck"),
                           "--save", str(tmp_path / "ck"), "--save-interval", "5"])
    assert "resumed from" in out.stdout
    full_recs = {r["iteration"]: r for r in read_jsonl(full)}
    res_recs = {r["iteration"]: r for r in read_jsonl(resumed)}
    assert sorted(res_recs) == list(range(6, 11))
    for it in range(6, 11):
        assert res_recs[it]["loss"] == full_recs[it]["loss"], it  # bit-exact
        assert res_recs[it]["lr"] == full_recs[it]["lr"]
    assert res_recs[10]["val_loss"] == full_recs[10]["val_loss"]
    if "--fp16" in variant:   # the scale changed inside both halves, and resumed with it
        assert len({full_recs[it]["loss_scale"] for it in range(1, 6)}) > 1
        assert len({res_recs[it]["loss_scale"] for it in range(6, 11)}) > 1
        assert [res_recs[it]["loss_scale"] for it in range(6, 11)] == \
            [full_recs[it]["loss_scale"] for it in range(6, 11)]
    for it in range(6, 11):  # the controller's decisions resume too
        assert res_recs[it].get("rank_dp") == full_recs[it].get("rank_dp")
        assert res_recs[it].get("entropy") == full_recs[it].get("entropy")
        assert res_recs[it].get("rank_pp") == full_recs[it].get("rank_pp")
        assert res_recs[it].get("rank_dp_shapes") == full_recs[it].get("rank_dp_shapes")
    assert open(tmp_path / "ck" / "latest_checkpointed_iteration.txt").read() == "10"
    assert not any(p.endswith(".tmp") for p in os.listdir(tmp_path / "ck"))


def test_resume_with_another_dp_size_resets_per_replica_state(small_model_argv, tmp_path):
    """Saved on TP1·PP2·DP2, resumed on TP1·PP2·DP1 (2 processes): the model, optimizer,
    schedule and the rank controller come back, the error-feedback state starts fresh with
    a warning, and training goes on where the DP2 run would have been."""
    common = small_model_argv + ["--pipeline-model-parallel-size", "2", "--train-iters", "10",
                                 "--eval-interval", "5", "--edgc-mode", "edgc",
                                 "--edgc-window", "2", "--edgc-iter-sample-rate", "1.0",
                                 "--edgc-rank-max", "8", "--edgc-warmup-max-iters", "4",
                                 "--edgc-dac", "off"]
    full = str(tmp_path / "full.jsonl")
    pretrain(common + ["--data-parallel-size", "2", "--metrics-file", full])
    pretrain(common + ["--data-parallel-size", "2", "--save", str(tmp_path / "ck"),
                       "--save-interval", "6", "--exit-interval", "6"])
    resumed = str(tmp_path / "resumed.jsonl")
    out = pretrain(common + ["--data-parallel-size", "1", "--metrics-file", resumed,
                             "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck2")])
    warning = [l for l in out.stdout.splitlines() if l.startswith("warning: resuming")]
    assert len(warning) == 1 and "saved with DP 2 on DP 1" in warning[0], out.stdout[-2000:]
    assert "per-replica state reset (dp_compression)" in warning[0]
    full_recs = {r["iteration"]: r for r in read_jsonl(full)}
    res_recs = {r["iteration"]: r for r in read_jsonl(resumed)}
    assert sorted(res_recs) == list(range(7, 11))
    # the controller's table in force at iteration 7 is the saved one (DP-invariant state)
    assert res_recs[7]["rank_dp"] == full_recs[7]["rank_dp"]
    assert res_recs[7]["lr"] == full_recs[7]["lr"]
    # same global batches, same weights: the first resumed loss is the DP2 run's up to the
    # order of the DP sum (fresh error feedback only acts from the next update)
    assert res_recs[7]["loss"] == pytest.approx(full_recs[7]["loss"], rel=1e-4)
    for it in range(8, 11):  # and it trains on close to the uninterrupted run
        assert res_recs[it]["loss"] == pytest.approx(full_recs[it]["loss"], rel=0.02), it
    # a TP/PP change is still refused, naming --load
    bad = warm.run([sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"),
                    *small_model_argv, "--pipeline-model-parallel-size", "1",
                    "--data-parallel-size", "4", "--load", str(tmp_path / "ck")],
                   timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "error: --load:" in bad.stderr, bad.stderr[-2000:]


def test_only_the_dp_size_may_change_and_the_instances_are_part_of_the_layout():
    """The layout check of ``--load``, before anything is read into the model: the number
    of distributed-optimizer instances sets each rank's optimizer shard and compressor
    state, so a change of it is refused by name (it used to reach torch's optimizer and
    fail there with a traceback: "loaded state dict contains a parameter group that doesn't
    match the size of optimizer's group")."""
    from megatron_edgc.training.checkpoint import CheckpointError, dp_size_changed

    ours = {"tp": 1, "pp": 1, "dp": 4, "vp": None, "distributed_optimizer": True, "ep": 1,
            "instances": 1}
    assert dp_size_changed(dict(ours), ours) is False
    # saved before EP and the instances were recorded: 1 of each
    assert dp_size_changed({k: v for k, v in ours.items() if k not in ("ep", "instances")},
                           ours) is False
    with pytest.raises(CheckpointError) as err:
        dp_size_changed({**ours, "instances": 2}, ours)
    assert str(err.value) == ("--load: the checkpoint was saved with "
                              "--num-distributed-optimizer-instances 2, this run has 1 (only "
                              "the DP size may change on resume)")
    with pytest.raises(CheckpointError) as err:
        dp_size_changed({**ours, "pp": 2, "dp": 2}, ours)
    assert str(err.value) == ("--load: the checkpoint was saved with "
                              "--pipeline-model-parallel-size 2, this run has 1 (only the DP "
                              "size may change on resume)")
    with pytest.raises(CheckpointError) as err:
        dp_size_changed({**ours, "dp": 2}, ours)
    assert str(err.value) == ("--load: saved with DP 2, resuming with DP 4: "
                              "distributed-optimizer shards cannot be remapped")
    replicated = {**ours, "distributed_optimizer": False}
    assert dp_size_changed({**replicated, "dp": 2}, replicated) is True
