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
