"""The bypass's cost model and the error-feedback hand-over, one process."""

import pytest
import torch

from megatron_edgc.compression.bypass import LinkModel, compressed_sync_s
from megatron_edgc.compression.matrices import FLOAT_BYTES
from megatron_edgc.compression.powersgd import BucketCompressor
from test_host_sync import one_process_group  # noqa: F401 (a fixture)


def test_link_fit_recovers_alpha_beta_and_clamps_noise():
    link = LinkModel(2e-4, 1e-9)
    sizes = [1e3, 1e6, 4e6]
    fitted = LinkModel.fit(sizes, [link.allreduce_s(b) for b in sizes])
    assert fitted.alpha_s == pytest.approx(2e-4) and fitted.s_per_byte == pytest.approx(1e-9)
    assert fitted.gbit_per_s == pytest.approx(8.0)
    # noise that tilts the fit below zero: a fast link, clamped, never a negative time
    tilted = LinkModel.fit([1e3, 4e6], [5e-3, 4e-3])
    assert tilted.s_per_byte == 0.0 and tilted.alpha_s == pytest.approx(4.5e-3)
    assert LinkModel.declared(8.0).s_per_byte == pytest.approx(1e-9)
    with pytest.raises(ValueError):
        LinkModel.fit([1e3, 1e3], [1e-3, 2e-3])


def test_break_even_both_sides():
    """A 1024x1024 matrix at rank 8: the saving is 2(α)... exactly dense - P - Q on the link;
    compression pays on 1 Gbit/s and not on 10 Tbit/s against 1 ms of math."""
    comp = BucketCompressor([("w", (1024, 1024))], 8)
    first, second = (sum(b) // 4 for b in comp.phase_bytes())   # fp32: elements
    assert (first, second) == (1024 * 8 + 1, 1024 * 8)
    dense = sum(n * m for _, (n, m) in comp.entries) * FLOAT_BYTES
    slow, fast = LinkModel.declared(1.0, 1e-4), LinkModel.declared(1e4, 1e-4)
    wire = [first * 4, second * 4]
    saving = slow.allreduce_s(dense) - compressed_sync_s(slow, wire, 0.0)
    assert saving == pytest.approx(-1e-4 + (dense - (first + second) * 4) * 8e-9)
    assert compressed_sync_s(slow, wire, 1e-3) < slow.allreduce_s(dense)       # pays
    assert compressed_sync_s(fast, wire, 1e-3) > fast.allreduce_s(dense)       # does not
    # a bucket with nothing to compress never pays: one more element and no fewer bytes
    tiny = BucketCompressor([("b", (1, 64))], 8)
    f, s = (sum(b) // 4 for b in tiny.phase_bytes())
    assert s == 0 and compressed_sync_s(slow, [f * 4], 0.0) > slow.allreduce_s(64 * 4)


def test_absorb_residual_hands_the_whole_error_to_the_dense_message():
    torch.manual_seed(0)
    comp = BucketCompressor([("a", (64, 32)), ("b", (64, 32)), ("bias", (1, 32))], 2)
    grads = [torch.randn(64, 32), torch.randn(64, 32), torch.randn(1, 32)]
    bufs, step = comp.start(grads)
    comp.finish(step, comp.middle(step, bufs))       # one compressed step, one process
    comp.after_step(applied=True)
    residuals = [g.residual.clone() for g in comp.groups.values()][0]
    assert residuals.abs().sum() > 0
    fresh = [torch.randn(64, 32), torch.randn(64, 32), torch.randn(1, 32)]
    before = [t.clone() for t in fresh]
    comp.absorb_residual(fresh)
    assert torch.equal(fresh[0], before[0] + residuals[0])
    assert torch.equal(fresh[1], before[1] + residuals[1])
    assert torch.equal(fresh[2], before[2])
    # kept until the optimizer's outcome (a skipped step keeps it: test_skipped_step.py)
    assert torch.equal([g.residual for g in comp.groups.values()][0], residuals)
    comp.after_step(applied=True)
    assert all(g.residual.abs().sum() == 0 for g in comp.groups.values())
    q = [g.q.clone() for g in comp.groups.values()][0]
    held = [t.clone() for t in before]
    bufs, step = comp.start(held)                   # next compressed step: warm start kept
    assert torch.equal(held[0], before[0]) and torch.equal(held[1], before[1])  # M = G + 0
    assert torch.equal([g.q for g in comp.groups.values()][0], q)


def test_each_first_phase_collective_pays_its_latency():
    link = LinkModel(alpha_s=1e-3, s_per_byte=1e-9)
    one = compressed_sync_s(link, [600, 400], 0.0)
    two = compressed_sync_s(link, [200, 400, 400], 0.0)
    assert two - one == pytest.approx(link.alpha_s)


# ---------------------------------------------------------------------- the link follows


def test_link_from_collectives_fits_sizes_or_keeps_alpha():
    from megatron_edgc.compression.bypass import link_from_collectives

    start_up = LinkModel(alpha_s=1e-3, s_per_byte=8e-9)            # ~1 Gbit/s
    slow = LinkModel(alpha_s=3e-3, s_per_byte=8e-8)                # 10x slower, more overhead
    sizes = [1e5, 3e5, 7e6, 7e6]                                   # sizes spanning >= 2x: fit both
    got = link_from_collectives(start_up, sizes, [slow.allreduce_s(b) for b in sizes])
    assert got.alpha_s == pytest.approx(3e-3) and got.s_per_byte == pytest.approx(8e-8)
    # one size: alpha kept from the start-up link, the rest of the time pays for the bytes
    got = link_from_collectives(start_up, [7e6] * 3, [slow.allreduce_s(7e6)] * 3)
    assert got.alpha_s == 1e-3
    assert got.s_per_byte == pytest.approx((slow.allreduce_s(7e6) - 1e-3) / 7e6)
    # a window of small messages: alpha may explain at most half of the busy time
    got = link_from_collectives(start_up, [100.0] * 4, [1e-4] * 4)
    assert got.alpha_s == pytest.approx(5e-5)
    assert got.s_per_byte == pytest.approx((4e-4 - 4 * 5e-5) / 400)
    assert link_from_collectives(start_up, [0.0], [0.0]) is start_up   # nothing to learn
    with pytest.raises(ValueError):
        link_from_collectives(start_up, [1.0, 2.0], [1.0])


def test_busy_times_add_up_to_the_time_the_link_had_work_in_flight():
    """Queued or concurrent transfers on one link share it: each is busy from its issue
    or from the end of those before it, whichever is later; another link's do not count;
    the collectives of one phase are one transfer (by issue order, never by timing, so
    every member of a group has the same list); a completion not yet stamped (CPU
    callback) reads NaN and leaves the others alone."""
    from megatron_edgc.patches.dp_stats import DPSyncStats

    st = DPSyncStats()
    st.add_link_collective(0, 100, 10.0, 11.0, phase=1)
    st.add_link_collective(0, 200, 10.5, 11.5, phase=2)   # issued while the first was in flight
    st.add_link_collective(1, 50, 10.2, 10.4, phase=3)    # another group's link
    st.add_link_collective(0, 300, 12.0, 12.25, phase=4)  # the link was idle in between
    st.add_link_collective(0, 30, 12.0, 12.5, phase=4)    # ... with a phase-mate
    st.add_link_collective(0, 400, 12.6, float("nan"), phase=5)
    st.add_link_collective(0, 500, 13.0, 13.25, phase=6, dense=False)  # a compressed bucket's
    DPSyncStats.resolve_all([st])
    busy = st.link_busy
    assert [(link, b, d) for link, b, _, d in busy] == [
        (0, 100, True), (0, 200, True), (1, 50, True), (0, 330, True), (0, 400, True),
        (0, 500, False)]
    times = [t for _, _, t, _ in busy]
    assert times[:4] == pytest.approx([1.0, 0.5, 0.2, 0.5])
    assert times[4] != times[4] and times[5] == pytest.approx(0.25)


def _planner_with(one_process_group, link: LinkModel, cost_s: float, window: int = 5):
    """The patched DP sync of a one-bucket group with the bypass on, its start-up link and
    cost model set (as measured), at rank 4."""
    from megatron_edgc.patches.ddp import DPGradientCompression
    from test_host_sync import fake_ddp_chunk

    comp = DPGradientCompression([fake_ddp_chunk(n_buckets=1)], one_process_group, rank=4,
                                 compress_single_replica=True, min_compression_rate=2.0,
                                 start_iter=0, seed=0, bypass="auto", link_window=window)
    comp.planner.links = {one_process_group: link}
    comp.planner.cost_model = {key: (cost_s, 0.0) for key in comp.plans}
    return comp, next(iter(comp.plans.values()))


def _link_with_saving(plan, alpha: float, saving_s: float) -> LinkModel:
    """The link on which compressing ``plan``'s bucket saves ``saving_s`` seconds (the
    saving is linear in the per-byte time)."""
    def saving(per_byte):
        link = LinkModel(alpha, per_byte)
        return link.allreduce_s(plan.dense_bytes) - \
            compressed_sync_s(link, plan.compressor.wire_bytes(), 0.0)

    return LinkModel(alpha, (saving_s - saving(0.0)) / (saving(1.0) - saving(0.0)))


def _observe(comp, plan, link: LinkModel, steps: int = 5) -> None:
    """``steps`` steps' dense collectives of the bucket, as timed on ``link``."""
    for _ in range(steps):
        comp.planner.observe([(0, plan.dense_bytes, link.allreduce_s(plan.dense_bytes), True)])


def test_the_bypass_follows_a_refitted_link_with_hysteresis(one_process_group):
    """Decisions from the refitted link at each window boundary, not before; a decision
    in force flips only when the other side wins by 25 % of the larger of saving and
    cost; the rate in force is in the step's telemetry and an event names the change."""
    cost = 0.01
    comp, plan = _planner_with(one_process_group, LinkModel(1e-4, 1e-12), cost)
    on = lambda s: _link_with_saving(plan, 1e-4, s)                         # noqa: E731

    def step(it):
        comp.set_iteration(it)
        comp.prepare_iteration()
        return comp.dense_keys, comp.stats

    dense, st = step(0)
    assert dense == {plan.key}                           # a fast link: compressing costs more
    assert st.link_gbps == pytest.approx(LinkModel(1e-4, 1e-12).gbit_per_s)
    _observe(comp, plan, on(10 * cost))                  # the link became slow
    for it in range(1, 5):
        assert step(it)[0] == {plan.key}                 # not before the window boundary
    dense, st = step(5)
    assert dense == frozenset()
    assert comp.link.s_per_byte == pytest.approx(on(10 * cost).s_per_byte, rel=1e-9)
    assert st.link_gbps == pytest.approx(comp.link.gbit_per_s)
    assert any("buckets sent dense" in e and "refitted" in e for e in st.events)
    # compressed now: a link 20 % short of paying keeps it compressed (hysteresis) ...
    _observe(comp, plan, on(0.8 * cost))
    assert step(10)[0] == frozenset()
    # ... one 30 % short sends it dense; back to 20 % over keeps it dense
    _observe(comp, plan, on(0.7 * cost))
    assert step(15)[0] == {plan.key}
    _observe(comp, plan, on(1.2 * cost))
    assert step(20)[0] == {plan.key}
    _observe(comp, plan, on(1.5 * cost))
    assert step(25)[0] == frozenset()
    # no observation in a window: the link is kept
    before = comp.link
    assert step(30)[0] == frozenset() and comp.link is before


def test_prepare_and_decide_only_where_something_can_change(one_process_group):
    """Issue 93: an iteration where nothing the bypass reads has changed prepares no
    warm start and takes no decision; it reuses the decision in force, with the same
    keys and the same predictions in its telemetry as deciding again gives (a twin that
    prepares and decides every iteration, as before). Warm starts at the first compressed
    iteration, a new rank setting and a resume; decisions there too, at each refit
    (window 5), each exploring iteration (every 2 windows) and the one after it."""
    from megatron_edgc.patches.ddp import DPGradientCompression
    from test_host_sync import fake_ddp_chunk

    def build():
        comp = DPGradientCompression([fake_ddp_chunk(n_buckets=2)], one_process_group,
                                     rank=4, compress_single_replica=True,
                                     min_compression_rate=2.0, start_iter=2, seed=0,
                                     bypass="auto", link_window=5, link_explore=2)
        plans = list(comp.plans.values())
        comp.planner.links = {one_process_group: _link_with_saving(plans[0], 1e-4, 0.02)}
        # saving 20 ms: the first bucket (10 ms of math) compressed, the second (30) dense
        comp.planner.cost_model = {plans[0].key: (0.01, 0.0), plans[1].key: (0.03, 0.0)}
        calls = {"decide": [], "prepare": []}
        decide = comp.planner.decide

        def counted_decide(*args, **kwargs):
            calls["decide"].append(comp.iteration)
            return decide(*args, **kwargs)

        comp.planner.decide = counted_decide
        for plan in plans:
            prepare = plan.compressor.prepare

            def counted_prepare(*args, _prepare=prepare, **kwargs):
                calls["prepare"].append(comp.iteration)
                return _prepare(*args, **kwargs)

            plan.compressor.prepare = counted_prepare
        return comp, plans, calls

    comp, plans, calls = build()
    twin, _, twin_calls = build()
    slow = _link_with_saving(plans[0], 1e-4, 0.05)   # from iteration 2: both pay
    for it in range(25):
        for c in (comp, twin):
            if it in (22, 23):
                c.set_rank(8)                            # a new setting, then the same
            if it == 24:
                c.load_state_dict(c.state_dict())        # a resume
            if c is twin:                                # deciding every iteration
                c._prepared, c._decision = False, None
            c.set_iteration(it)
            c.prepare_iteration()
            if it in (2, 3, 4):
                _observe(c, plans[0], slow, steps=1)
        assert comp.dense_keys == twin.dense_keys, it
        for field in ("predicted_dense_s", "predicted_compressed_s", "predicted_saving_s",
                      "predicted_cost_s", "predicted_local", "explored", "events",
                      "link_gbps"):
            a, b = getattr(comp.stats, field), getattr(twin.stats, field)
            assert a == b or (a != a and b != b), (it, field)   # NaN before compressing
    assert calls["decide"] == [2, 5, 10, 11, 15, 20, 21, 22, 24]
    assert calls["prepare"] == [2, 2, 22, 22, 24, 24]           # each of the two buckets
    assert twin_calls["decide"] == list(range(2, 25))
    assert len(twin_calls["prepare"]) == 2 * 23
    # the decisions moved where they could: the refit at 5 compressed the second bucket
    # too, the explorations sent both dense
    assert comp.planner.in_force == frozenset()
    assert comp.stats.explored is False


def test_compressed_transfers_running_faster_make_the_bypass_probe(one_process_group,
                                                                    monkeypatch):
    """Compressed, the bucket's small transfers cannot say how fast a dense one would go;
    when they run 1.5x faster than in the window before (same buckets compressed), the
    link is probed as at start-up and the decision taken from the probe."""
    from megatron_edgc.patches import bypass_planner

    cost = 0.01
    comp, plan = _planner_with(one_process_group, LinkModel(1e-4, 1e-12), cost)
    slow = _link_with_saving(plan, 1e-4, 10 * cost)
    probes = []
    monkeypatch.setattr(bypass_planner, "measure_link",
                        lambda pg, device: probes.append(pg) or LinkModel(1e-4, 1e-12))
    comp.set_iteration(0)
    comp.prepare_iteration()
    _observe(comp, plan, slow)
    comp.set_iteration(5)
    comp.prepare_iteration()
    assert comp.dense_keys == frozenset() and probes == []
    wire = sum(plan.compressor.wire_bytes())

    def compressed_window(link):
        for _ in range(5):
            comp.planner.observe([(0, wire, link.allreduce_s(wire), False)])

    compressed_window(slow)                          # the first compressed window: a reference
    comp.set_iteration(10)
    comp.prepare_iteration()
    assert comp.dense_keys == frozenset() and probes == []
    compressed_window(LinkModel(slow.alpha_s, slow.s_per_byte / 1.3))   # noise: no probe
    comp.set_iteration(15)
    comp.prepare_iteration()
    assert comp.dense_keys == frozenset() and probes == []
    compressed_window(LinkModel(slow.alpha_s, slow.s_per_byte / 4))    # faster: probe
    comp.set_iteration(20)
    comp.prepare_iteration()
    assert probes == [one_process_group]
    assert comp.dense_keys == {plan.key} and comp.link == LinkModel(1e-4, 1e-12)
    assert any("probed" in e for e in comp.stats.events)


def test_link_timing_only_where_completion_needs_no_wait(one_process_group):
    """CPU tensors on gloo: each collective on the bypass's group is stamped (its
    completion callback). gloo on CUDA tensors completes only on a host wait: nothing is
    stamped there and the start-up link is kept."""
    from megatron_edgc.patches.timing import IntervalClock

    comp, plan = _planner_with(one_process_group, LinkModel(1e-4, 1e-12), 1.0)
    comp.set_iteration(0)
    comp.prepare_iteration()
    assert comp._timed_links == {id(one_process_group): 0}
    comp.stats.clock = IntervalClock(use_cuda=True)   # as gloo on a GPU's tensors
    comp._timed_links = {}
    comp.set_iteration(1)
    comp.prepare_iteration()
    assert comp._timed_links == {}


def test_the_bypass_prices_each_choice_local_work_as_the_job_ran_it(one_process_group):
    """Issue 80: the math timed once at start-up is scaled to what the job's compressed
    steps measured (median over the window, at the window boundary), and the dense path's
    own local work is added to the dense price once dense steps measured it; the step's
    telemetry carries both choices' prices; a checkpoint keeps the refitted figures."""
    cost = 0.01
    comp, plan = _planner_with(one_process_group, LinkModel(1e-4, 1e-12), cost)
    slow = _link_with_saving(plan, 1e-4, 1.5 * cost)      # pays by half the math, at start-up
    comp.planner.links = {one_process_group: slow}
    wire = sum(plan.compressor.wire_bytes())

    def step(it, local_s=None, busy=None):
        comp.set_iteration(it)
        comp.prepare_iteration()
        st = comp.stats
        if local_s is not None:     # the step ran: its local work and collectives, read
            comp.planner.observe([(0, busy, slow.allreduce_s(busy), busy == plan.dense_bytes)],
                                 {plan.key: local_s},
                                 st.predicted_local)
        return comp.dense_keys, st

    dense, st = step(0, local_s=3 * cost, busy=wire)
    assert dense == frozenset()
    assert st.predicted_local == {plan.key: (False, pytest.approx(cost))}
    assert st.predicted_dense_s == pytest.approx(slow.allreduce_s(plan.dense_bytes))
    assert st.predicted_compressed_s == pytest.approx(
        compressed_sync_s(slow, plan.compressor.wire_bytes(), cost))
    for it in range(1, 5):      # the job's math runs at 3x the start-up timing (one outlier)
        assert step(it, local_s=(30 if it == 2 else 3) * cost, busy=wire)[0] == frozenset()
    dense, st = step(5, local_s=0.004, busy=plan.dense_bytes)
    assert comp.planner.math_seconds(plan.key, 4) == pytest.approx(3 * cost)
    assert dense == {plan.key}                              # 1.5 saved for 3 spent: dense
    assert st.predicted_local == {plan.key: (True, 0.0)}    # dense work not seen yet
    for it in range(6, 10):
        step(it, local_s=0.004, busy=plan.dense_bytes)
    dense, st = step(10)
    assert comp.planner.dense_local == {plan.key: pytest.approx(0.004)}
    assert st.predicted_dense_s == pytest.approx(slow.allreduce_s(plan.dense_bytes) + 0.004)
    assert comp.planner.math_seconds(plan.key, 4) == pytest.approx(3 * cost)  # kept: unseen
    saved = comp.planner.state_dict()
    fresh, _ = _planner_with(one_process_group, LinkModel(1e-4, 1e-12), cost)
    fresh.planner.load_state_dict(saved)
    assert fresh.planner.cost_model == comp.planner.cost_model
    assert fresh.planner.dense_local == comp.planner.dense_local


def test_compressed_transfers_never_set_the_dense_price(one_process_group, monkeypatch):
    """A compressed bucket's small transfers read a slow link fast (on the tbf-shaped
    100 Mbit hop, 65 and 124 kB in 4-12 ms against 675 kB in 76-109 ms): a window of them
    keeps the link that prices the dense bucket, so the bucket stays compressed; the
    link moves again with the next dense transfers or a probe."""
    from megatron_edgc.patches import bypass_planner

    cost = 0.01
    comp, plan = _planner_with(one_process_group, LinkModel(1e-4, 1e-12), cost)
    slow = _link_with_saving(plan, 1e-4, 10 * cost)
    monkeypatch.setattr(bypass_planner, "measure_link",
                        lambda pg, device: pytest.fail("no probe without a speed-up"))
    comp.set_iteration(0)
    comp.prepare_iteration()
    _observe(comp, plan, slow)
    comp.set_iteration(5)
    comp.prepare_iteration()
    assert comp.dense_keys == frozenset()
    assert comp.link.s_per_byte == pytest.approx(slow.s_per_byte)
    refitted = comp.link
    wire = sum(plan.compressor.wire_bytes())
    bursty = LinkModel(slow.alpha_s, slow.s_per_byte / 20)     # what small transfers read
    for it in (10, 15):
        for _ in range(5):
            comp.planner.observe([(0, wire, bursty.allreduce_s(wire), False)])
        comp.set_iteration(it)
        comp.prepare_iteration()
        assert comp.dense_keys == frozenset() and comp.link == refitted


def test_an_exploring_iteration_measures_the_choice_not_taken(one_process_group):
    """Every ``explore`` windows the first iteration sends the bucket the other way; the
    decision in force stays, and its dense transfer, timed on a link that got fast, brings
    the bucket back to dense at the next refit (the compressed transfers alone could not:
    latency-bound, they run alike on both links)."""
    from megatron_edgc.patches.ddp import DPGradientCompression
    from test_host_sync import fake_ddp_chunk

    cost = 0.01
    comp = DPGradientCompression([fake_ddp_chunk(n_buckets=1)], one_process_group, rank=4,
                                 compress_single_replica=True, min_compression_rate=2.0,
                                 start_iter=0, seed=0, bypass="auto", link_window=5,
                                 link_explore=2)
    plan = next(iter(comp.plans.values()))
    slow = _link_with_saving(plan, 1e-4, 10 * cost)
    comp.planner.links = {one_process_group: slow}
    comp.planner.cost_model = {plan.key: (cost, 0.0)}
    wire = sum(plan.compressor.wire_bytes())
    fast = LinkModel(1e-4, 1e-12)
    sent = {}
    for it in range(21):
        comp.set_iteration(it)
        comp.prepare_iteration()
        sent[it] = (comp.dense_keys, comp.stats.explored, comp.planner.in_force)
        link = slow if it < 12 else fast
        if comp.dense_keys:
            comp.planner.observe([(0, plan.dense_bytes, link.allreduce_s(plan.dense_bytes),
                                   True)])
        else:                  # latency-bound: the same on both links
            comp.planner.observe([(0, wire, 2e-3, False)])
    assert sent[0] == (frozenset(), False, frozenset())          # slow: compressed
    assert sent[10] == ({plan.key}, True, frozenset())           # explored: dense, once
    assert all(sent[i][0] == frozenset() for i in range(1, 10)) and sent[11][0] == frozenset()
    # the link got fast at 12; the latency-bound compressed transfers do not show it ...
    assert sent[15][0] == frozenset() and sent[15][2] == frozenset()
    # ... the explored dense transfer of iteration 20 does, at the next refit
    assert sent[20] == ({plan.key}, True, frozenset())
    comp.set_iteration(25)
    comp.prepare_iteration()
    assert comp.dense_keys == {plan.key} and not comp.stats.explored


def test_a_declared_link_is_kept_and_the_local_work_still_refitted(one_process_group,
                                                                   monkeypatch):
    """Issue 80: a declared link (``--edgc-link-gbps``, ``--edgc-link-latency-ms``) prices
    every dense bucket as declared, through every refit, while each choice's local work is
    refitted from the job's steps and explored as on a measured link: so a run on
    loopback takes the decisions of the link it declares. No transfer is timed, no probe
    runs."""
    from megatron_edgc.patches import bypass_planner
    from megatron_edgc.patches.ddp import DPGradientCompression
    from test_host_sync import fake_ddp_chunk

    monkeypatch.setattr(bypass_planner, "measure_link",
                        lambda pg, device: pytest.fail("a declared link is never probed"))
    cost = 0.01
    probe = DPGradientCompression([fake_ddp_chunk(n_buckets=1)], one_process_group, rank=4,
                                  compress_single_replica=True, min_compression_rate=2.0,
                                  start_iter=0, seed=0, bypass="auto")
    declared = _link_with_saving(next(iter(probe.plans.values())), 3e-3, 2 * cost)
    comp = DPGradientCompression([fake_ddp_chunk(n_buckets=1)], one_process_group, rank=4,
                                 compress_single_replica=True, min_compression_rate=2.0,
                                 start_iter=0, seed=0, bypass="auto", link=declared,
                                 link_window=5, link_explore=2)
    plan = next(iter(comp.plans.values()))
    comp.planner.cost_model = {plan.key: (cost, 0.0)}
    assert comp.planner.timed_links() == {}
    sent = {}
    for it in range(16):
        comp.set_iteration(it)
        comp.prepare_iteration()
        sent[it] = (comp.dense_keys, comp.stats.explored)
        assert comp.link == declared
        assert comp.stats.link_alpha_ms == pytest.approx(3.0)
        # the job's math runs at 3x the start-up timing: compressing no longer pays
        local = 0.001 if comp.dense_keys else 3 * cost
        comp.planner.observe([], {plan.key: local}, comp.stats.predicted_local)
    assert all(sent[i] == (frozenset(), False) for i in range(5))   # 2x the math saved
    assert sent[5] == ({plan.key}, False)                            # refitted: 3x
    assert sent[10] == (frozenset(), True)                           # explored
    assert comp.planner.math_seconds(plan.key, 4) == pytest.approx(3 * cost)
    assert comp.planner.dense_local == {plan.key: pytest.approx(0.001)}


class _WorkClock:
    """A clock that reads the work charged to it (seconds), not the host's: each path's
    local work is then exact on any machine, beside any load."""

    use_cuda = False

    def __init__(self):
        self.now = 0.0

    def stamp(self) -> float:
        return self.now

    def completion(self, work) -> float:
        return self.now

    def seconds_between(self, start, end) -> float:
        return end - start

    def wait(self) -> None:
        pass


def _priced_run(monkeypatch, gbit_per_s: float, explore: int, iters: int = 13):
    """A one-bucket DP sync, bypass on a declared link (window 3), run through the real
    pipeline for ``iters`` iterations on a :class:`_WorkClock` that charges the compressed
    math 10 ms, the dense wire's cast 1 ms, and absorbing residuals into a dense message
    26 ms (as measured: 4.49 ms against 0.17 for a 24 MiB fp32 bucket). Returns the
    planner, the bucket's key and each step's ``(sent dense, local_s, switch_s)``."""
    from megatron_edgc.patches import dp_plans
    from megatron_edgc.patches.ddp import DPGradientCompression
    from megatron_edgc.patches.dp_stats import DPSyncStats
    from test_host_sync import compressed_dp_step, fake_ddp_chunk

    math_s, cast_s, switch_s = 0.010, 0.001, 0.026
    clock = _WorkClock()

    class CastCharged:                # dp_plans' torch, its cast to the wire charged
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def mul(*args, **kwargs):
            clock.now += cast_s
            return torch.mul(*args, **kwargs)

    monkeypatch.setattr(dp_plans, "torch", CastCharged())
    chunk = fake_ddp_chunk(n_buckets=1)
    comp = DPGradientCompression([chunk], torch.distributed.group.WORLD, rank=4,
                                 compress_single_replica=True, min_compression_rate=2.0,
                                 start_iter=0, seed=0, bypass="auto",
                                 link=LinkModel.declared(gbit_per_s, 0.0), link_window=3,
                                 link_explore=explore, dense_wire="bf16")
    comp.stats.clock = clock
    plan = next(iter(comp.plans.values()))
    comp.planner.cost_model = {plan.key: (0.5 * math_s, 0.0)}   # start-up: half the job's
    c = plan.compressor
    start, absorb = c.start, c.absorb_residual

    def charged_start(*args, **kwargs):
        clock.now += math_s
        return start(*args, **kwargs)

    def charged_absorb(*args, **kwargs):
        clock.now += 0.0 if c.state.clear else switch_s
        return absorb(*args, **kwargs)

    c.start, c.absorb_residual = charged_start, charged_absorb
    gen = torch.Generator().manual_seed(0)
    steps = []
    for it in range(iters):
        comp.set_iteration(it)
        comp.prepare_iteration()
        compressed_dp_step(comp, chunk, gen)
        st = comp.stats.take()
        DPSyncStats.resolve_all([st])
        comp.observe_link([st])
        steps.append((plan.key in comp.dense_keys, st.local_s.get(plan.key),
                      getattr(st, "switch_s", {}).get(plan.key, 0.0)))
    return comp.planner, plan.key, steps


@pytest.mark.parametrize("in_force", ["compressed", "dense"])
def test_explorations_keep_each_path_steady_price(one_process_group, monkeypatch, in_force):
    """Issue 91: an exploration that sends a compressed bucket dense, and the first dense
    iteration after a compressed one, absorb the residuals into the dense message, a pass
    the dense path pays once; it is timed apart (``switch_s``), so the prices the bypass
    refits from a bucket explored both ways stay those of runs that never switch: the
    dense path's local work (its cast, 1 ms) and the math (10 ms)."""
    slow, fast = 1e-4, 1e4             # Gbit/s: compressing pays by far, or never
    gbit = slow if in_force == "compressed" else fast
    steady_dense, key, dense_steps = _priced_run(monkeypatch, fast, explore=0)
    steady_math, _, math_steps = _priced_run(monkeypatch, slow, explore=0)
    assert all(d for d, _, _ in dense_steps) and not any(d for d, _, _ in math_steps)
    assert steady_dense.dense_local[key] == pytest.approx(0.001)
    assert steady_math.math_seconds(key, 4) == pytest.approx(0.010)
    explored, _, steps = _priced_run(monkeypatch, gbit, explore=1)
    assert explored.dense_local[key] == pytest.approx(steady_dense.dense_local[key], rel=0.1)
    assert explored.math_seconds(key, 4) == pytest.approx(steady_math.math_seconds(key, 4),
                                                          rel=0.1)
    # explorations at 3, 6, 9, 12 (each the first iteration of a window), decisions kept
    # (priced with the absorption, a dense bucket went compressed: 27 ms against 10)
    sent = [d for d, _, _ in steps]
    assert sent == [(in_force == "dense") != (it in (3, 6, 9, 12)) for it in range(13)]
    # the absorptions, in the step's telemetry apart: the explorations (or their returns)
    switches = [it for it, (_, _, s) in enumerate(steps) if s]
    assert switches == ([3, 6, 9, 12] if in_force == "compressed" else [4, 7, 10])
    assert all(steps[it][2] == pytest.approx(0.026) for it in switches)


def test_a_stage_off_its_steady_path_stays_out_of_dac_fits():
    """Issue 91: an iteration where a stage's buckets left their steady path (the bypass
    explored, or a bucket absorbed its residuals going dense: ``dp_switch_share`` > 0)
    synced at no rank's steady time; DAC's fit of that stage leaves it out, the other
    stages' fits take their own."""
    from megatron_edgc.runtime.dac import StageTimeFits

    fits = StageTimeFits(2)
    nan = float("nan")
    for ranks, sync, switch in (([8, 8], [10.0, 20.0], [0.0, 0.0]),
                                ([4, 4], [6.0, 12.0], [0.0, 0.0]),
                                ([8, 4], [100.0, 12.0], [1.0, 0.0]),    # stage 0 explored
                                ([8, 8], [40.0, 20.0], [0.5, nan])):    # half its buckets
        fits.observe(ranks, {"dp_sync_ms": sync, "t_b_ms": [1.0, 1.0], "t_p2p_ms": [nan, nan],
                             "dp_switch_share": switch})
    (m0, m1) = fits.fit()
    assert (m0.eta, m0.c) == pytest.approx((1.0, 2.0))        # 10 ms at 8, 6 at 4
    assert (m1.eta, m1.c) == pytest.approx((2.0, 4.0))        # every iteration of stage 1
    assert fits.sums[0][0] == 2 and fits.sums[1][0] == 4


def _resumed(comp, link=None, state=None, **settings):
    """A fresh DP sync (as at a resume: ``link`` declared now, or none) loaded with
    ``comp``'s checkpointed state (or ``state``), through ``torch.save`` as a checkpoint
    holds it."""
    import io

    from megatron_edgc.patches.ddp import DPGradientCompression
    from test_host_sync import fake_ddp_chunk

    saved = io.BytesIO()
    torch.save(comp.state_dict() if state is None else state, saved)
    saved.seek(0)
    fresh = DPGradientCompression([fake_ddp_chunk(n_buckets=1)], comp.dp_group, rank=4,
                                  compress_single_replica=True, min_compression_rate=2.0,
                                  start_iter=0, seed=0, bypass="auto", link=link, **settings)
    fresh.load_state_dict(torch.load(saved, weights_only=False))
    return fresh


def test_a_resumed_run_decides_as_the_uninterrupted_one(one_process_group, monkeypatch):
    """Issue 91: resumed after any iteration, the bypass takes the uninterrupted run's
    decisions: the decision in force is restored (the hysteresis margin keeps a bucket
    compressed whose refitted math is 1.3x the saving's worth, inside the 25 % band: a
    margin of 0 sent it dense), and the samples of the window in progress reach its
    refit (without them a window's median read 20 ms instead of 13)."""
    from megatron_edgc.patches import bypass_planner

    monkeypatch.setattr(bypass_planner, "measure_link",
                        lambda pg, device: pytest.fail("the checkpoint's link is kept"))
    cost = 0.01
    comp, plan = _planner_with(one_process_group, LinkModel(1e-4, 1e-12), cost)
    link = _link_with_saving(plan, 1e-4, 1.2 * cost)        # compressing saves 12 ms
    comp.planner.links = {one_process_group: link}
    wire = sum(plan.compressor.wire_bytes())
    # the job's math (s) per iteration: window medians 13, 13, 25 ms
    math_s = [0.013] * 3 + [0.020] * 2 + [0.013] * 7 + [0.025] * 3 + [0.013] * 10

    def step(c, it):
        c.set_iteration(it)
        c.prepare_iteration()
        dense = plan.key in c.dense_keys
        busy = (0, plan.dense_bytes, link.allreduce_s(plan.dense_bytes), True) if dense \
            else (0, wire, 2e-3, False)
        c.planner.observe([busy], {plan.key: 0.002 if dense else math_s[it]},
                          c.stats.predicted_local)
        return dense

    iters = len(math_s)
    uninterrupted, states = [], []
    for it in range(iters):
        uninterrupted.append(step(comp, it))
        states.append(_resumed(comp, link_window=5))     # a checkpoint after each iteration
    assert uninterrupted == [False] * 15 + [True] * 10   # held compressed at 13 ms
    for k, resumed in enumerate(states[:-1]):
        in_force = resumed.planner.in_force
        decisions = [step(resumed, it) for it in range(k + 1, iters)]
        assert decisions == uninterrupted[k + 1:], f"resumed after iteration {k}"
        assert in_force == (frozenset({plan.key}) if uninterrupted[k] else frozenset())
        assert resumed.planner.cost_model == comp.planner.cost_model
        assert resumed.planner.dense_local == comp.planner.dense_local


def test_a_link_declared_at_the_resume_wins_over_the_checkpoint(one_process_group,
                                                                monkeypatch):
    """Issue 91: a link declared at the resume (``--edgc-link-gbps``,
    ``--edgc-link-latency-ms``) prices the resumed run, not the checkpoint's; a link the
    checkpoint declared is measured afresh where none is declared now; a checkpoint from
    before the decisions were saved still loads its link and math."""
    from megatron_edgc.patches import bypass_planner

    measured = LinkModel(2e-4, 1e-10)
    monkeypatch.setattr(bypass_planner, "measure_link", lambda pg, device: measured)
    cost = 0.01
    comp, plan = _planner_with(one_process_group, LinkModel(0.0, 8e-9), cost)   # 1 Gbit/s
    comp.set_iteration(0)
    comp.prepare_iteration()
    declared = LinkModel.declared(0.1, 5e-3)
    resumed = _resumed(comp, link=declared, link_window=5)
    resumed.set_iteration(1)
    resumed.prepare_iteration()
    assert resumed.link == declared and resumed.stats.link_alpha_ms == pytest.approx(5.0)
    assert resumed.stats.link_gbps == pytest.approx(declared.gbit_per_s)
    assert resumed.planner.cost_model == comp.planner.cost_model
    # declared before, not now: measured as a new run measures it
    again = _resumed(resumed, link_window=5)
    again.set_iteration(2)
    again.prepare_iteration()
    assert again.link == measured
    # a checkpoint without the keys this issue added: its link and math, no decision
    old = comp.state_dict()
    old["cost_model"] = {k: v for k, v in old["cost_model"].items()
                         if k in ("links", "cost_model", "dense_local")}
    fresh = _resumed(comp, state=old, link_window=5)
    assert fresh.planner.links[one_process_group] == comp.link
    assert fresh.planner.cost_model == comp.planner.cost_model
    assert fresh.planner.in_force == frozenset()


def test_the_trainer_resumed_prices_with_the_link_it_declares(small_model_argv, tmp_path):
    """Issue 91, through the command line: a run checkpointed on a declared 1 Gbit/s link
    with no latency, resumed declaring 0.1 Gbit/s and 5 ms, prices every resumed
    iteration with the link the resume declares (before: the checkpoint's)."""
    from distributed import read_jsonl
    from test_checkpoint import pretrain

    base = small_model_argv + ["--pipeline-model-parallel-size", "1",
                               "--data-parallel-size", "2", "--edgc-mode", "static",
                               "--edgc-rank", "4", "--edgc-bypass", "auto",
                               "--train-iters", "5", "--eval-interval", "5",
                               "--save", str(tmp_path / "ck"), "--save-interval", "3"]
    first, resumed = str(tmp_path / "first.jsonl"), str(tmp_path / "resumed.jsonl")
    pretrain(base + ["--edgc-link-gbps", "1", "--metrics-file", first,
                     "--exit-interval", "3"])
    assert [(r["dp_link_gbps"], r["dp_link_alpha_ms"]) for r in read_jsonl(first)] == \
        [(pytest.approx(1.0), 0.0)] * 3
    pretrain(base + ["--edgc-link-gbps", "0.1", "--edgc-link-latency-ms", "5",
                     "--metrics-file", resumed, "--load", str(tmp_path / "ck")])
    records = read_jsonl(resumed)
    assert [r["iteration"] for r in records] == [4, 5]
    assert [(r["dp_link_gbps"], r["dp_link_alpha_ms"]) for r in records] == \
        [(pytest.approx(0.1), pytest.approx(5.0))] * 2
