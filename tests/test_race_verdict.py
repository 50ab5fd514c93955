"""The race's one verdict rule (``bench/peers.py``, issue 72): over the paired ratios
(seeds × repetitions), "faster" or "slower" only where every ratio is on one side of 1,
"not resolved" otherwise."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.peers import ratio_verdict  # noqa: E402


def test_a_verdict_needs_the_whole_range_on_one_side_of_one():
    assert ratio_verdict([0.80, 0.92, 0.99]) == "0.92 (0.80–0.99)× faster"
    assert ratio_verdict([1.01, 1.10, 1.30]) == "1.10 (1.01–1.30)× slower"
    # one repetition on the other side: the spread does not resolve it
    assert ratio_verdict([0.80, 0.85, 1.02]) == "0.85 (0.80–1.02)× not resolved"
    assert ratio_verdict([1.00]) == "1.00× not resolved"
    assert ratio_verdict([]) == "—"


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
    warm = grid["DiLoCo H8 outer 0.7/0.9 inner x1 after 200 dense"]
    assert warm[warm.index("--diloco-warmup-iters") + 1] == "200"  # EDGC's bound: 10 %
    assert peers.choose_tuned({"b": 4.9, "a": 4.9, "c": 5.1}) == "a"
    assert "DiLoCo H8 tuned" not in peers.modes(2000)
    peers.TUNED["8"] = {"flags": floor}
    try:
        assert peers.modes(2000)["DiLoCo H8 tuned"] == (peers.DDP, floor)
        assert "DiLoCo H8" in peers.modes(2000)
    finally:
        peers.TUNED.clear()
