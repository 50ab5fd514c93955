"""bench/pareto.py's bookkeeping: which file a run's summary comes from."""

import json

from bench import pareto


def _record(tmp_path, monkeypatch, val_loss):
    monkeypatch.setattr(pareto, "RESULTS", str(tmp_path / "results"))
    path = pareto.run_record_path("tiny-dp4", "static-r8", 1235)
    (tmp_path / "results" / "runs" / "tiny-dp4").mkdir(parents=True)
    with open(path, "w") as fh:
        json.dump({"entry": {"name": "static-r8", "seed": 1235, "val_loss": val_loss}}, fh)
    return path


def test_a_stopped_runs_partial_metrics_do_not_shadow_the_committed_record(tmp_path,
                                                                            monkeypatch):
    _record(tmp_path, monkeypatch, 4.9134)
    metrics = tmp_path / "static-r8-s1235.jsonl"  # a run stopped at iteration 2: no summary
    metrics.write_text("".join(json.dumps({"iteration": i, "loss": 9.0}) + "\n"
                               for i in (1, 2)))
    entry = pareto.summarize_run("tiny-dp4", "static-r8", "static", 1235, str(metrics))
    assert entry["val_loss"] == 4.9134


def test_a_run_finished_here_is_summarized_from_its_metrics(tmp_path, monkeypatch):
    record = _record(tmp_path, monkeypatch, 4.9134)
    metrics = tmp_path / "static-r8-s1235.jsonl"
    rows = [{"iteration": i, "loss": 5.0, "dp_bytes_sent_job": 10 if i > 120 else 40,
             "dp_bytes_dense_job": 40} for i in range(1, 201)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "static-r8-s1235.summary.json").write_text(json.dumps({"val_loss": 4.95}))
    entry = pareto.summarize_run("tiny-dp4", "static-r8", "static", 1235, str(metrics))
    assert entry["val_loss"] == 4.95
    assert entry["dp_bytes_sent"] == 80 * 10 and entry["iterations_after_warmup"] == 80
    assert json.load(open(record))["entry"]["val_loss"] == 4.95  # the record is rewritten
