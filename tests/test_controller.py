"""The rank controller on scripted entropy streams: warm-up, windows, clamps, state."""

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
