"""The rank controller on scripted entropy streams: warm-up, windows, clamps, state."""

import json
import math

from megatron_edgc.control.controller import ControllerSettings, RankController
from megatron_edgc.control.rank_model import RankModel


def drive(controller, entropy_of, iterations):
    """Feed ``entropy_of(stage, iteration)`` on measured iterations; return tables."""
    tables = []
    for it in range(iterations):
        tables.append(list(controller.table))          # the table in force at ``it``
        if controller.should_measure(it):
            controller.observe(it, [entropy_of(s, it) for s in range(controller.num_stages)])
        controller.end_iteration(it)
    return tables


def make(num_stages=2, **kw):
    settings = ControllerSettings(**{"window": 10, "iter_sample_rate": 0.5, "rank_max": 64,
                                     "rank_step": 8, "warmup_eps": 0.01, "warmup_windows": 2,
                                     **kw})
    return RankController(settings, [RankModel(1920, 7680)] * num_stages)


def test_gds_measures_every_round_one_over_alpha_th_iteration_of_each_window():
    """GDS's iteration sampling (EDGC §4): iterations 0, 1/α, 2/α, ... of every window."""
    assert [i for i in range(45) if make(window=20, iter_sample_rate=0.1).should_measure(i)] \
        == [0, 10, 20, 30, 40]
    assert [i for i in range(14) if make(window=7, iter_sample_rate=0.25).should_measure(i)] \
        == [0, 4, 7, 11]
    assert all(make(window=3, iter_sample_rate=1.0).should_measure(i) for i in range(9))


def test_warmup_ends_after_k_stable_windows():
    # Entropy falls for 30 iterations, then is flat: window means -0.2, -0.7, -1.2, -1.5,
    # -1.5, -1.5; windows 4 and 5 are the first two stable ones, so warm-up ends at 60.
    c = make()
    h = lambda s, it: -0.05 * min(it, 30) + s
    tables = drive(c, h, 70)
    assert c.warmup_end_iter == 60
    assert all(t == [None, None] for t in tables[:60])
    assert tables[60] == [64, 64] and c.h0 == [-1.5, -0.5]


def test_warmup_cap():
    c = make(warmup_max_iters=20)
    drive(c, lambda s, it: -0.1 * it, 25)               # never stable
    assert c.warmup_end_iter == 20 and c.table == [64, 64]


def test_dense_bound_compresses_at_r_max_and_decisions_wait_for_stability():
    """``dense_max_iters``: compression from the first window end at or after it, at r_max,
    held while the entropy still falls (CQM would lower the rank on the transient); the
    rank decisions start once the stability rule holds, with H0 from there."""
    c = make(dense_max_iters=15)
    # falls 0.05 per iteration for 50 iterations, then flat: windows 6 and 7 are the
    # first two stable ones (window means sampled every 2nd iteration)
    h = lambda s, it: -0.05 * min(it, 50) + s
    tables = drive(c, h, 90)
    assert all(t == [None, None] for t in tables[:20])       # first window end from 15
    assert c.dense_end_iter == 20
    assert all(t == [64, 64] for t in tables[20:81])          # held at r_max, falling
    assert c.warmup_end_iter == 80 and c.h0 == [-2.5, -1.5]
    state = c.state_dict()
    assert state["dense_end_iter"] == 20
    # a state saved before the bound existed: its dense part ended with its warm-up
    old = {k: v for k, v in state.items() if k != "dense_end_iter"}
    fresh = make()
    fresh.load_state_dict(old)
    assert fresh.dense_end_iter == 80
    # without the bound the same stream stays dense to the stability rule
    plain = make()
    assert drive(plain, h, 90)[79] == [None, None] and plain.warmup_end_iter == 80


def test_ranks_follow_entropy_per_stage_with_step_limit_and_clamps():
    c = make(rank_min=16, warmup_max_iters=10)
    # Stage 0: entropy falls 0.02 nats per window -> rank walks down by the step limit;
    # stage 1: entropy rises -> rank would go up but is clamped at r_max.
    h = lambda s, it: (-0.02 if s == 0 else 0.02) * (it // 10)
    tables = drive(c, h, 80)
    per_window = [tables[i] for i in range(10, 80, 10)]
    assert [t[0] for t in per_window] == [64, 56, 48, 40, 32, 24, 16]
    assert all(t[1] == 64 for t in per_window)
    drive(c, lambda s, it: -5.0, 30)                     # a big drop: never below r_min
    assert c.table[0] == 16


def test_h0_moves_only_when_rank_changes():
    c = make(warmup_max_iters=10, rank_step=64)
    # Drops of 0.0002 nats per window: each alone keeps r = 64 (one rank step of g at 64
    # is about 0.0006 nats), but they accumulate against the unchanged H0.
    drop = lambda offset: (lambda s, it: -0.0002 * ((it + offset) // 10))
    drive(c, drop(0), 10)
    h0 = list(c.h0)
    drive(c, drop(10), 20)
    assert c.table == [64, 64] and c.h0 == h0
    drive(c, drop(30), 30)
    assert c.table[0] < 64 and c.h0 != h0


def test_deterministic_and_state_round_trip():
    h = lambda s, it: -0.01 * (it // 10) + 0.1 * s
    a, b = make(warmup_max_iters=10), make(warmup_max_iters=10)
    assert drive(a, h, 55) == drive(b, h, 55)
    assert a.table_hash() == b.table_hash()
    c = make(warmup_max_iters=10)
    c.load_state_dict(a.state_dict())
    rest_a = [drive(a, lambda s, it: h(s, it + 55), 1)[0] for _ in range(30)]
    rest_c = [drive(c, lambda s, it: h(s, it + 55), 1)[0] for _ in range(30)]
    assert rest_a == rest_c and a.table_hash() == c.table_hash()


def test_nonfinite_entropy_is_ignored():
    c = make(warmup_max_iters=10)
    drive(c, lambda s, it: float("nan") if it % 4 == 0 else -1.0, 20)
    assert c.table == [64, 64] and all(math.isfinite(h) for h in c.h0)


# ---------------------------------------------------------------------- the driver's interface

#: A driver state saved before the RankControl interface (trimmed from a TP1·PP2·DP2 run
#: with DAC, calibrated g and the pipeline controller, at iteration 10).
OLD_PAPER_STATE = {
    "controller": {"in_warmup": False, "warmup_end_iter": 4, "window_index": 5,
                   "window_samples": [[], []],
                   "window_means": [[-4.2, -4.33], [-6.12, -4.53], [-7.49, -4.82]],
                   "stable_windows": 0, "table": [8, 8], "h0": [-6.12, -4.53], "r0": [8, 8]},
    "stage_shapes": [[2048, 64], [2048, 64]],
    "calibrated_g": [[1.0] + [0.5] * 63 + [0.0], None],
    "pp_controller": {"in_warmup": False, "warmup_end_iter": 4, "window_index": 5,
                      "window_samples": [[]], "window_means": [[-9.1], [-9.3]],
                      "stable_windows": 0, "table": [8], "h0": [-9.1], "r0": [8]},
    "budget_scales": None, "dp_table": [8, 10], "pp_rank": 8, "table_version": 5,
    "dac_fit": [[1.5, 9.0, 30.0, 60.0, 200.0], [1.5, 9.0, 20.0, 60.0, 130.0]],
    "dac_window_times": [[10.0, 2.0, 0.0, 0.0], [12.0, 2.0, 1.0, 2.0]],
    "time_models": [[0.5, 3.0], [0.25, 2.0]], "slack": [0.0, 6.5]}


def make_paper_control(pipeline=True, dac=True):
    from megatron_edgc.control.rank_control import PaperControl
    from megatron_edgc.runtime.dac import StageTimeFits

    settings = ControllerSettings(window=2, iter_sample_rate=1.0, rank_max=8,
                                  warmup_max_iters=4)
    pp = RankController(settings, [RankModel(128, 64)]) if pipeline else None
    return PaperControl(RankController(settings, [RankModel(2048, 64)] * 2),
                        alignment=StageTimeFits(2, settings) if dac else None, pipeline=pp)


def test_paper_control_loads_a_state_saved_before_the_interface():
    control = make_paper_control()
    control.load_state_dict(OLD_PAPER_STATE)
    assert control.controller.table == [8, 8] and control.pipeline.table == [8]
    assert control.controller.rank_models[0].g(1) == 0.5          # calibrated g restored
    assert control.controller.rank_models[1].g(1) < 1.0
    assert control.alignment.models[1].eta == 0.25 and control.alignment.slack == [0.0, 6.5]
    assert control.decode_table(OLD_PAPER_STATE["dp_table"]) == [8, 10]
    state = control.state_dict()
    assert set(state) <= set(OLD_PAPER_STATE)                     # the old keys, no new ones
    as_saved = json.loads(json.dumps(state))                       # tuples as lists
    # one key more in each controller: its dense part ended with its warm-up
    for key in ("controller", "pp_controller"):
        assert as_saved[key].pop("dense_end_iter") == OLD_PAPER_STATE[key]["warmup_end_iter"]
    assert as_saved == {k: OLD_PAPER_STATE[k] for k in state}
    # DAC off: its keys of an old checkpoint are ignored, none written
    plain = make_paper_control(pipeline=False, dac=False)
    plain.load_state_dict(OLD_PAPER_STATE)
    assert set(plain.state_dict()) == {"controller", "pp_controller", "calibrated_g"}


def test_paper_control_window_end_aligns_then_broadcasts_table_and_pipeline_rank():
    calls = []

    class Alignment:
        def probe_rank(self, iteration, warmup_end_iter):
            return 6 if iteration == 99 else None

        def window_end(self, table):
            calls.append(list(table))
            return [t if t is None else t + 1 for t in table]

    control = make_paper_control()
    control.alignment = Alignment()
    control.controller.table, control.pipeline.table = [4, 5], [3]
    sent = []
    table, pp = control.window_end(lambda values: sent.append(values) or values)
    assert calls == [[4, 5]] and sent == [[5, 6, 3]] and (table, pp) == ([5, 6], 3)
    assert control.rank_in_force(10, table, 1) == 6 and control.rank_in_force(99, table, 1) == 6
    assert control.rank_in_force(11, table, 0) == 5
    assert control.applied_ranks(99, table) == [6, 6]
    assert control.record(table) == {"rank_cqm": [4, 5]}


def test_budget_control_sends_shape_ranks_as_ints_and_loads_the_old_state():
    from megatron_edgc.control.rank_allocation import BudgetRankController
    from megatron_edgc.runtime.budget import BudgetControl

    settings = ControllerSettings(window=2, iter_sample_rate=1.0, rank_max=8, rank_min=1,
                                  warmup_max_iters=4)
    groups = [[(64, 256, 2), (2048, 64, 1)], [(64, 64, 4)]]
    controller = BudgetRankController(settings, groups, time_budget=0.5)
    control = BudgetControl(controller, None, optimizer=None, lr_at=None, schedule="lr",
                            train_iters=20, stage=0, device="cpu")
    controller.table = [{(64, 256): 5, (2048, 64): 2}, None]
    sent = []
    table, pp = control.window_end(lambda values: sent.append(values) or values)
    assert sent == [[5, 2, None, None]] and pp is None
    assert table == [{(64, 256): 5, (2048, 64): 2}, None]
    assert control.applied_ranks(0, table) == [round(controller.effective_rank(0), 2), None]
    assert control.record(table)["rank_dp_shapes"] == [{"64x256": 5, "2048x64": 2}, None]
    saved = control.encode_table(table)
    assert saved == [[[64, 256, 5], [2048, 64, 2]], None] and control.decode_table(saved) == table
    # a state from before the interface: the keys it had, budget scales included
    old = {"controller": controller.state_dict(), "stage_shapes": [[2048, 64], [64, 64]],
           "calibrated_g": None, "pp_controller": None, "budget_scales": [[6, 1.2], [8, 0.8]],
           "dp_table": saved, "pp_rank": None, "table_version": 3}
    fresh = BudgetControl(BudgetRankController(settings, groups, time_budget=0.5), None,
                          optimizer=None, lr_at=None, schedule="lr", train_iters=20, stage=0,
                          device="cpu")
    fresh.load_state_dict(old)
    assert fresh.scales == {6: 1.2, 8: 0.8} and fresh.controller.table == controller.table
    state = fresh.state_dict()
    assert set(state) <= set(old)
    assert json.loads(json.dumps(state["budget_scales"])) == old["budget_scales"]
