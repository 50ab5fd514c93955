"""bench/slow_links.py's arithmetic: the modelled fallback and the target verdicts."""

import pytest

from bench.netns import alpha_beta_allreduce_s
from bench.slow_links import CONFIGS, RANKS, modelled, modes, targets


def row(sync, it, mib, loss):
    return {"sync_ms": sync, "iter_ms": it, "mib": mib, "val_loss": loss}


def test_modelled_adds_the_alpha_beta_time_of_the_measured_bytes():
    loop = dict(row(30.0, 300.0, 28.0, 7.0), iter_ms_all=310.0)
    m = modelled(loop, "100mbit")
    extra = alpha_beta_allreduce_s(28.0 * 2**20 / RANKS, RANKS, "100mbit") * 1e3
    assert extra == pytest.approx(2 * 3 * 0.25 + 1.5 * 7 * 2**20 / (0.94 * 100e6 / 8) * 1e3)
    assert m["sync_ms"] == pytest.approx(30.0 + extra) and m["iter_ms"] == pytest.approx(
        300.0 + extra)
    assert m["iter_ms_all"] == pytest.approx(310.0 + extra)
    assert m["modelled"] and "modelled" not in loop


def test_target_verdicts():
    _, r_max, r_min = CONFIGS["tiny"]
    names = list(modes(r_max, r_min, 30))
    res = {f"tiny|100mbit|{n}": row(100.0, 200.0, 1.0, 5.0) for n in names}
    res["tiny|100mbit|dense"] = row(1000.0, 1300.0, 28.0, 5.00)   # sync share 77 %
    res["tiny|100mbit|EDGC"] = row(400.0, 1000.0, 3.0, 5.04)      # -60 %, -23 %, +0.8 %
    res[f"tiny|100mbit|hook r{r_max}"] = row(300.0, 900.0, 3.0, 5.0)
    res[f"tiny|100mbit|static r{r_max}"] = row(250.0, 800.0, 3.0, 5.0)
    line = targets(res, ["tiny"], ["100mbit"], 30).splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "77 %"
    assert cells[3] == "60 % ✓" and cells[4] == "23 % ✓" and cells[5] == "+0.80 % ✓"
    assert cells[6] == "0.89x ✓" and cells[7] == "1.11x ✗"
    res["tiny|100mbit|dense"] = row(100.0, 1000.0, 28.0, 5.0)     # share 10 %: n/a
    cells = targets(res, ["tiny"], ["100mbit"], 30).splitlines()[-1].strip("|").split("|")
    assert cells[2].strip() == "10 % (n/a)" and "✓" not in cells[3] + cells[4]
