"""The race's one verdict rule (``bench/peers.py``, issue 72): over the paired ratios
(seeds × repetitions), "faster" or "slower" only where every ratio is on one side of 1,
"not resolved" otherwise."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peers import ratio_verdict  # noqa: E402


def test_a_verdict_needs_the_whole_range_on_one_side_of_one():
    assert ratio_verdict([0.80, 0.92, 0.99]) == "0.92 (0.80–0.99)× faster"
    assert ratio_verdict([1.01, 1.10, 1.30]) == "1.10 (1.01–1.30)× slower"
    # one repetition on the other side: the spread does not resolve it
    assert ratio_verdict([0.80, 0.85, 1.02]) == "0.85 (0.80–1.02)× not resolved"
    assert ratio_verdict([1.00]) == "1.00× not resolved"
    assert ratio_verdict([]) == "—"
    # the printed range shows the rule: a bound that rounds to 1 takes more digits
    assert ratio_verdict([0.94, 0.96, 0.998]) == "0.960 (0.940–0.998)× faster"
    assert ratio_verdict([1.0004, 1.04, 1.08]) == "1.0400 (1.0004–1.0800)× slower"


def test_the_goal_is_judged_by_the_same_rule():
    from bench.peers import goal_table, goal_verdict
    assert goal_verdict([0.56, 0.61, 0.68], 0.85) == "0.61 (0.56–0.68)× ≤ 0.85: met"
    assert goal_verdict([0.86, 0.87, 0.89], 0.85) == "0.87 (0.86–0.89)× ≤ 0.85: missed"
    assert goal_verdict([0.80, 0.87, 0.89], 0.85) == "0.87 (0.80–0.89)× ≤ 0.85: open"
    assert goal_verdict([0.95, 0.97, 1.0], 1.0) == "0.97 (0.95–1.00)× ≤ 1: met"   # at the bound
    # a range that rounds onto the bound takes more digits
    assert goal_verdict([0.8504, 0.86], 0.85) == "0.8552 (0.8504–0.8600)× ≤ 0.85: missed"
    table = goal_table({"100mbit": {"best_peer": {"fp32": "hook r_max", "bf16": "dense bf16"},
                                    "vs_peer": {"EDGC bf16 grads": [0.6, 0.7]}}})
    assert "| 100 Mbit | bf16 | dense bf16 | 0.65 (0.60–0.70)× ≤ 0.85: met | — | — |" in table
    assert "| 100 Mbit | fp32 | hook r_max | no pairs | — | — |" in table


def test_the_time_to_target_splits_into_iterations_and_their_cost():
    from bench.peers import time_split
    # seed 1: EDGC needs 1.1x the peer's iterations; seed 2: 0.9x; two repetitions each
    ttt = {"EDGC": {(1, 0): 110.0, (1, 1): 121.0, (2, 0): 72.0, (2, 1): 90.0},
           "peer": {(1, 0): 100.0, (1, 1): 100.0, (2, 0): 100.0, (2, 1): 100.0}}
    iters = {"EDGC": [1100, 900], "peer": [1000, 1000]}
    loss = {"EDGC": {1: [], 2: []}, "peer": {1: [], 2: []}}
    split = time_split(ttt, iters, loss, "EDGC", "peer")
    assert split["iterations"] == pytest.approx([1.1, 0.9])
    # each pair's time ratio is its seed's iteration ratio times the per-iteration one
    assert split["per_iteration"] == pytest.approx([1.0, 1.1, 0.8, 1.0])
    for (seed, rep), cost in zip(sorted(ttt["EDGC"]), split["per_iteration"]):
        assert ttt["EDGC"][(seed, rep)] / ttt["peer"][(seed, rep)] == pytest.approx(
            cost * split["iterations"][seed - 1])


def test_one_timing_session_per_race_on_the_landed_code(tmp_path, monkeypatch):
    """Timing runs of another commit (or of before sessions were recorded) are moved
    aside, never reused; runs of the same code are kept for the session to go on."""
    import json

    import bench.report
    from bench.peers import timing_session

    monkeypatch.setattr(bench.report, "machine", lambda: "a test CPU")
    out = str(tmp_path)
    old = tmp_path / "time" / "100mbit"
    old.mkdir(parents=True)
    (old / "EDGC_rep0.summary.json").write_text("{}")   # no session.json: unknown code
    first = timing_session(out, "aaaa")
    assert first["code"] == "aaaa" and first["machine"] == "a test CPU"
    assert (tmp_path / "time-unknown" / "100mbit" / "EDGC_rep0.summary.json").exists()
    assert sorted(p.name for p in (tmp_path / "time").iterdir()) == ["session.json"]
    kept = tmp_path / "time" / "1gbit"
    kept.mkdir()
    (kept / "EDGC_rep0.summary.json").write_text("{}")
    assert timing_session(out, "aaaa") == first          # the same code: the session goes on
    assert (kept / "EDGC_rep0.summary.json").exists()
    second = timing_session(out, "bbbb")                  # new code: a new session
    assert second["code"] == "bbbb"
    assert (tmp_path / "time-aaaa" / "1gbit" / "EDGC_rep0.summary.json").exists()
    assert json.loads((tmp_path / "time" / "session.json").read_text()) == second
    # the modes trained in bf16 have a session of their own (timed on a CPU with bf16
    # instructions): starting it leaves the fp32 session alone
    bf16 = timing_session(out, "cccc", "bf16")
    assert bf16["code"] == "cccc" and (tmp_path / "time-bf16" / "session.json").exists()
    assert timing_session(out, "bbbb") == second


def test_each_precision_is_read_from_its_own_session(tmp_path):
    """The report prices a mode from its precision's timing session only, and names each
    session; a race timed before the split (one ``time/`` for both) still reads."""
    import json

    import bench.peers as peers

    def timed(folder, mode, ms):
        (tmp_path / folder / "100mbit").mkdir(parents=True, exist_ok=True)
        records = [{"iteration": i, "iter_ms": ms, "grad_sync_ms": 1.0,
                    "dp_bytes_sent_job": 2**20} for i in range(1, 5)]
        (tmp_path / folder / "100mbit" / f"{mode}_rep0.jsonl").write_text(
            "\n".join(map(json.dumps, records)))
        (tmp_path / folder / "100mbit" / f"{mode}_rep0.summary.json").write_text("{}")

    timed("time", "dense_fp32", 10.0)
    timed("time", "dense_bf16", 99.0)        # a legacy run: read while no bf16 session exists
    data = peers.collect(str(tmp_path), 200, 4)
    assert data["time"]["100mbit"]["dense bf16"][0]["iter_ms"] == 99.0
    assert peers.sessions_text(data["session"]) == "fp32 and bf16: timed before sessions " \
        "were recorded"
    timed("time-bf16", "dense_bf16", 7.0)
    for prec, code in (("fp32", "aaaa"), ("bf16", "bbbb")):
        (tmp_path / peers.TIME_DIRS[prec] / "session.json").write_text(json.dumps(
            {"code": code, "started": "2026-12-05 22:00 UTC", "machine": f"CPU {code}"}))
    data = peers.collect(str(tmp_path), 200, 4)
    assert [f["iter_ms"] for f in data["time"]["100mbit"]["dense bf16"]] == [7.0]
    assert [f["iter_ms"] for f in data["time"]["100mbit"]["dense fp32"]] == [10.0]
    assert peers.sessions_text(data["session"]) == (
        "fp32: code aaaa, started 2026-12-05 22:00 UTC, CPU aaaa; "
        "bf16: code bbbb, started 2026-12-05 22:00 UTC, CPU bbbb")


def test_the_diloco_tuning_grid_and_its_rule():
    """Per H: 6 outer steps (the floor, lr 1 without momentum, among them) and a dense
    warm-up arm, each at 1x and 0.5x the inner lr; the lowest final val loss is chosen; the
    race runs the chosen setting beside the paper's."""
    import bench.peers as peers

    grid = peers.diloco_grid(8, 2000)
    assert len(grid) == 14 and all(f[f.index("--diloco-sync-every") + 1] == "8"
                                   for f in grid.values())
    floor = grid["DiLoCo H8 outer 1/0 inner x0.5"]
    assert floor[floor.index("--lr") + 1] == "0.0005"            # tiny-cpu's 1e-3, halved
    # the dense warm-up EDGC gets: the first window (20) end from 2 % of 2000
    assert peers.edgc_dense_iters(2000) == 40 and peers.edgc_dense_iters(200) == 20
    warm = grid["DiLoCo H8 outer 0.7/0.9 inner x1 after 40 dense"]
    assert warm[warm.index("--diloco-warmup-iters") + 1] == "40"
    first, halved = peers.tuning_stages(grid)
    assert len(first) == 7 and all(" inner x1" in n for n in first)
    assert halved(first[0]) in grid and " inner x0.5" in halved(first[0])
    assert peers.choose_tuned({"b": 4.9, "a": 4.9, "c": 5.1}) == "a"
    assert "DiLoCo H8 tuned" not in peers.modes()
    peers.TUNED["8"] = {"flags": floor}
    try:
        assert peers.modes()["DiLoCo H8 tuned"] == (peers.DDP, floor + peers.FP32)
        assert "DiLoCo H8" in peers.modes()
        # its per-iteration cost is the timed paper-setting DiLoCo's at H8, a warm-up arm's
        # too (its dense iterations priced as dense: the next test)
        assert peers.timed_as("DiLoCo H8 tuned", floor) == "DiLoCo H8"
        assert peers.timed_as("DiLoCo H8 tuned", warm) == "DiLoCo H8"
        assert peers.diloco_warmup(warm) == 40 and peers.diloco_warmup(floor) == 0
        assert peers.timed_as("EDGC", []) == "EDGC"
    finally:
        peers.TUNED.clear()


def test_the_staged_tuning_runs_eight_arms_per_h_and_picks_the_lowest(tmp_path, monkeypatch):
    """tune_diloco: per H the 7 first-stage arms at the inner lr 1x, then only the best
    one's 0.5x twin; the lowest final val loss of those wins; the arms not run are None."""
    import bench.peers as peers

    val = {"outer_1per0_inner_x1": 4.8, "outer_1per0_inner_x0.5": 4.7}   # plain averaging
    ran = []

    def fake_run(name, flags, out, iters, reuse, script):
        ran.append(name)
        key = next((k for k in val if k in name), None)
        return [{"iteration": iters, "val_loss": val.get(key, 5.0)}], {}
    monkeypatch.setattr(peers, "run_pretrain", fake_run)
    monkeypatch.setattr(peers, "TUNE_H", (8,))
    result = peers.tune_diloco(str(tmp_path), 2000)["8"]
    assert len(ran) == 8 and ran[-1] == "DiLoCo_H8_outer_1per0_inner_x0.5_seed1239"
    assert result["chosen"] == "DiLoCo H8 outer 1/0 inner x0.5"
    assert result["final_val"]["DiLoCo H8 outer 0.3/0.9 inner x0.5"] is None
    assert json.loads((tmp_path / "diloco_tuning.json").read_text())["8"]["chosen"] == \
        result["chosen"]
    try:   # the race's command line then offers the tuned mode, with the chosen flags
        peers.load_tuned(str(tmp_path))
        assert peers.modes()["DiLoCo H8 tuned"][1] == result["flags"] + peers.FP32
    finally:
        peers.TUNED.clear()


def test_a_long_run_is_priced_rank_by_rank():
    """EDGC's timing run visits ranks 32 and 16; its loss run spends its compressed
    iterations at 32, 24 and 8: each is priced at its own rank's measured ms/iter (24
    between the timed ranks, 8 at the lowest timed one's), the dense warm-up at the
    warm-up's, a mode without ranks at its mean."""
    import bench.peers as peers

    timing = ([{"iteration": i, "rank_dp": [None], "iter_ms": 700.0} for i in range(1, 11)]
              + [{"iteration": i, "rank_dp": [32], "iter_ms": 400.0 + (i == 11) * 90}
                 for i in range(11, 26)]
              + [{"iteration": i, "rank_dp": [16], "iter_ms": 320.0 + (i == 26) * 90}
                 for i in range(26, 41)])
    assert peers.rank_costs(timing, 12) == {32: 400.0, 16: 320.0}   # first at each left out
    timing[9]["dense_end_iter"] = 10
    for r in timing:
        r["dp_bytes_sent_job"] = 2.0 ** 20
    fig = peers.timing_figures(timing)
    assert fig["rank_ms"] == {32: 400.0, 16: 320.0}
    assert fig["warmup_ms"] == 700.0 and fig["iter_ms"] == pytest.approx(
        (13 * 400 + 14 * 320 + 410) / 28)          # the mean over both ranks: not r32's
    loss = [{"iteration": 1, "rank_dp": [None]}, {"iteration": 2, "rank_dp": [None]},
            {"iteration": 3, "rank_dp": [32]}, {"iteration": 4, "rank_dp": [24]},
            {"iteration": 5, "rank_dp": [8]}, {"iteration": 2, "dense_end_iter": 2}]
    got = [r["iter_ms"] for r in peers.priced(loss, 350.0, 700.0, fig["rank_ms"])]
    assert got[:5] == [700.0, 700.0, 400.0, 360.0, 320.0]
    assert [r["iter_ms"] for r in peers.priced(loss, 350.0, 700.0, {})][2:5] == [350.0] * 3


def test_the_fastest_peer_is_judged_on_the_seeds_all_peers_ran():
    """A peer with only its luckiest seed is not the fastest for it: the medians are taken
    over the pairs every peer ran; a peer that missed the target is not a candidate."""
    from bench.peers import fastest_peer

    full = {(1, 0): 100.0, (2, 0): 80.0, (3, 0): 90.0}
    lucky = {(2, 0): 85.0}                       # its one seed is everyone's fastest
    missed = {(1, 0): None, (2, 0): 10.0, (3, 0): 10.0}
    assert fastest_peer({"full": full, "lucky": lucky, "missed": missed}) == "full"
    assert fastest_peer({"full": full, "lucky": {(2, 0): 70.0}}) == "lucky"
    assert fastest_peer({"missed": missed}) is None


def test_a_dense_warmup_arm_pays_dense_for_its_warmup():
    """A DiLoCo run's dense warm-up, which its records do not mark, is marked from its
    flags; its iterations are then priced at the dense cost, the rest at DiLoCo's."""
    import bench.peers as peers

    records = [{"iteration": i, "rank_dp": None} for i in range(1, 101)]
    marked = peers.mark_dense_warmup(records, 40)
    assert peers.warmup_end(records) == 0 and peers.warmup_end(marked) == 40
    cost = [r["iter_ms"] for r in peers.priced(marked, ms=100.0, warm_ms=300.0)]
    assert sum(cost) == 40 * 300.0 + 60 * 100.0


def test_the_tuning_table_and_the_discarded_rounds(tmp_path):
    """The report's DiLoCo paragraph: each arm's final loss (the chosen in bold, the arms
    the staged search skipped "not run") and the discarded rounds summed over runs."""
    import bench.peers as peers

    grid = peers.diloco_grid(8, 2000)
    finals = {n: (4.9 if " inner x1" in n else None) for n in grid}
    finals["DiLoCo H8 outer 1/0.5 inner x1"] = 4.7
    finals["DiLoCo H8 outer 1/0.5 inner x0.5"] = 4.8
    tuning = {"8": {"chosen": "DiLoCo H8 outer 1/0.5 inner x1", "flags": [],
                    "final_val": finals}}
    rows = peers.tuning_table(tuning).splitlines()[2:]
    assert len(rows) == 7
    assert "| 8 | 1/0.5 | **4.7000** (chosen) | 4.8000 |" in rows
    assert "| 8 | 0.7/0.9 after 40 dense | 4.9000 | not run |" in rows
    for sub, name, summary in (
            ("tune", "DiLoCo_H8_a_seed1239", {"diloco_rounds": 250,
                                                "diloco_discarded_rounds": 0,
                                                "val_on": "the replicas' average"}),
            ("loss", "DiLoCo_H8_tuned_seed1234", {"diloco_rounds": 250,
                                                   "diloco_discarded_rounds": 1,
                                                   "val_on": "the replicas' average"}),
            ("loss-local-weights", "DiLoCo_H8_seed1234", {"val_loss": 5.1})):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / f"{name}.summary.json").write_text(json.dumps(summary))
    assert peers.diloco_rounds(str(tmp_path)) == {
        "runs": 2, "rounds": 500, "discarded": 1, "val_on": ["the replicas' average"]}


def test_the_timed_code_is_every_file_a_timed_run_executes():
    """Issue 80: the code version a timing session records covers the benchmark's own
    files (the race, the peers' trainer, the shaped links, the report, the pricing), not
    the package alone; its committed results are data and leave it alone."""
    import subprocess

    from bench.peers import ROOT, TIMED_CODE

    def covered(path):
        out = subprocess.run(["git", "ls-files", "--", *TIMED_CODE], cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
        return path in out

    for path in ("bench/peers.py", "bench/torch_ddp_peers.py", "bench/netns.py",
                 "bench/report.py", "scripts/plot_run.py", "megatron_edgc/patches/ddp.py",
                 "pretrain_gpt2_edgc.py", "megatron_edgc/configs/tiny-cpu.yaml"):
        assert covered(path), path
    assert not covered("bench/results/peers-2000/time/session.json")


def test_diloco_is_priced_over_whole_rounds_and_scored_at_round_ends():
    """Issue 80: a DiLoCo H32 timing run of 96 iterations is priced over its whole rounds
    after the first (iterations 33-96: two syncs in 64 iterations, not one in 37), and its
    evaluations move back to the last round's end before each (the global model as a sync
    left it); the modes that sync every step keep theirs; a timing length that splits a
    round is refused."""
    import bench.peers as peers
    from bench.torch_ddp_peers import eval_schedule

    sync = {32, 64, 96}
    records = [{"iteration": i, "iter_ms": 1000.0 if i in sync else 100.0,
                "grad_sync_ms": [1.0], "dp_bytes_sent_job": 0} for i in range(1, 97)]
    fig = peers.timing_figures(records, round_len=32)
    assert fig["iter_ms"] == pytest.approx((2 * 1000 + 62 * 100) / 64)
    # from iteration 4 on: three syncs in 93 iterations (a round and 29 iterations more)
    assert peers.timing_figures(records)["iter_ms"] == pytest.approx((3 * 1000 + 90 * 100) / 93)
    assert peers.round_length(["--hook", "diloco", "--diloco-sync-every", "32"]) == 32
    assert peers.round_length(["--hook", "local-sgd", "--local-sgd-period", "8"]) == 8
    assert peers.round_length(["--edgc-mode", "edgc"]) == 1

    def evals(*args):
        due = eval_schedule(2000, 100, *args)
        return [i for i in range(1, 2001) if due(i)]
    assert evals() == list(range(100, 2001, 100))
    assert evals(32, 0)[:3] == [96, 192, 288] and evals(32, 0)[-1] == 1984
    assert all(i % 8 == 0 for i in evals(8, 0)) and len(evals(8, 0)) == 20
    # after a dense warm-up of 40: rounds end at 40 + 32 k
    assert evals(32, 40)[:2] == [72, 200] and evals(32, 40)[-1] == 1992
    peers.check_time_iters(96, 2000)
    with pytest.raises(ValueError, match="--time-iters: must be a multiple of 32"):
        peers.check_time_iters(40, 2000)
    with pytest.raises(ValueError, match="--time-iters: must be >= 80"):
        peers.check_time_iters(64, 2000)


def test_the_bypassing_modes_race_per_link_with_the_measured_link_declared(tmp_path):
    """Issue 80: this product's modes run with the bypass at auto; their loss curves are
    per link, each run declaring the link the mode's timing measured there (the median
    over repetitions of each run's last refit); the report prices a link with that link's
    curve and shows the decisions (an explored iteration counted by the decision in
    force)."""
    import bench.peers as peers

    for name in peers.BYPASSING:
        flags = peers.modes()[name][1]
        assert flags[flags.index("--edgc-bypass") + 1] == "auto"
    assert "--edgc-bypass" not in peers.modes()["ours dense bf16 wire"][1]
    assert peers.precision("hook r_max bf16 model") == "bf16"
    timed = tmp_path / "time" / "100mbit"
    timed.mkdir(parents=True)
    for rep, (gbps, alpha) in enumerate([(0.08, 2.0), (0.06, 4.0), (0.07, 3.0)]):
        lines = [{"iteration": 1, "dp_link_gbps": 1.0, "dp_link_alpha_ms": 0.1},
                 {"iteration": 2, "dp_link_gbps": gbps, "dp_link_alpha_ms": alpha}]
        (timed / f"EDGC_rep{rep}.jsonl").write_text("\n".join(map(json.dumps, lines)))
    assert peers.declared_link(str(tmp_path), "100mbit", "EDGC") == [
        "--edgc-link-gbps", "0.07", "--edgc-link-latency-ms", "3"]
    assert peers.declared_link(str(tmp_path), "1gbit", "EDGC") is None
    records = [{"iteration": i, "dp_link_gbps": 0.07, "dp_bypassed_buckets": int(dense),
                "dp_bypass_explored": explored}
               for i, (dense, explored) in enumerate([(1, False), (0, True), (0, False),
                                                      (1, True)], start=1)]
    assert peers.dense_share(records) == 0.5      # 1: dense; 2: explored, dense in force
    assert peers.dense_share([{"iteration": 1}]) is None
    data = {"loss": {"dense fp32": {1234: "dense"}},
            "loss_at": {"100mbit": {"EDGC": {1234: "edgc at 100"}}}}
    assert peers.curves(data, "100mbit") == {"dense fp32": {1234: "dense"},
                                             "EDGC": {1234: "edgc at 100"}}
    assert peers.curves(data, "1gbit") == {"dense fp32": {1234: "dense"}}


def test_a_long_race_reports_before_its_loss_runs():
    """The race times first (issue 80): the report of a long race with timing runs and no
    loss run yet says so instead of failing on the missing targets."""
    import bench.peers as peers

    data = {"loss": {}, "loss_at": {}, "time": {"100mbit": {"EDGC": [{}]}}, "session": None}
    assert peers.levels_table(data) == "(no loss run of dense fp32 yet)"
    table, verdicts = peers.report(data)
    assert len(table.splitlines()) == 2 and verdicts["100mbit"]["vs_peer"] == {}


def test_every_mode_of_the_race_sets_its_precision():
    """Issue 80: unset, the trainer's precision follows the CPU (bf16 where it has bf16
    instructions), so a mode that leaves it unset trains in fp32 on one machine and in
    bf16 on another (the race's fp32 static and EDGC loss runs did, on an AMD EPYC with
    AVX512-BF16): every mode names its precision, the one its ratios are taken in."""
    import bench.peers as peers

    for name, (_, flags) in peers.modes().items():
        said = [f for f in flags if f in ("--bf16", "--no-bf16")]
        assert said == (["--bf16"] if peers.precision(name) == "bf16" else ["--no-bf16"]), \
            (name, flags)


def test_each_loss_run_records_the_machine_it_ran_on(tmp_path, monkeypatch):
    """Issue 80: a long race's loss runs span sessions and machines; each fresh run records
    its machine (a reused one keeps the one it ran on), and the report counts them."""
    import bench.peers as peers
    import bench.report as report

    def fake_run(name, flags, out, iters, reuse, script):
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.summary.json"), "w") as fh:
            json.dump({}, fh)
        return [], {}

    monkeypatch.setattr(peers, "run_pretrain", fake_run)
    monkeypatch.setattr(report, "machine", lambda: "CPU A")
    peers.run_losses(str(tmp_path), 200, only=["dense fp32"], seeds=[1, 2])
    monkeypatch.setattr(report, "machine", lambda: "CPU B")
    peers.run_losses(str(tmp_path), 200, only=["dense fp32"], seeds=[2, 3])
    seen = json.loads((tmp_path / "loss" / "machines.json").read_text())
    assert seen == {"dense_fp32_seed1": "CPU A", "dense_fp32_seed2": "CPU A",
                    "dense_fp32_seed3": "CPU B"}
    (tmp_path / "loss" / "bf16_wire_seed1.summary.json").write_text("{}")
    assert peers.loss_machines(str(tmp_path)) == "CPU A: 2; CPU B: 1; not recorded: 1"


def _git_repo(tmp_path, monkeypatch):
    """A checkout of its own for the stamp tests (bench.report's git runs in it)."""
    import subprocess

    import bench.peers as peers
    import bench.report as report

    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                              text=True).stdout.strip()
    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    monkeypatch.setattr(report, "ROOT", str(repo))
    peers._committed_changes.cache_clear()

    def commit(files: dict) -> str:
        for path, text in files.items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(text)
        git("add", *files)
        git("commit", "-q", "-m", "c")
        return git("rev-parse", "HEAD")
    return repo, commit


def test_every_record_of_a_run_carries_its_code_stamp(tmp_path, monkeypatch):
    """Issue 93: each record a benchmark run writes, and its summary, carries the commit it
    ran and a hash of any uncommitted change to the code (untracked files in it too; the
    committed results are data, not code)."""
    import bench.report as report

    repo, commit = _git_repo(tmp_path, monkeypatch)
    head = commit({"megatron_edgc/a.py": "x = 1\n", "bench/results/r.json": "{}\n"})
    clean = report.code_stamp()
    assert clean == {"commit": head, "diff": None, "dirty": []}
    (repo / "bench" / "results" / "r.json").write_text('{"new": 1}\n')   # data: no diff
    assert report.code_stamp() == clean
    (repo / "megatron_edgc" / "a.py").write_text("x = 2\n")
    dirty = report.code_stamp()
    assert dirty["commit"] == head and dirty["dirty"] == ["megatron_edgc/a.py"]
    assert len(dirty["diff"]) == 16
    (repo / "megatron_edgc" / "b.py").write_text("y = 1\n")              # untracked code
    more = report.code_stamp()
    assert more["diff"] != dirty["diff"] and more["dirty"] == ["megatron_edgc/a.py",
                                                               "megatron_edgc/b.py"]
    assert report.stamp_text(more) == f"{head[:12]}+diff {more['diff']}"
    assert report.stamp_text(None) == "unstamped"

    def launch(cmd):   # a run's own files, as the trainer and the peers write them
        metrics = cmd[cmd.index("--metrics-file") + 1]
        with open(metrics, "w") as fh:
            for i in (1, 2, 3):
                fh.write(json.dumps({"iteration": i, "loss": 5.0, "iter_ms": 10.0}) + "\n")
        with open(metrics[:-len(".jsonl")] + ".summary.json", "w") as fh:
            json.dump({"iterations": 3}, fh)
        return 0

    out = tmp_path / "runs"
    out.mkdir()
    records, summary = report.run_pretrain("EDGC_rep0", [], str(out), 3, launch=launch)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(r["code"] == more for r in records) and summary["code"] == more
    assert summary["iterations"] == 3 and records[0]["loss"] == 5.0


def test_no_comparison_is_priced_across_code_a_mode_executes(tmp_path, monkeypatch):
    """Issue 93: a time to target or a ratio reads runs that ran the same code in every
    file they both execute (the package; the trainer or the peers' script): a change to
    the trainer script leaves a torch peer's comparisons alone and refuses the trainer
    modes'; a change in the package refuses every pair across it; an uncommitted diff
    counts by the files it touches; unstamped runs are not checked, and named so."""
    import bench.peers as peers
    from bench.report import stamp_text

    _, commit = _git_repo(tmp_path, monkeypatch)
    c1 = commit({"megatron_edgc/x.py": "1\n", "pretrain_gpt2_edgc.py": "1\n",
                 "bench/torch_ddp_peers.py": "1\n"})
    c2 = commit({"pretrain_gpt2_edgc.py": "2\n"})
    c3 = commit({"megatron_edgc/x.py": "3\n"})
    s1, s2, s3 = ({"commit": c, "diff": None, "dirty": []} for c in (c1, c2, c3))
    T, D = peers.TRAINER, peers.DDP
    assert peers.code_conflict([(T, s1), (T, s1), (D, s1)]) is None
    assert peers.code_conflict([(T, s1), (D, s2)]) is None          # not a file both run
    assert peers.code_conflict([(T, s1), (T, s2)]) in (
        f"pretrain_gpt2_edgc.py differ between {a[:12]} and {b[:12]}"
        for a, b in ((c1, c2), (c2, c1)))
    assert "megatron_edgc/x.py differ" in peers.code_conflict([(D, s2), (T, s3)])
    assert peers.code_conflict([(T, None), (T, s1), (D, None)]) is None
    dirty = lambda path, h: {"commit": c1, "diff": h, "dirty": [path]}  # noqa: E731
    assert peers.code_conflict([(T, s1), (D, dirty("bench/torch_ddp_peers.py", "a"))]) is None
    assert "megatron_edgc/x.py" in peers.code_conflict(
        [(T, dirty("megatron_edgc/x.py", "a")), (D, dirty("megatron_edgc/x.py", "b"))])
    assert peers.code_conflict([(T, dirty("megatron_edgc/x.py", "a"))] * 2) is None
    assert "unknown here" in peers.code_conflict([(T, s1), (T, dict(s1, commit="f" * 40))])

    # the report: EDGC timed on c3 against curves and a static r_max of c1
    def curve(stamp):
        return [{"iteration": i, "val_loss": 6.0 - i / 100, "code": stamp}
                for i in range(10, 101, 10)]

    def fig(stamp, ms=100.0):
        return {"code": stamp, "iter_ms": ms, "warmup_ms": None, "rank_ms": {},
                "sync_ms": 1.0, "mib": 1.0, "compress_ms": None, "dense_share": None}
    data = {"loss": {"dense fp32": {1: curve(s1)}, "torch DDP fp32": {1: curve(s1)},
                     "static r_max": {1: curve(s1)}, "EDGC": {1: curve(s1)}},
            "loss_at": {}, "session": {},
            "time": {"100mbit": {"dense fp32": [fig(s2)], "torch DDP fp32": [fig(s3, 90.0)],
                                 "static r_max": [fig(s1)], "EDGC": [fig(s3)]}}}
    table, verdicts = peers.report(data)
    row = {line.split(" | ")[1]: line for line in table.splitlines()[2:]}
    # EDGC's own curve (c1) and timing (c3) differ in the package: no time of its own
    assert "not priced: megatron_edgc/x.py, pretrain_gpt2_edgc.py differ between " \
        in row["EDGC"] and c1[:12] in row["EDGC"] and c3[:12] in row["EDGC"]
    assert "EDGC" in data["refused"]["100mbit"] and "EDGC" not in verdicts["100mbit"][
        "vs_static"]
    # the torch peer's timing (c3) against the dense curve it borrows (c1): refused too
    assert "not priced" in row["torch DDP fp32"]
    # static (c1 only) against dense fp32 (curve c1, timing c2: the trainer script changed
    # between its own runs): dense fp32 has no price, static keeps its own
    assert "not priced: pretrain_gpt2_edgc.py differ" in row["dense fp32"]
    assert "not priced" not in row["static r_max"].split(" | ")[10]
    assert stamp_text(s1) in peers.stamps_line(data)


def test_the_committed_unstamped_race_still_reads(tmp_path):
    """Issue 93: the runs recorded before stamps (bench/results/peers-defaults/) read as
    unstamped and are priced as before, but for the iterations the bypass sent dense
    (there: the 9 exploring ones per run), now at this product's dense sync where it was
    timed (bf16: dense bf16), so EDGC's and static's alike; the race's newer modes (EDGC
    pinned at each rank, the matched-bytes static) are missing there, and the report says
    so rather than fail."""
    import bench.peers as peers

    out = os.path.join(peers.ROOT, "bench", "results", "peers-defaults")
    data = peers.collect(out, 200, 96)
    line = peers.stamps_line(data)
    assert "EDGC: unstamped (18 runs)" in line and "+diff" not in line
    table, verdicts = peers.report(data)
    assert "not priced" not in table and not verdicts["100mbit"]["refused"]
    with open(os.path.join(out, "results.json")) as fh:
        committed = json.load(fh)["verdicts"]["100mbit"]
    assert verdicts["100mbit"]["vs_static"]["EDGC"] == committed["vs_static"]["EDGC"]
    assert verdicts["100mbit"]["vs_static"]["EDGC bf16 grads"] == pytest.approx(
        committed["vs_static"]["EDGC bf16 grads"], rel=3e-3)
    assert verdicts["100mbit"]["vs_matched"] == {}
    text = peers.issue93_text(data, verdicts, str(tmp_path / "race.png"))
    assert "| 100 Mbit | fp32 | r32 | 2.7 (2.7–3.0) % / 2.0 (2.0–2.0) % | " in text
    assert "| 100 Mbit | fp32 | 1.06 (1.01–1.21)× slower (3) | " in text
    assert "| 1 Gbit | bf16 | not chosen (--phase match-static) | — | — |" in text
    assert "EDGC pinned r8" in text.split("Not in the recorded runs: ")[1]
    drawn = peers.race_figure(data, str(tmp_path / "race.png"))
    assert drawn[("100mbit", "bf16")] == ["dense bf16", "static r_max bf16",
                                          "EDGC bf16 grads", "hook r_max bf16 model"]
    assert (tmp_path / "race.png").read_bytes()[:4] == b"\x89PNG"
    try:   # the control chosen from these runs: EDGC's bytes per compressed iteration
        matched = peers.match_static(str(tmp_path), out)
        assert [matched[p][r]["rank"] for p in ("fp32", "bf16")
                for r in peers.RATES] == [28, 28, 16, 28, 28, 20]
        assert matched["fp32"]["100mbit"]["edgc_mib"] == pytest.approx(3.5715, abs=1e-4)
    finally:
        peers.MATCHED.clear()
