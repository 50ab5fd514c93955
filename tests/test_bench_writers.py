"""Benchmark writers regenerate their section from every recorded run: a run of one
testbed keeps the other testbeds' rows (issue 42 item 8: a sweep of small-dp4 alone once
rewrote the pareto tables without tiny-dp4 and tiny-pp2)."""

import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def test_pareto_writer_for_one_testbed_keeps_the_other_testbeds(tmp_path, monkeypatch):
    import bench.pareto as pareto
    import bench.report as report

    results = tmp_path / "results"
    for testbed in ("tiny-dp4", "small-dp4"):   # two runs of each from the committed records
        src = os.path.join(ROOT, "bench", "results", "pareto", "runs", testbed)
        dst = results / "runs" / testbed
        dst.mkdir(parents=True)
        for name in sorted(os.listdir(src))[:2]:
            shutil.copy(os.path.join(src, name), dst / name)
    bench_md = tmp_path / "BENCHMARKS.md"
    monkeypatch.setattr(pareto, "RESULTS", str(results))
    monkeypatch.setattr(pareto, "RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(report, "BENCHMARKS", str(bench_md))
    monkeypatch.setattr(sys, "argv", ["pareto.py", "--testbed", "small-dp4", "--report-only"])
    assert pareto.main() == 0
    entries = json.load(open(results / "summary.json"))
    assert sorted({e["testbed"] for e in entries}) == ["small-dp4", "tiny-dp4"]
    assert len(entries) == 4
    text = bench_md.read_text()
    for e in entries:   # every run's row is in its testbed's table
        section = text.split(f"### {e['testbed']}")[1].split("###")[0]
        assert f"| {e['name']} |" in section, (e["testbed"], e["name"])


def test_slow_links_writer_for_one_config_keeps_the_other_configs_rows():
    """bench/slow_links.py run for one config and rate writes its table from this run's
    rows and every row of the previous results.json: the other config's rows survive."""
    from bench import slow_links

    with open(os.path.join(ROOT, "bench", "results", "slow_links", "results.json")) as fh:
        small = json.load(fh)["results"]    # the committed run: small at three rates
    # an earlier run of tiny at 100 Mbit (the small rows' figures under tiny's mode names)
    previous = {k.replace("small|300mbit|", "tiny|100mbit|").replace("r64", "r32")
                .replace("r16", "r8"): v for k, v in small.items()
                if k.startswith("small|300mbit|")}
    previous.update(small)
    this_run = {k: v for k, v in small.items() if k.startswith("small|300mbit|")}
    rows, configs, rates = slow_links.merge_recorded(this_run, previous)
    assert configs == ["tiny", "small"] and rates == ["100mbit", "300mbit", "1gbit", "none"]
    table = slow_links.table(rows, configs, rates, 30)
    assert "**small**" in table and "**tiny**" in table
    for cname in configs:
        section = table.split(f"**{cname}**")[1].split("**", 1)[0]
        for rate in slow_links.rates_of(rows, cname, rates):
            link = "unshaped" if rate == "none" else \
                rate.replace("mbit", " Mbit").replace("gbit", " Gbit")
            assert f"| {link} | dense |" in section, (cname, rate)
    alone, configs_alone, _ = slow_links.merge_recorded(this_run, {})
    assert configs_alone == ["small"] and slow_links.rates_of(alone, "small", rates) == \
        ["300mbit"]


def test_a_timed_step_runs_no_give_back(monkeypatch):
    """Issue 81: the benchmarks' steps report their outcome (applied) outside the timing,
    as the optimizer does; an unreported step would be settled as a skip when the next one
    begins, and its give-back (``E += A Bᵀ``) timed inside that ``start``."""
    import torch

    from bench.step_phases import time_method
    from megatron_edgc.compression import unit_state

    gave_back, settle = [], unit_state.UnitState.settle

    def watched(self, applied):
        if not applied and self._factors:
            gave_back.append(len(self._factors))
        return settle(self, applied)

    monkeypatch.setattr(unit_state.UnitState, "settle", watched)
    out = time_method("after", [(64, 48), (48, 32), (1, 16)], 4, "cpu", repeats=3,
                      warmup=1)
    assert out["step"] > 0 and gave_back == []
    monkeypatch.setattr(unit_state.UnitState, "settle", settle)
    # the watcher sees one where a step goes unreported
    from megatron_edgc.compression.powersgd import BucketCompressor

    monkeypatch.setattr(unit_state.UnitState, "settle", watched)
    comp = BucketCompressor([("w", (64, 48))], 4, seed=0)
    for _ in range(2):
        bufs, step = comp.start([torch.randn(64, 48)])
        comp.finish(step, comp.middle(step, bufs))
    assert gave_back == [1]
