"""bench/sync_free_before_after.py: the one rule over every (after, before) pair of
repetitions: a difference only where the repetitions' ranges part."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.sync_free_before_after import render, verdict  # noqa: E402


def test_verdict_needs_disjoint_ranges():
    assert verdict([100, 110, 120], [105, 115, 125]).endswith("× not resolved")
    assert verdict([100, 110, 120], [80, 90, 99]) == "0.82 (0.67–0.99)× faster"
    assert verdict([100, 110, 120], [121, 130, 140]) == "1.18 (1.01–1.40)× slower"
    assert verdict([], [1.0]) == "–"


def test_render_pairs_the_modes_both_runs_have():
    def run(ms):
        return {"iter_ms": sorted(ms)[1], "iter_ms_runs": ms, "sync_ms": 50.0,
                "sync_ms_runs": [49.0, 50.0, 51.0]}

    before = {"results": {"tiny|300mbit|dense": run([500, 510, 520]),
                          "tiny|300mbit|EDGC": run([400, 420, 440])}}
    after = {"iters": 30, "repeats": 3, "emulated": True,
             "results": {"tiny|300mbit|dense": run([505, 512, 530]),
                         "tiny|300mbit|EDGC": run([300, 310, 320]),
                         "tiny|300mbit|hook r32": run([1, 2, 3])}}
    text = render(before, after, "692fbd1", "321c2eb")
    assert "| tiny · 300mbit · dense | 510.0 (500.0–520.0) | 512.0 (505.0–530.0) | 50.0 " in text
    assert "| tiny · 300mbit · EDGC |" in text and "0.74 (0.68–0.80)× faster" in text
    assert "hook" not in text  # no before run to pair with
