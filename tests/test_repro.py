"""A run reproduces itself (issue 91 item 7): two runs of one job agree bit for bit, but
where DAC's tables differ (DAC sets a later stage's rank from measured wall-clock times,
the one run-dependent input: docs/method.md §6); the comparison of bench/repro.py is
bounded by exactly that."""

import copy
import json
import os
import sys

import torch

from distributed import LAYOUTS, read_jsonl, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.repro import analyse, compare  # noqa: E402


def _records(n=8, table_change=None, **changes):
    """A run's metrics: ``n`` iterations, DAC's rank of stage 1 32 (31 from iteration
    ``table_change``); ``changes``: ``{(iteration, key): value}`` as ``key_at=(it, v)``."""
    out = []
    for it in range(1, n + 1):
        stage1 = 31 if table_change is not None and it >= table_change else 32
        out.append({"iteration": it, "loss": 9.0 - it * 0.1, "grad_norm": 1.0 + it * 0.01,
                    "rank_dp": [8, stage1], "rank_cqm": [8, 8], "rank_pp": 8,
                    "entropy": [-7.0, -5.0]})
    out[-1]["val_loss"] = 6.5
    for key, (it, value) in changes.items():
        out[it - 1][key.removesuffix("_at")] = value
    return out


def _run(i, records, params=None):
    return {"run": i, "records": records, "optimizer_sha256": "x",
            "params": params if params is not None else {"w": torch.arange(6.0).view(2, 3)}}


def test_the_comparison_is_bounded_by_dacs_tables():
    ref = _run(0, _records())
    assert compare(ref, _run(1, _records()))["verdict"] == "alike"
    # DAC's table differs at iteration 5: that iteration's sync (its grad norm) and the
    # next loss may differ, nothing before
    after = _run(2, _records(table_change=5, grad_norm_at=(5, 1.5), loss_at=(6, 8.3)))
    row = compare(ref, after)
    assert row["verdict"] == "dac" and row["table_differs_at"] == 5
    assert row["tables"] == [[8, 32], [8, 31]] and row["numbers_differ_at"] == [5, "grad_norm"]
    # the loss of the iteration the table changes at is made before its sync: unexplained
    assert compare(ref, _run(3, _records(table_change=5, loss_at=(5, 8.4))))["verdict"] \
        == "unexplained"
    # ranks the controllers decided from the figures (the CQM's, the pipeline's) follow
    # them: differing first, they are unexplained, DAC's table differing with them or not
    for key, value in (("rank_cqm_at", [8, 6]), ("rank_pp_at", 6)):
        changed = _run(3, _records(table_change=5, **{key: (5, value)}))
        assert compare(ref, changed)["verdict"] == "unexplained", key
    # equal tables: any difference is unexplained, a figure or one bit of a parameter
    assert compare(ref, _run(4, _records(grad_norm_at=(7, 1.0700001))))["verdict"] \
        == "unexplained"
    w = torch.arange(6.0).view(2, 3)
    w.view(-1)[4] = torch.nextafter(w.view(-1)[4], torch.tensor(9.0))
    row = compare(ref, _run(5, _records(), {"w": w}))
    assert row["verdict"] == "unexplained" and not row["params_alike"]
    assert 0 < row["max_param_diff"] < 1e-6
    other = _run(6, _records())
    other["optimizer_sha256"] = "y"
    assert compare(ref, other)["verdict"] == "unexplained"
    # the analysis: runs grouped by their tables, each checked within its group too
    late = _records(table_change=5, grad_norm_at=(5, 1.5))
    report = analyse([ref, _run(1, _records()), _run(2, late),
                      _run(3, copy.deepcopy(late))])
    assert report["alike"] == 2 and report["dac"] == 2 and report["unexplained"] == []
    assert sorted(report["tables"].values()) == [[0, 1], [2, 3]] and report["groups_alike"]
    drift = copy.deepcopy(late)
    drift[6]["loss"] += 1e-6   # alike in tables with run 2, not in figures
    report = analyse([ref, _run(2, late), _run(3, drift)])
    assert report["unexplained"] == [3] and not report["groups_alike"]


def _job(small_model_argv, tmp_path, name, hash_seed):
    metrics = str(tmp_path / f"{name}.jsonl")
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))   # a cold interpreter each
    results = run_job(small_model_argv + LAYOUTS["tp1-pp2-dp2"] + [
        "--edgc-mode", "edgc", "--edgc-window", "2", "--edgc-iter-sample-rate", "1.0",
        "--edgc-warmup-max-iters", "2", "--edgc-rank-max", "8", "--edgc-rank-min", "2",
        "--edgc-rank-step", "2", "--edgc-pp-compression", "edgc", "--edgc-pp-rank-max", "8",
        "--edgc-pp-rank-min", "2", "--edgc-dac", "off", "--train-iters", "12",
        "--eval-interval", "6", "--metrics-file", metrics], str(tmp_path / name), env=env)
    params = {f"{r['pp']}.{r['dp']}/{k}": v for r in results for k, v in r["params"].items()}
    return read_jsonl(metrics), params


def test_a_run_reproduces_itself_under_another_hash_seed(small_model_argv, tmp_path):
    """EDGC on DP and PP with rank changes, DAC off: two runs under different hash seeds
    (the iteration order of every set and of the dicts built from them) and whatever else
    differs between two runs agree in every figure and parameter, bit for bit."""
    a, pa = _job(small_model_argv, tmp_path, "a", 1)
    b, pb = _job(small_model_argv, tmp_path, "b", 2)
    keys = ("iteration", "loss", "grad_norm", "rank_dp", "rank_pp", "val_loss")
    assert [{k: r.get(k) for k in keys} for r in a] == [{k: r.get(k) for k in keys} for r in b]
    assert sorted(pa) == sorted(pb)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # the ranks changed (the step after a rank change is what issue 91 saw differ)
    dp = [json.dumps(r["rank_dp"]) for r in a if r["rank_dp"] and None not in r["rank_dp"]]
    pp = [r["rank_pp"] for r in a if r.get("rank_pp") is not None]
    assert len(set(dp)) > 1 and len(set(pp)) > 1, (dp, pp)
    assert any(r.get("val_loss") is not None for r in a)
