"""The race's timing and pricing of issue 93 (``bench/peers.py``): the modes' order rotated
between repetitions, every EDGC iteration priced at the rank it ran (EDGC pinned at each
rank), its share of time per rank, the matched-bytes static, the per-iteration spread
against static and the figure; pure functions on synthetic records."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench.peers as peers  # noqa: E402


def test_the_order_rotates_between_repetitions():
    """Every mode once per repetition; with no more modes than repetitions each is first
    in one; with more, each runs early and late, its neighbours kept."""
    names = ["a", "b", "c"]
    orders = [peers.time_order(names, rep, 3) for rep in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert sorted(o[0] for o in orders) == names
    # 5 repetitions of 3 modes: each first at least once
    assert {peers.time_order(names, rep, 5)[0] for rep in range(5)} == set(names)
    many = [f"m{i}" for i in range(20)]
    orders = [peers.time_order(many, rep, 5) for rep in range(5)]
    assert all(sorted(o) == sorted(many) for o in orders)
    assert [o.index("m0") for o in orders] == [0, 16, 12, 8, 4]
    assert [o[0] for o in orders] == ["m0", "m4", "m8", "m12", "m16"]
    assert all(o[(o.index("m5") + 1) % 20] == "m6" for o in orders)
    assert peers.time_order([], 2, 5) == []
    assert peers.REPEATS >= 5


def test_the_timing_runs_in_the_rotated_order(tmp_path, monkeypatch):
    """run_timing launches each repetition's modes in :func:`time_order`'s order."""
    import bench.report

    class Net:
        def __init__(self, n, rate):
            pass

        def __enter__(self):
            return self

        def close(self):
            pass
    launched = []

    def fake_run(name, flags, out, iters, reuse, script, launch):
        launched.append(name)
        return [], {}
    monkeypatch.setattr(peers, "ShapedNetwork", Net)
    monkeypatch.setattr(peers, "run_pretrain", fake_run)
    monkeypatch.setattr(bench.report, "machine", lambda: "a test CPU")
    only = ["dense fp32", "bf16 wire", "uint8"]
    peers.run_timing(str(tmp_path), 200, 96, only=only, rates=["100mbit"], repeats=3)
    assert launched == ["dense_fp32_rep0", "bf16_wire_rep0", "uint8_rep0",
                        "bf16_wire_rep1", "uint8_rep1", "dense_fp32_rep1",
                        "uint8_rep2", "dense_fp32_rep2", "bf16_wire_rep2"]


def test_the_pinned_modes_are_edgc_at_one_rank():
    """EDGC's flags with r_max = r_min = r, per precision, timing only; their precision,
    twin and owner follow their EDGC's."""
    table = peers.modes()
    flags = table["EDGC pinned r8"][1]
    assert flags[flags.index("--edgc-rank-max") + 1] == "8"
    assert flags[flags.index("--edgc-rank-min") + 1] == "8"
    assert [f for f in flags if not f.isdigit()] == [
        f for f in table["EDGC"][1] if not f.isdigit()]
    assert peers.precision("EDGC bf16 grads pinned r16") == "bf16"
    assert "--grad-reduce-in-bf16" in table["EDGC bf16 grads pinned r24"][1]
    assert peers.twin("EDGC pinned r24") == "EDGC" and peers.ours("EDGC pinned r24")
    assert peers.timing_only("EDGC pinned r8") and not peers.timing_only("EDGC")
    assert not peers.ours("hook r_max")


def _timing_run(warm_ms, rank, ms, n=40, warm=10, first_extra=90.0):
    """A timing run's records: dense to ``warm`` at ``warm_ms``, then ``rank`` at ``ms``
    (the change's iteration dearer)."""
    records = [{"iteration": i, "rank_dp": [None], "iter_ms": warm_ms,
                "dp_bytes_sent_job": 2**20} for i in range(1, warm + 1)]
    records[-1]["dense_end_iter"] = warm
    records += [{"iteration": i, "rank_dp": [rank], "dp_bytes_sent_job": 2**20,
                 "iter_ms": ms + (i == warm + 1) * first_extra} for i in range(warm + 1, n + 1)]
    return records


def _edgc_loss_run(val=(6.0, 5.0, 4.0, 3.0)):
    """An EDGC loss run of 40 iterations: dense to 10, then r8, r16, r32 and, at 40, an
    exploring iteration the bypass sent dense."""
    ranks = [None] * 10 + [8] * 10 + [16] * 10 + [32] * 9 + [None]
    records = [{"iteration": i, "rank_dp": [r], "dp_bypassed_buckets": 0,
                "dp_bytes_sent_job": 1000 + 100 * (r or 280)}
               for i, r in enumerate(ranks, start=1)]
    records[9]["dense_end_iter"] = 10
    records[39].update(dp_bypassed_buckets=1, dp_bypass_explored=True)
    for i, v in zip((10, 20, 30, 40), val):
        records[i - 1]["val_loss"] = v
    return records


def _race(pinned=True, dense_wire=True, reps=2):
    """A synthetic race on 100 Mbit: EDGC's own timing (r32 at 400 ms, its warm-up 700),
    EDGC pinned at r8 and r16 (250 and 300 ms; repetition 1 10 ms dearer), this product's
    dense sync (900 ms), static r_max (380 ms) and dense fp32 (1000 ms)."""
    fig = lambda recs: peers.timing_figures(recs)  # noqa: E731
    timing = {"EDGC": [fig(_timing_run(700.0, 32, 400.0)) for _ in range(reps)],
              "static r_max": [fig(_timing_run(700.0, 32, 380.0, warm=1))
                               for _ in range(reps)],
              "dense fp32": [fig(_timing_run(1000.0, None, 1000.0, warm=1))
                             for _ in range(reps)]}
    if pinned:
        for rank, ms in ((8, 250.0), (16, 300.0)):
            timing[peers.pinned_name("EDGC", rank)] = [
                fig(_timing_run(700.0, rank, ms + 10 * rep)) for rep in range(reps)]
    if dense_wire:
        timing["ours dense bf16 wire"] = [fig(_timing_run(900.0, None, 900.0, warm=1))
                                          for _ in range(reps)]
    static = [{"iteration": i, "rank_dp": [32], "dp_bypassed_buckets": 0} for i in range(1, 41)]
    for i, v in zip((10, 20, 30, 40), (6.0, 5.0, 4.0, 3.2)):
        static[i - 1]["val_loss"] = v
    dense = [{"iteration": i, "rank_dp": [None]} for i in range(1, 41)]
    for i, v in zip((10, 20, 30, 40), (6.0, 5.5, 5.0, 4.5)):
        dense[i - 1]["val_loss"] = v
    return {"loss": {"dense fp32": {1: dense, 2: dense}},
            "loss_at": {"100mbit": {"EDGC": {1: _edgc_loss_run(), 2: _edgc_loss_run()},
                                    "static r_max": {1: static, 2: static}}},
            "time": {"100mbit": timing}, "session": {}}


def test_every_edgc_iteration_is_priced_at_the_rank_it_ran():
    """Issue 93: the dense warm-up at EDGC's measured warm-up, r8 and r16 at the pinned
    runs' cost of the same repetition, r32 at EDGC's own, an exploring iteration that sent
    dense at this product's dense sync; without the pinned runs, every rank at r32's (the
    nearest timed), without the dense sync timed, the explored one at the steady cost."""
    data = _race()
    records = _edgc_loss_run()
    assert peers.rank_prices(data["time"]["100mbit"], "EDGC", 0) == {8: 250.0, 16: 300.0,
                                                                     32: 400.0}
    assert peers.rank_prices(data["time"]["100mbit"], "EDGC", 1) == {8: 260.0, 16: 310.0,
                                                                     32: 400.0}
    cost = [r["iter_ms"] for r in peers.price_run(data, "100mbit", "EDGC", records, 0)]
    assert cost == [700.0] * 10 + [250.0] * 10 + [300.0] * 10 + [400.0] * 9 + [900.0]
    assert sum(peers.price_run(data, "100mbit", "EDGC", records, 1)[i]["iter_ms"]
               for i in range(40)) == 7000 + 2600 + 3100 + 3600 + 900
    # a rank between the timed ones: linear between them
    between = [dict(r, rank_dp=[12]) if r["iteration"] == 15 else r for r in records]
    assert peers.price_run(data, "100mbit", "EDGC", between, 0)[14]["iter_ms"] == 275.0
    old = _race(pinned=False, dense_wire=False)
    cost = [r["iter_ms"] for r in peers.price_run(old, "100mbit", "EDGC", records, 0)]
    assert cost == [700.0] * 10 + [400.0] * 30
    # a timing run whose own bypass sent iterations dense prices them itself
    bypassed = _timing_run(700.0, 32, 400.0)
    for r in bypassed[20:]:
        r.update(rank_dp=[None], dp_bypassed_buckets=1, iter_ms=500.0)
    data["time"]["100mbit"]["EDGC"][0] = peers.timing_figures(bypassed)
    assert data["time"]["100mbit"]["EDGC"][0]["dense_ms"] == 500.0
    assert peers.price_run(data, "100mbit", "EDGC", records, 0)[39]["iter_ms"] == 500.0
    # the time to target sums the prices: 3.0 is reached at the last evaluation
    ttt = peers.times_to_target(_race(), "100mbit", 3.0)
    assert ttt["EDGC"] == {(1, 0): 17.0, (1, 1): 17.2, (2, 0): 17.0, (2, 1): 17.2}


def test_edgc_share_of_time_at_each_rank():
    """Issue 93: EDGC's priced time and iterations per rank bin, per link and precision."""
    priced = peers.price_run(_race(), "100mbit", "EDGC", _edgc_loss_run(), 0)
    shares = peers.rank_shares(priced)
    assert list(shares) == ["dense warm-up", "dense (bypass)", "r ≤ 8", "r9–16", "r17–24",
                            "r25–31", "r32"]
    assert shares["dense warm-up"] == pytest.approx((7000 / 17000, 10 / 40))
    assert shares["dense (bypass)"] == pytest.approx((900 / 17000, 1 / 40))
    assert shares["r ≤ 8"] == pytest.approx((2500 / 17000, 10 / 40))
    assert shares["r9–16"] == pytest.approx((3000 / 17000, 10 / 40))
    assert shares["r17–24"] == (0.0, 0.0)
    assert shares["r32"] == pytest.approx((3600 / 17000, 9 / 40))
    rows = peers.share_table(_race()).splitlines()
    assert len(rows) == 3 and rows[2].startswith("| 100 Mbit | fp32 | r8, r16, r32 | ")
    cells = rows[2].split(" | ")
    # repetition 0: 2500 / 17000 = 14.7 %, repetition 1: 2600 / 17200 = 15.1 %
    assert cells[5] == "14.9 (14.7–15.1) % / 25.0 (25.0–25.0) %"
    assert cells[4] == "5.3 (5.2–5.3) % / 2.5 (2.5–2.5) %"
    assert "| 100 Mbit | fp32 | r32 | " in peers.share_table(_race(pinned=False))


def test_edgc_over_static_per_iteration_paired_per_repetition():
    """Issue 93: the steady ms/iter of EDGC's and static's timing runs paired per
    repetition, and the priced time per iteration to the target paired per seed ×
    repetition."""
    data = _race()
    data["time"]["100mbit"]["static r_max"][1] = peers.timing_figures(
        _timing_run(700.0, 32, 410.0, warm=1))
    rows = peers.per_iteration_table(data, {}).splitlines()
    assert len(rows) == 3
    # 400 / 380 and 400 / 410
    assert rows[2].startswith("| 100 Mbit | fp32 | 1.01 (0.98–1.05)× not resolved (2) | ")


def test_the_matched_bytes_static(tmp_path):
    """Issue 93: the static rank whose DP bytes per compressed iteration match EDGC's, from
    the byte accounting its records show (bytes linear in the rank), its warm-up and the
    iterations the bypass sent dense left out; written by --phase match-static, raced as
    "static matched@RATE" per link, its loss runs named for the link."""
    run = _edgc_loss_run()   # compressed: 10 x r8, 10 x r16, 9 x r32: mean rank 18.2
    m = peers.matched_rank([run])
    assert m["rank"] == 18 and m["iterations"] == 29
    assert m["edgc_mean_rank"] == pytest.approx((80 + 160 + 288) / 29)
    assert m["fit_mib"] == pytest.approx([1000 / 2**20, 100 / 2**20])
    assert m["matched_mib"] == pytest.approx(2800 / 2**20)
    only16 = [dict(r, rank_dp=[16]) if r["iteration"] > 10 and r["rank_dp"] != [None] else r
              for r in run]
    assert peers.matched_rank([only16])["rank"] == 16
    assert peers.matched_rank([run[:10]])["rank"] is None
    # rounding to the nearest rank: a mean of 26.5 goes up
    half = [{"iteration": i, "rank_dp": [r], "dp_bytes_sent_job": 100 * r}
            for i, r in enumerate([24] * 2 + [29] * 2, start=1)]
    assert peers.matched_rank([half])["rank"] == 27

    loss = tmp_path / "loss"
    loss.mkdir()
    for seed in (1234, 1235):
        (loss / f"EDGC@100mbit_seed{seed}.jsonl").write_text("\n".join(map(json.dumps, run)))
        (loss / f"EDGC@100mbit_seed{seed}.summary.json").write_text("{}")
    try:
        result = peers.match_static(str(tmp_path))
        assert result["fp32"]["100mbit"]["rank"] == 18 and "bf16" not in result
        assert json.loads((tmp_path / "static_matched.json").read_text()) == result
        name = "static matched@100mbit"
        flags = peers.modes()[name][1]
        assert flags[flags.index("--edgc-rank") + 1] == "18"
        assert flags[:flags.index("--edgc-rank")] == \
            peers.modes()["static r_max"][1][:flags.index("--edgc-rank")]
        assert peers.precision(name) == "fp32" and peers.bypassing(name) and peers.ours(name)
        assert peers.twin("static matched bf16@1gbit") == "static r_max bf16"
        assert peers.on_link(name, "100mbit") and not peers.on_link(name, "1gbit")
        assert peers.loss_stem(name, "100mbit") == "static_matched@100mbit"
        assert peers.loss_stem("EDGC", "100mbit") == "EDGC@100mbit"
        (loss / "static_matched@100mbit_seed1234.jsonl").write_text(
            "\n".join(map(json.dumps, run)))
        (loss / "static_matched@100mbit_seed1234.summary.json").write_text("{}")
        data = peers.collect(str(tmp_path), 40, 40)
        assert list(data["loss_at"]["100mbit"]) == ["EDGC", name]
        # the report's table: EDGC against it, paired by the one rule; the final loss per seed
        race = _race()
        race["loss_at"]["100mbit"][name] = {1: _edgc_loss_run((6.0, 5.0, 4.0, 3.1)),
                                           2: _edgc_loss_run((6.0, 5.0, 4.0, 3.05))}
        race["time"]["100mbit"][name] = [peers.timing_figures(_timing_run(700.0, 18, 420.0))
                                         for _ in range(2)]
        table, verdicts = peers.report(race)
        assert len(verdicts["100mbit"]["vs_matched"]["EDGC"]) == 4
        row = peers.matched_table(race, verdicts).splitlines()[2]
        # EDGC 17.0 s (17.2 s in repetition 1) against 10 x 700 + 29 x 420 + 900 ms
        assert row == ("| 100 Mbit | fp32 | r18 (0.003, r18.2; 0.003) | 0.85 (0.85–0.86)× "
                       "faster | -0.0750 (-0.1000–-0.0500) lower |")
        assert "| 100 Mbit | bf16 | not chosen" in peers.matched_table(race, verdicts)
    finally:
        peers.MATCHED.clear()
    assert not [m for m in peers.modes() if "matched" in m]


def test_the_figure_draws_a_line_per_mode(tmp_path):
    """Issue 93: validation loss against priced time, a panel per link and precision, a
    line per mode with a curve and a timing there; a PNG."""
    path = tmp_path / "race.png"
    drawn = peers.race_figure(_race(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == {("100mbit", "fp32"): ["dense fp32", "static r_max", "EDGC"],
                     ("100mbit", "bf16"): []}
    text = peers.issue93_text(_race(), {}, str(path))
    assert f"]({os.path.relpath(str(path), peers.ROOT)})" in text
    assert "not timed: " in text and "EDGC bf16 grads pinned r8" in text
