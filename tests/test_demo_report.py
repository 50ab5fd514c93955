"""The demo's time to loss (scripts/plot_run.py, scripts/demo.py) on synthetic records:
training seconds are the cumulative ms/iter, the time to a loss is interpolated between the
evaluations around it, and the loss-against-time plot is drawn."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot_run = load("plot_run")


def records(iter_ms, val, n=6, bytes_job=1000):
    """``n`` iterations of ``iter_ms`` each, ``val`` = {iteration: validation loss}."""
    out = []
    for i in range(1, n + 1):
        r = {"iteration": i, "loss": 6.0 - 0.1 * i, "iter_ms": iter_ms,
             "dp_bytes_sent_job": bytes_job}
        if i in val:
            r["val_loss"] = val[i]
        out.append(r)
    return out


VAL = {2: 5.0, 4: 4.0, 6: 3.5}


def test_elapsed_seconds_are_the_cumulative_iteration_times():
    recs = records(100.0, VAL)
    assert plot_run.elapsed_s(recs) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    # a modelled link adds its time per iteration
    assert plot_run.elapsed_s(recs, lambda r: r["dp_bytes_sent_job"] / 10) == \
        pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.2])
    evaluations = plot_run.evaluations(recs)
    assert [(i, loss) for _, i, loss in evaluations] == [(2, 5.0), (4, 4.0), (6, 3.5)]
    assert [t for t, _, _ in evaluations] == pytest.approx([0.2, 0.4, 0.6])


def test_time_to_loss_interpolates_between_the_evaluations_around_it():
    recs = records(100.0, VAL)
    # 4.5 lies halfway between 5.0 (0.2 s) and 4.0 (0.4 s)
    assert plot_run.time_to_loss(recs, 4.5) == pytest.approx(0.3)
    assert plot_run.time_to_loss(recs, 3.75) == pytest.approx(0.5)
    assert plot_run.time_to_loss(recs, 4.0) == pytest.approx(0.4)    # an evaluation's own
    assert plot_run.time_to_loss(recs, 6.0) == pytest.approx(0.2)    # the first already
    assert plot_run.time_to_loss(recs, 3.0) is None                  # never reached
    # the first evaluation at or below: a later rise does not count
    bumpy = records(100.0, {2: 5.0, 4: 4.0, 6: 4.6})
    assert plot_run.time_to_loss(bumpy, 4.5) == pytest.approx(0.3)
    assert plot_run.time_to_loss(recs, 4.5, lambda r: 100.0) == pytest.approx(0.6)


def test_the_demo_line_gives_each_runs_time_to_the_higher_final_loss_and_the_ratio():
    demo = load("demo")
    runs = {"dense": records(200.0, {2: 5.0, 4: 4.0, 6: 3.4}),
            "edgc": records(100.0, VAL)}
    assert plot_run.common_target(runs) == 3.5
    # dense: between 4.0 (0.8 s) and 3.4 (1.2 s), 5/6 of the way: 1.1333 s; edgc: 0.6 s
    line = demo.time_to_loss_line(runs)
    assert line == ("time to val loss 3.5000 (the higher final; training seconds: sum of "
                    "ms/iter, evaluations excluded; linear between the evaluations around "
                    "it): dense 1.1 s, edgc 0.6 s; edgc/dense 0.53x")
    modelled = demo.time_to_loss_line(runs, lambda r: 100.0, " (modelled)")
    assert "training seconds (modelled)" in modelled
    assert modelled.endswith("dense 1.7 s, edgc 1.2 s; edgc/dense 0.71x")
    three = {"dense": runs["dense"], "dense-bf16": records(150.0, {2: 5.0, 4: 4.0, 6: 3.4}),
             "edgc": runs["edgc"]}      # the last run against each of the others
    assert demo.time_to_loss_line(three).endswith(
        "dense 1.1 s, dense-bf16 0.8 s, edgc 0.6 s; edgc/dense 0.53x; edgc/dense-bf16 0.71x")
    runs["edgc"] = records(100.0, {})
    assert plot_run.common_target(runs) is None
    assert demo.time_to_loss_line(runs) == "time to loss: a run has no validation loss"


def test_plots_include_the_loss_against_time(tmp_path):
    paths = []
    for name, ms in (("dense", 200.0), ("edgc", 100.0)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records(ms, VAL)))
        paths.append(str(path))
    written = plot_run.plot(paths, str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in written] == ["loss.png", "loss_time.png"]
    assert all(os.path.getsize(p) > 1000 for p in written)
