"""The DiLoCo peer of the race (bench/torch_ddp_peers.py ``--hook diloco``, issue 65):
torchft's own DiLoCo, Manager and ProcessGroupGloo on 2 local processes, meeting at a real
``torchft_lighthouse`` the benchmark starts and stops."""

import os
import sys

import pytest
import torch

import warm
from distributed import read_jsonl

pytest.importorskip("torchft", reason="the optional extra bench (pip install -e '.[bench]')")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR, MOMENTUM, H = 0.7, 0.9, 2


def run_peer(argv, tmp_path, extra):
    dump = tmp_path / "dump"
    dump.mkdir()
    metrics = str(tmp_path / "diloco.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "torch_ddp_peers.py"), "--hook",
           "diloco", "--diloco-sync-every", str(H), "--diloco-outer-lr", str(LR),
           "--diloco-outer-momentum", str(MOMENTUM), "--diloco-dump", str(dump), *argv,
           "--data-parallel-size", "2", "--tensor-model-parallel-size", "1",
           "--pipeline-model-parallel-size", "1", "--global-batch-size", "4",
           "--train-iters", "4", "--eval-interval", "4", "--metrics-file", metrics, *extra]
    proc = warm.run(cmd, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(dump / f"diloco_rank{r}.pt") for r in range(2)]
    return ranks, read_jsonl(metrics), proc


def outer_nesterov(ranks, momentum=MOMENTUM):
    """The global weights after each sync, by hand: the pseudo-gradient ``global − local``
    averaged over the ranks, SGD with Nesterov momentum (``buf = μ buf + Δ``, step
    ``Δ + μ buf``) at the outer learning rate."""
    weights, buf, out = ranks[0]["initial"], None, []
    for k in range(len(ranks[0]["syncs"])):
        delta = {n: sum(weights[n] - r["syncs"][k]["local"][n] for r in ranks) / len(ranks)
                 for n in weights}
        buf = delta if buf is None else {n: momentum * buf[n] + delta[n] for n in delta}
        weights = {n: weights[n] - LR * (delta[n] + momentum * buf[n]) for n in weights}
        out.append(weights)
    return out


def test_two_outer_steps_equal_a_hand_computed_nesterov_step(small_model_argv, tmp_path):
    """4 inner steps at H = 2 on 2 ranks: 2 outer syncs, each rank's weights after them
    equal the hand-computed outer Nesterov step on the averaged pseudo-gradient (and both
    ranks alike); plain averaging, or no momentum, misses it; the bytes are one fp32
    all-reduce of the weights per sync, nothing between; the evaluations at round ends."""
    ranks, records, _ = run_peer(small_model_argv, tmp_path, ["--eval-interval", "3"])
    assert [len(r["syncs"]) for r in ranks] == [2, 2]
    # the evaluation asked at 3 is taken at the round's end before it (issue 80)
    assert [r["iteration"] for r in records if "val_loss" in r] == [2, 4]
    # the ranks trained apart between syncs: their local weights differ
    assert any(not torch.equal(ranks[0]["syncs"][0]["local"][n], ranks[1]["syncs"][0]["local"][n])
               for n in ranks[0]["initial"])
    want = outer_nesterov(ranks)
    no_momentum = outer_nesterov(ranks, momentum=0.0)
    for k in range(2):
        for r in ranks:
            for n, w in want[k].items():
                got = r["syncs"][k]["after"][n]
                assert torch.allclose(got, w, rtol=1e-5, atol=1e-6), (k, n)
        assert all(torch.equal(ranks[0]["syncs"][k]["after"][n], ranks[1]["syncs"][k]["after"][n])
                   for n in want[k])
    averaged = {n: sum(r["syncs"][1]["local"][n] for r in ranks) / 2 for n in want[1]}
    assert max((ranks[0]["syncs"][1]["after"][n] - averaged[n]).abs().max()
               for n in averaged) > 1e-4
    assert max((ranks[0]["syncs"][1]["after"][n] - no_momentum[1][n]).abs().max()
               for n in averaged) > 1e-6
    param_bytes = sum(w.numel() * 4 for w in ranks[0]["initial"].values())
    assert [rec["dp_bytes_sent_job"] for rec in records] == [0, 2 * param_bytes] * 2
    summary = read_summary(tmp_path)
    assert summary["diloco_rounds"] == 2 and summary["diloco_discarded_rounds"] == 0
    assert summary["val_on"] == "the replicas' average"


def test_a_run_stopped_before_its_first_evaluation_ends_cleanly(small_model_argv, tmp_path):
    """The race's timing runs are the loss run's config stopped early (``--exit-interval``,
    issue 80), before any evaluation of a long run: the peer stops there, exit 0, no
    validation loss."""
    _, records, proc = run_peer(small_model_argv, tmp_path,
                                ["--train-iters", "8", "--eval-interval", "8",
                                 "--exit-interval", "2"])
    assert [r["iteration"] for r in records] == [1, 2]
    assert not any("val_loss" in r for r in records)
    assert "exiting at iteration 2 (--exit-interval)" in proc.stdout
    assert "val loss n/a" in proc.stdout


def read_summary(tmp_path) -> dict:
    import json

    with open(tmp_path / "diloco.summary.json") as fh:
        return json.load(fh)


def test_the_dense_warm_up_arm_averages_gradients_then_starts_diloco(small_model_argv,
                                                                     tmp_path):
    """``--diloco-warmup-iters 2`` (the warm-up EDGC gets), then DiLoCo at H = 2 for 4
    inner steps: the warm-up sends every gradient (the ranks stay identical: DiLoCo starts
    from one model on both), then one fp32 all-reduce of the weights per sync; no round
    discarded."""
    ranks, records, proc = run_peer(small_model_argv, tmp_path,
                                    ["--diloco-warmup-iters", "2", "--train-iters", "6",
                                     "--eval-interval", "6"])
    assert "after 2 dense iterations" in proc.stdout
    assert all(torch.equal(ranks[0]["initial"][n], ranks[1]["initial"][n])
               for n in ranks[0]["initial"])
    assert [len(r["syncs"]) for r in ranks] == [2, 2]
    param_bytes = sum(w.numel() * 4 for w in ranks[0]["initial"].values())
    assert [rec["dp_bytes_sent_job"] for rec in records] == \
        [2 * param_bytes] * 2 + [0, 2 * param_bytes] * 2
    summary = read_summary(tmp_path)
    assert summary["diloco_rounds"] == 2 and summary["diloco_discarded_rounds"] == 0


def test_bad_diloco_flags_fail_before_any_process_starts(small_model_argv, tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "torch_ddp_peers.py"), "--hook",
           "diloco", "--diloco-sync-every", "8", "--diloco-fragments", "3", *small_model_argv]
    proc = warm.run(cmd, timeout=120)
    assert proc.returncode == 2
    assert "--diloco-fragments: must be >= 1 and divide --diloco-sync-every 8" in proc.stderr


def test_outer_lr_one_without_momentum_is_plain_averaging(small_model_argv, tmp_path):
    """The tuning grid's floor (issue 72): outer lr 1, momentum 0 is LocalSGD's plain
    averaging: after each sync both ranks hold the mean of their local weights (torch's
    Nesterov SGD refuses momentum 0: the peer steps plain SGD there)."""
    ranks, _, _ = run_peer(small_model_argv, tmp_path, ["--diloco-outer-lr", "1.0",
                                                        "--diloco-outer-momentum", "0"])
    for k in range(2):
        for n in ranks[0]["initial"]:
            mean = sum(r["syncs"][k]["local"][n] for r in ranks) / 2
            assert torch.allclose(ranks[0]["syncs"][k]["after"][n], mean, rtol=1e-5,
                                  atol=1e-6), (k, n)
