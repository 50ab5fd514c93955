"""bench/slow_links.py's arithmetic: the modelled fallback and the target verdicts."""

import pytest

from bench.netns import alpha_beta_allreduce_s
from bench.slow_links import (CONFIGS, RANKS, aggregate, modelled, modes, overhead_share,
                               paired_ratios, ratio_cell, targets)


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
    res[f"tiny|100mbit|static r{r_max}"] = dict(row(250.0, 720.0, 3.0, 5.0), compress_ms=100.0)
    line = targets(res, ["tiny"], ["100mbit"], 30).splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "77 %"
    assert cells[3] == "60 % ✓" and cells[4] == "23 % ✓" and cells[5] == "+0.80 % ✓"
    assert cells[6] == "0.80x ✓" and cells[8] == "1.11x ✗"
    assert cells[7] == "0.22x ✓"            # static r_max overlap: 200 / 900
    assert cells[9] == "0.22x ✓"            # EDGC overlap: 200 / 900
    # static r_max: 100 ms of math; dense sync 1000, static sync 250 -> 850 ms saved
    assert cells[10] == "12 %"           # no verdict at 100 Mbit
    assert cells[11] == "—"               # no unshaped run: no floor
    res.update({f"tiny|300mbit|{k.split('|')[2]}": v for k, v in res.items()})
    res.update({f"tiny|none|{k.split('|')[2]}": v for k, v in res.items()
                if k.startswith("tiny|100mbit")})
    res["tiny|none|dense"] = row(100.0, 800.0, 28.0, 5.0)   # floor 700 ms
    line = targets(res, ["tiny"], ["300mbit"], 30).splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # the floor verdict is small's; EDGC overlap: 200 / 700
    assert cells[10] == "12 % ✓" and cells[11] == "1.43x; overlap 0.29x"
    res["tiny|100mbit|dense"] = row(100.0, 1000.0, 28.0, 5.0)     # share 10 %: n/a
    cells = targets(res, ["tiny"], ["100mbit"], 30).splitlines()[-1].strip("|").split("|")
    assert cells[2].strip() == "10 % (n/a)" and "✓" not in cells[3] + cells[4]


def test_repetitions_give_medians_spreads_and_paired_ratios():
    reps = [dict(row(10.0, 100.0, 1.0, 5.0), iter_ms_all=110.0, compress_ms=None, saving_ms=None),
            dict(row(30.0, 300.0, 1.0, 5.1), iter_ms_all=310.0, compress_ms=None, saving_ms=None),
            dict(row(20.0, 140.0, 1.0, 5.2), iter_ms_all=150.0, compress_ms=None, saving_ms=None)]
    agg = aggregate(reps)
    assert agg["iter_ms"] == 140.0 and agg["sync_ms"] == 20.0 and agg["repeats"] == 3
    assert agg["iter_ms_runs"] == [100.0, 300.0, 140.0] and agg["val_loss"] == 5.0
    assert agg["compress_ms_runs"] == [None, None, None] and agg["compress_ms"] is None
    other = aggregate([dict(r, iter_ms=r["iter_ms"] * 2) for r in reps])
    # paired by repetition: every ratio is exactly 0.5, although the spreads overlap
    assert paired_ratios(agg, other) == [0.5, 0.5, 0.5]
    assert ratio_cell([0.5, 0.5, 0.5], 0.95) == "0.50x [0.50–0.50] ✓"
    assert ratio_cell([0.90, 0.94, 0.97], 0.95) == "0.94x [0.90–0.97] ✗"
    assert ratio_cell([0.90, 0.99, 1.05], 0.95) == "0.99x [0.90–1.05] ✗ (not resolved)"
    assert ratio_cell([1.2], 0.95) == "1.20x ✗"


def test_overhead_share_is_math_over_the_communication_it_saves():
    dense = row(1000.0, 1300.0, 28.0, 5.0)
    comp = dict(row(250.0, 600.0, 3.0, 5.0), compress_ms=100.0)
    # communication with compression: 250 - 100 = 150 ms; saved 1000 - 150 = 850 ms
    assert overhead_share(dense, comp) == pytest.approx(100.0 / 850.0)
    assert overhead_share(row(100.0, 300.0, 28.0, 5.0), comp) is None   # nothing saved
    assert overhead_share(dense, dict(comp, compress_ms=None)) is None


def test_verdicts_hold_per_repetition():
    """A median that passes is not enough: every repetition must; a repetition with a gap
    is left out of the pairing, not turned into a ratio of medians."""
    def agg(syncs, iters, compress=None):
        return aggregate([dict(row(s, i, 1.0, 5.0), iter_ms_all=i, saving_ms=None,
                               compress_ms=None if compress is None else compress[k])
                          for k, (s, i) in enumerate(zip(syncs, iters))])
    a = agg([10.0, None, 30.0], [100.0, 200.0, 300.0])
    b = agg([20.0, 20.0, 20.0], [100.0, 100.0, 100.0])
    assert paired_ratios(a, b, "sync_ms") == [0.5, 1.5]
    assert a["sync_ms"] == 20.0
    _, r_max, r_min = CONFIGS["small"]
    res = {f"small|300mbit|{n}": agg([100.0] * 3, [200.0] * 3)
           for n in modes(r_max, r_min, 30)}
    # floor per repetition 700, 700, 400: EDGC at 1000 is 1.43x, 1.43x, 2.5x -> not met
    res["small|none|dense"] = agg([100.0, 100.0, 400.0], [800.0, 800.0, 800.0])
    res["small|300mbit|EDGC"] = agg([100.0] * 3, [1000.0] * 3)
    res["small|300mbit|dense"] = agg([1000.0] * 3, [1300.0] * 3)
    res[f"small|300mbit|static r{r_max}"] = agg([250.0, 250.0, 500.0], [720.0] * 3,
                                                [100.0, 100.0, 100.0])
    line = targets(res, ["small"], ["300mbit"], 30).splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # EDGC overlap at 200: 0.29x, 0.29x, 0.50x -> met
    assert cells[11] == "1.43x [1.43–2.50] ✗; overlap 0.29x [0.29–0.50] ✓"
    # overhead per repetition: 100/850, 100/850, 100/600 -> 12, 12, 17 % -> not met
    assert cells[10] == "12 % [12–17] ✗"
    assert cells[3] == "90 % [90–90] ✓"


def test_mode_ids_select_modes_whatever_the_ranks():
    from bench.slow_links import MODE_IDS, mode_id, selected_modes

    for cname, (_, r_max, r_min) in CONFIGS.items():
        ids = [mode_id(n, r_max, r_min) for n in modes(r_max, r_min, 30)]
        assert sorted(ids) == sorted(MODE_IDS), cname
        picked = selected_modes(r_max, r_min, 30, ["dense", "static-rmax-overlap",
                                                   "edgc-overlap"])
        assert list(picked) == ["dense", f"static r{r_max} overlap", "EDGC overlap"]
        assert picked["EDGC overlap"] == modes(r_max, r_min, 30)["EDGC overlap"]
