"""One owner for a compressed unit's state (issue 71, ``compression/unit_state.py``), in
one process: each seam where the state used to be lost or misread — a rank change with a
skip (flat and slow hop), a resume in another precision (both ways), a load mapped to
another device (DP and PP), an overflowing local factor, a save after a step whose
outcome never came, the entropy under a changing scale, the replay's units. DP ranks are
simulated by summing tensors, as in ``test_powersgd.py``."""

import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_edgc.compression.activation import ActivationGradSender
from megatron_edgc.compression.powersgd import BucketCompressor
from megatron_edgc.compression.step_capture import StepCapture, replay
from megatron_edgc.control.entropy import GradientSampler, SampledEntropy
from megatron_edgc.patches import ddp
from test_host_sync import compression_of, fake_ddp_chunk, one_process_group  # noqa: F401
from test_powersgd import simulated_step
from test_shard_powersgd import SlowHopCluster, random_grads

ENTRIES = [("a", (64, 64)), ("b", (64, 32)), ("bias", (1, 64))]


def grads_of(seed, ranks=2, entries=ENTRIES):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, m, generator=gen) for _, (n, m) in entries] for _ in range(ranks)]


def pending_of(c) -> dict:
    """The residuals a compressor holds for matrices gone dense (read by the name the code
    of before issue 71 gave them too, so that these tests fail there on what they assert)."""
    return c.state.pending if hasattr(c, "state") else c._pending_flush


def residual(c, name):
    """``name``'s residual in compressor ``c``: its group's, or its pending one (fp32)."""
    for g in c.groups.values():
        if name in g.names and g.residual is not None:
            return g.residual[g.names.index(name)].float()
    pending = pending_of(c).get(name)
    return None if pending is None else pending.float()


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def mapped(state, device="cpu"):
    """A checkpoint's round trip: saved, then loaded with ``map_location``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location=device, weights_only=False)


# ---------------------------------------------------------------------- a rank change

def test_a_rank_change_then_a_skip_loses_no_residual():
    """``a (64×64)``, ``b (64×32)`` at rank 4, two applied steps; then ``b``'s shape at rank
    16 (dense: ``(64 + 32)·16·2 > 64·32``) and a skipped step: ``b``'s residual, handed to
    the dense rest, survives the skip bit for bit, ``a``'s is ``M`` (the rule); the next
    applied step delivers it. Over the whole sequence, what the applied steps delivered
    plus every rank's residual is every gradient (the skipped step's dense rest apart,
    dropped as Megatron's dense skip drops it)."""
    comps = [BucketCompressor(ENTRIES, 4, seed=0) for _ in range(2)]
    delivered = {name: 0.0 for name, _ in ENTRIES}
    total = {name: 0.0 for name, _ in ENTRIES}

    def step(seed, applied):
        grads = grads_of(seed)
        for j, (name, _) in enumerate(ENTRIES):
            if applied or name == "a":   # a skipped step's dense rest is dropped
                total[name] = total[name] + sum(g[j] for g in grads)
        simulated_step(comps, grads, applied=applied)
        if applied:
            for j, (name, _) in enumerate(ENTRIES):
                delivered[name] = delivered[name] + grads[0][j]

    step(1, True)
    step(2, True)
    before = [residual(c, "b").clone() for c in comps]
    for c in comps:
        c.set_rank(4, {(64, 32): 16})
    assert all(torch.equal(pending_of(c)["b"], e) for c, e in zip(comps, before))
    m_a = [grads_of(3)[r][0] + residual(c, "a") for r, c in enumerate(comps)]
    step(3, False)
    for c, e, m in zip(comps, before, m_a):
        assert torch.equal(pending_of(c)["b"], e)   # carried by the skipped message, kept
        assert relative(residual(c, "a"), m) < 1e-6
    step(4, True)
    assert all(not pending_of(c) for c in comps)    # delivered with the applied step
    for c in comps:   # b compressed again: its residual (zero now) back in a group
        c.set_rank(4)
        c.prepare()
    step(5, True)
    for name, _ in ENTRIES:
        held = sum(residual(c, name) if residual(c, name) is not None else 0.0
                   for c in comps)
        assert relative(delivered[name] + held, total[name]) < 1e-5, name


def test_a_matrix_compressed_again_takes_its_pending_residual_back():
    """A pending residual of a matrix that is compressed again before any message carried
    it goes back into its group's ``E`` (it moves with the matrix)."""
    comp = BucketCompressor(ENTRIES, 4, seed=0)
    simulated_step([comp], grads_of(1, ranks=1))
    e_b = residual(comp, "b").clone()
    comp.set_rank(4, {(64, 32): 16})
    comp.set_rank(4)
    comp.prepare()
    assert not pending_of(comp)
    assert torch.equal(residual(comp, "b"), e_b)


def test_the_slow_hop_keeps_a_residual_gone_dense_through_a_skip():
    """The slow hop's shards: a shape gone dense at a rank change hands its row blocks'
    residuals to the dense rest; a skipped step keeps them, the next applied one delivers
    them exactly (the dense rest is summed exactly)."""
    cluster = SlowHopCluster(2, 2, rank=2)
    for seed in (0, 1):
        cluster.step(random_grads(2, 2, cluster.total, seed=seed))
    dense_shape = (24, 16)   # w0 and w2: dense at rank 6 ((24 + 16)·6·2 > 24·16)
    for comp in cluster.comps.values():
        comp.set_rank(2, {dense_shape: 6})
    pending = {tk: {k: v.clone() for k, v in pending_of(c).items()}
               for tk, c in cluster.comps.items()}
    assert sum(len(p) for p in pending.values()) >= 4
    cluster.step(random_grads(2, 2, cluster.total, seed=2), applied=False)
    for tk, comp in cluster.comps.items():
        assert pending_of(comp).keys() == pending[tk].keys()
        assert all(torch.equal(pending_of(comp)[k], v) for k, v in pending[tk].items())
    grads = random_grads(2, 2, cluster.total, seed=3)
    plain = sum(g for inst in grads for g in inst)
    out = cluster.whole(cluster.step(grads))
    assert all(not pending_of(c) for c in cluster.comps.values())
    carried = torch.zeros(cluster.total)
    for (t, k), p in pending.items():
        for pc in cluster.pieces[k]:
            if pc.name in p:
                carried[pc.start:pc.start + pc.numel] += p[pc.name].reshape(-1)
    where = carried != 0
    assert torch.allclose(out[where], (plain + carried)[where], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- the precision

FP16_SCALE = 2.0 ** 16


def run_steps(comps, seeds, scale):
    """Steps over ``seeds`` at loss scale ``scale`` (None: no scaler); returns each step's
    decompressed gradients in unscaled units (rank 0's)."""
    out = []
    for seed in seeds:
        s = 1.0 if scale is None else scale
        for c in comps:
            c.loss_scale = None if scale is None else torch.tensor([scale])
        grads = [[g * s for g in gs] for gs in grads_of(seed)]
        simulated_step(comps, grads)
        out.append(torch.cat([g.reshape(-1) for g in grads[0]]) / s)
    return out


@pytest.mark.parametrize("saved,resumed", [(FP16_SCALE, None), (None, FP16_SCALE)],
                         ids=["fp16-into-bf16", "bf16-into-fp16"])
def test_a_resume_in_another_precision_continues_in_the_right_units(saved, resumed):
    """Three steps at one loss scale (an fp16 run's 2^16, or none: bf16/fp32), a
    checkpoint mapped to the host, two steps at the other: the same outputs as a run that
    never switched, to rounding (before issue 71, an fp16 checkpoint read in bf16 used
    ``E`` at 2^16 times its size, and the reverse dropped it)."""
    straight = [BucketCompressor(ENTRIES, 4, seed=0) for _ in range(2)]
    want = run_steps(straight, range(5), None)
    first = [BucketCompressor(ENTRIES, 4, seed=0) for _ in range(2)]
    run_steps(first, range(3), saved)
    states = [mapped(c.state_dict()) for c in first]
    second = [BucketCompressor(ENTRIES, 4, seed=0) for _ in range(2)]
    for c, state in zip(second, states):
        assert c.load_state_dict(state) == []
    got = run_steps(second, range(3, 5), resumed)
    for a, b in zip(got, want[3:]):
        assert relative(a, b) < 1e-5, relative(a, b)


def test_a_checkpoint_of_before_issue_71_is_read_in_its_units():
    """Before issue 71 a checkpoint kept ``E`` in the units of the loss scale it was
    formed at (``residual_units``): it loads net of that scale."""
    comp = BucketCompressor(ENTRIES, 4, seed=0)
    simulated_step([comp], grads_of(1, ranks=1))
    state = mapped(comp.state_dict())
    old = dict(state, residual_units=FP16_SCALE, pending_flush=state.pop("pending"))
    for mat in old["matrices"].values():
        mat["residual"] = mat["residual"] * FP16_SCALE
    other = BucketCompressor(ENTRIES, 4, seed=0)
    other.load_state_dict(old)
    assert torch.equal(residual(other, "a"), residual(comp, "a"))
    # a pipeline sender's: its one matrix's q and residual at the top level
    sender = ActivationGradSender(rank=4, seed=2)
    sender.compress(torch.randn(16, 2, 24))
    saved = sender.state_dict()
    (mat,) = saved["matrices"].values()
    loaded = ActivationGradSender(rank=4, seed=2)
    loaded.load_state_dict({"rank": 4, "q": mat["q"], "residual": mat["residual"] * FP16_SCALE,
                            "residual_units": torch.tensor(FP16_SCALE)})
    assert torch.equal(loaded.residual, sender.residual) and torch.equal(loaded.q, sender.q)


# ---------------------------------------------------------------------- the device

def placements(comp):
    return {t.device.type for g in comp.groups.values() for t in (g.q, g.residual)} | \
        {t.device.type for t in pending_of(comp).values()} | \
        {t.device.type for entry in comp.spectrum.values() for t in entry}


def test_a_load_places_every_field_on_the_compressors_device():
    """A checkpoint mapped to the host loads every field (warm starts, residuals, pending
    residuals, the measured spectrum) onto the compressor's device — here ``meta``, a
    device other than the saved one (before issue 71 the pending residuals stayed on the
    host, to meet a GPU's gradients in the next message)."""
    comp = BucketCompressor(ENTRIES, 4, seed=0)
    comp.track_spectrum = True
    simulated_step([comp], grads_of(1, ranks=1))
    comp.set_rank(4, {(64, 32): 16})
    assert pending_of(comp) and comp.spectrum
    state = mapped(comp.state_dict())
    other = BucketCompressor(ENTRIES, 4, seed=0, device=torch.device("meta"))
    other.load_state_dict(state)
    assert placements(other) == {"meta"}
    assert pending_of(other).keys() == {"b"}


def test_a_pipeline_sender_loaded_on_the_host_sends_from_the_messages_device():
    """A sender's checkpoint mapped to the host, then ``prepare`` for messages on another
    device (``meta``): its warm start and residual move there, keeping their shapes (before
    issue 71 ``prepare`` checked shapes only and left both on the host)."""
    sender = ActivationGradSender(4, seed=1, name="pp-stage1-chunk0")
    for seed in range(2):
        sender.compress(torch.randn(8, 2, 48, generator=torch.Generator().manual_seed(seed)))
    state = mapped(sender.state_dict())
    other = ActivationGradSender(4, seed=1, name="pp-stage1-chunk0")
    other.load_state_dict(state)
    assert torch.equal(other.residual, sender.residual) and torch.equal(other.q, sender.q)
    other.prepare(16, 48, torch.device("meta"))
    assert other.q.device.type == other.residual.device.type == "meta"
    assert other.q.shape == (48, 4) and other.residual.shape == (16, 48)


# ---------------------------------------------------------------------- the message's rule

def test_an_overflowing_local_factor_keeps_the_residual():
    """Finite ``M`` and ``P^`` whose product ``Q_i = Mᵀ P^`` overflows fp32 on one rank:
    that rank's matrix keeps ``E`` bit for bit (the message's non-finite rule, as where the
    first SUM is not finite), the summed ``Q`` is not finite, the step is left NaN and
    skipped, and ``E`` stays finite; the other rank's follows the skip rule (``E = M``).
    Before issue 71 the rank's ``E`` became Inf, and NaN after the skip."""
    entries = [("w", (64, 16))]
    comps = [BucketCompressor(entries, 1, seed=0) for _ in range(2)]
    simulated_step(comps, [[torch.randn(64, 16)] for _ in comps])
    for c in comps:   # a warm start that keeps P = M Q small for a huge constant M
        c.groups[(64, 16)].q = torch.zeros(1, 16, 1)
        c.groups[(64, 16)].q[0, 0, 0] = 1e-2
    before = [residual(c, "w").clone() for c in comps]
    huge = torch.full((64, 16), 1e38)     # Mᵀ P^ ≈ 64 · 1e38 / 8 = 8e38 > 3.4e38
    small = torch.randn(64, 16)
    m_small = small + before[1]
    grads = [[huge.clone()], [small.clone()]]
    simulated_step(comps, grads, applied=False)
    assert torch.isnan(grads[0][0]).all()
    assert torch.equal(residual(comps[0], "w"), before[0])
    assert torch.isfinite(residual(comps[1], "w")).all()
    assert relative(residual(comps[1], "w"), m_small) < 1e-6


# ---------------------------------------------------------------------- an outcome that never came

def test_a_save_after_an_unreported_step_follows_the_skip_rule(one_process_group):  # noqa: F811
    """The plug-in returns before ``end_step`` when Megatron-LM's rerun machine exits
    before ``optimizer.step()``, and Megatron-LM may still save: the DP compression's
    ``state_dict`` (the checkpoint registry's) then settles the step by the rule — a
    compressed bucket's residual is ``M`` (not ``M - P^ Qᵀ``, as if applied) and a dense
    sync's residual is kept (not zeroed)."""
    chunk = fake_ddp_chunk(n_buckets=1)
    compression = compression_of(chunk, one_process_group)
    group, bucket = chunk.bucket_groups[0], chunk.bucket_groups[0].buckets[0]
    plan = next(iter(compression.plans.values()))
    gen = torch.Generator().manual_seed(3)

    def sync(it, dense=False):
        compression.set_iteration(it)
        compression.prepare_iteration()
        if dense:
            compression.dense_keys = frozenset(compression.plans)
        bucket.grad_data.copy_(torch.randn(bucket.grad_data.shape, generator=gen))
        grads = plan.grads(bucket.grad_data * ddp.DPGradientCompression._scaling(group, plan))
        m = {name: grads[i] + residual(plan.compressor, name)
             for g in plan.compressor.groups.values() for i, name in zip(g.indices, g.names)}
        group.start_grad_sync()
        group.finish_grad_sync()
        return m

    sync(0)
    compression.after_step(applied=True)
    m = sync(1)   # the outcome never reported, then a save
    saved = compression.state_dict()["buckets"][plan.key]["matrices"]
    assert m and all(relative(saved[name]["residual"], want) < 1e-6 for name, want in m.items())
    kept = {name: e["residual"].clone() for name, e in saved.items()}
    sync(2, dense=True)   # a dense sync, unreported, then a save
    saved = compression.state_dict()["buckets"][plan.key]["matrices"]
    assert all(torch.equal(saved[name]["residual"], e) for name, e in kept.items())
    assert any(e.abs().sum() > 0 for e in kept.values())


# ---------------------------------------------------------------------- the gradients' units

def test_the_entropy_is_taken_net_of_the_loss_scale():
    """GDS on gradients carrying a changing loss scale, told the scale, measures the
    entropy of the same gradients at no scale, to rounding (a Gaussian entropy would move
    by ln 2 = 0.69 nats at every halving or doubling of an fp16 run's scale)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=gen) * 1e-3 for _ in range(4)]
    for estimator in ("gaussian", "histogram"):
        def entropies(scales):
            out = []
            for g, s in zip(grads, scales):
                est = SampledEntropy({"b": GradientSampler(g.numel(), grad_sample_rate=0.25,
                                                           seed=1)}, estimator=estimator)
                scale = None if s is None else torch.tensor([s])
                est.add("b", g * (1.0 if s is None else s), 0, scale)
                out.append(float(est.entropy("cpu")))
            return out

        plain = entropies([None] * 4)
        scaled = entropies([2.0 ** 16, 2.0 ** 15, 2.0 ** 16, 2.0 ** 17])
        assert max(abs(a - b) for a, b in zip(plain, scaled)) < 1e-4, (estimator, plain,
                                                                          scaled)


def test_a_captured_step_replays_the_m_it_formed_at_its_scale():
    """``--edgc-debug-dump``'s capture of a step at loss scale 2^12 with a residual formed
    before: the replay's ``M = G + s·E`` and new residual are the step's (before issue 71
    the replay ignored the scale and formed another ``M``)."""
    comp = BucketCompressor(ENTRIES, 4, seed=0)
    comp.loss_scale = torch.tensor([2.0 ** 12])
    simulated_step([comp], [[g * 2.0 ** 12 for g in grads_of(1, ranks=1)[0]]])
    grads = [g * 2.0 ** 12 for g in grads_of(2, ranks=1)[0]]
    capture = StepCapture(comp, grads, iteration=1, rank=0, bucket="b0")
    m = grads[0] + residual(comp, "a") * 2.0 ** 12
    seen = {}
    bufs, step = comp.start(grads)
    capture.summed("p", bufs)
    bufs = comp.middle(step, bufs)
    capture.summed("q", bufs)
    comp.finish(step, bufs)
    comp.after_step(applied=True)
    record = mapped(capture.record)
    group = record["groups"][[g["names"] for g in record["groups"]].index(["a"])]
    formed = group["grad"][0].float() + group["residual"][0].float() * record["loss_scale"]
    assert relative(formed, m) < 1e-6
    assert all(finite for _, _, finite in replay(record))
    seen = {phase for _, phase, _ in replay(record)}
    assert "M = G + s·E" in seen


def test_a_pending_residual_reaches_fp16_gradients_to_one_rounding():
    """Issue 81: ``E`` is kept net of the loss scale, gradient-sized, so carried into fp16
    buffers it must be scaled before it is cast: at |E| ~ 7e-8 a cast first loses it to
    fp16's subnormals (relative error 0.19, a quarter of the elements 0); scaled first,
    it arrives to one fp16 rounding of ``s · E``."""
    comp = BucketCompressor(ENTRIES, 4, seed=0)
    torch.manual_seed(0)
    e = torch.randn(64, 32) * 7e-8
    comp.state.pending["b"] = e.clone()
    comp.loss_scale = torch.tensor([2.0 ** 16])
    grads = [torch.zeros(s, dtype=torch.float16) for _, s in ENTRIES]
    comp.absorb_residual(grads)
    exact = e * 2.0 ** 16
    carried = grads[1].float()
    assert (carried == 0).sum() == 0
    # one rounding: half an ulp of each element (fp16's subnormal step below 2^-14)
    assert torch.allclose(carried, exact, rtol=2.0 ** -11, atol=2.0 ** -25)
    assert (carried - exact).norm() / exact.norm() < 1e-3


# ---------------------------------------------------------------------- the pipeline's rule

def sender_iteration(sender, messages, outcome=None):
    """One iteration of ``sender``: its schedule (``messages``: the activation gradients
    it sends), then the outcome (None: never reported); returns the factors it sent."""
    sender.begin_iteration()
    sent = [tuple(t.clone() for t in sender.compress(m)) for m in messages]
    if outcome is not None:
        sender.after_step(outcome)
    return sent


def test_a_skipped_pipeline_iteration_rolls_the_sender_back():
    """Issue 81: the pipeline's sender takes the iteration's outcome. A skipped iteration
    (or one never reported, or a schedule run again: Megatron-LM's rerun of an iteration,
    the first run discarded) leaves ``E`` and ``Q`` as the iteration found them, bit for
    bit, and a run again sends what the first run sent; an applied one moves them (the
    code before: after one skip |E - E0| / |E0| was 1.46). A save before the outcome
    saves the iteration's start and changes nothing."""
    gen = torch.Generator().manual_seed(5)
    batches = [[torch.randn(16, 2, 24, generator=gen) for _ in range(4)] for _ in range(4)]
    sender = ActivationGradSender(rank=4, seed=2)
    sender_iteration(sender, batches[0], outcome=True)
    e0, q0 = sender.residual.clone(), sender.q.clone()
    assert e0.abs().sum() > 0
    first = sender_iteration(sender, batches[1], outcome=False)    # skipped
    assert torch.equal(sender.residual, e0) and torch.equal(sender.q, q0)
    sender_iteration(sender, batches[1])                           # never reported ...
    saved = sender.state_dict()["matrices"]["pp-edge"]
    assert torch.equal(saved["residual"], e0) and torch.equal(saved["q"], q0)
    assert not torch.equal(sender.residual, e0)                    # ... the save took nothing
    again = sender_iteration(sender, batches[1], outcome=True)     # ... then run again
    assert all(torch.equal(a, b) for f, g in zip(first, again) for a, b in zip(f, g))
    assert not torch.equal(sender.residual, e0)                    # applied: it stands
    e1 = sender.residual.clone()
    sender_iteration(sender, batches[2], outcome=True)
    assert not torch.equal(sender.residual, e1)
    # a sender driven without iterations (a benchmark, a test) settles each message alone
    loose = ActivationGradSender(rank=4, seed=2)
    for m in batches[3]:
        loose.compress(m)
    loose.after_step(False)
    assert loose.compressor.state._mark is None and loose.residual.abs().sum() > 0


#: Operations that make a new view of a tensor's memory and touch no element.
VIEWS = frozenset({"view", "detach", "alias", "as_strided", "slice", "select", "narrow",
                   "expand", "t", "transpose", "permute", "squeeze", "unsqueeze",
                   "_unsafe_view", "unfold", "diagonal"})


class TensorOps(TorchDispatchMode):
    """The names of the tensor operations run inside it that read or write elements, in
    order (views left out: a step may view its operands differently, e.g. ``select``'s
    16-byte views of an output that is not its input, without touching more memory)."""

    def __init__(self):
        super().__init__()
        self.names: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def residuals_held(sender) -> int:
    """Bytes of the distinct residual-sized tensors a sender's state holds (``E``, a held
    mark's, the spare)."""
    state = sender.compressor.state
    (g,) = state.groups.values()
    tensors = [g.residual] + [e for _, e in (state._mark or {}).values()]
    tensors += list(getattr(state, "_spare", {}).values())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_the_pipeline_mark_copies_nothing():
    """Issue 91: :meth:`UnitState.mark` holds the iteration's start itself; the first
    message takes its residual into a spare one. A marked iteration, applied or rolled
    back, runs exactly the tensor operations of an unmarked message (the code before
    cloned ``E`` and ``Q`` at the mark, 13.5 ms of a 43.7 ms [8192, 1024] message, and
    copied them back at a rollback), and the sender never holds more than two residuals
    (``E`` and the mark's, or the spare), as many as that copy made."""
    gen = torch.Generator().manual_seed(9)
    batches = [[torch.randn(16, 2, 24, generator=gen)] for _ in range(6)]
    sender = ActivationGradSender(rank=4, seed=2)
    sender_iteration(sender, batches[0], outcome=True)
    sender_iteration(sender, batches[1], outcome=False)      # the spare made here
    one = 32 * 24 * 4                                          # one residual, fp32
    with TensorOps() as loose:
        sender.compress(batches[2][0])
    for outcome in (True, False, True):
        e0, q0 = sender.residual.clone(), sender.q.clone()
        with TensorOps() as marked:
            sender.begin_iteration()
            sender.compress(batches[3][0])
            held = residuals_held(sender)
            sender.after_step(outcome)
        assert marked.names == loose.names, (outcome, marked.names, loose.names)
        assert held == 2 * one and residuals_held(sender) == 2 * one
        moved = not torch.equal(sender.residual, e0)
        assert moved == outcome and torch.equal(sender.q, q0) != outcome


def test_a_save_while_a_mark_is_held_after_a_rank_change_keeps_the_start():
    """Issue 91: a rank change while the pipeline's sender holds a mark (an iteration under
    way) resizes the mark's ``Q`` too, so a save then stores the iteration's start at the
    new rank, as a sender that never ran the iteration holds it, and the load restores
    ``E`` (the code before saved the mark's ``Q`` at the old rank: the load found it did
    not fit and dropped ``Q`` and ``E``). The outcome, not applied, leaves the same state."""
    gen = torch.Generator().manual_seed(11)
    msgs = [torch.randn(16, 2, 24, generator=gen) for _ in range(3)]

    def after_one_iteration():
        s = ActivationGradSender(rank=4, seed=2)
        sender_iteration(s, msgs[:1], outcome=True)
        return s

    sender, twin = after_one_iteration(), after_one_iteration()
    e0 = sender.residual.clone()
    assert e0.abs().sum() > 0
    sender.begin_iteration()
    sender.compress(msgs[1])                   # the mark held, E moved
    assert not torch.equal(sender.residual, e0)
    sender.set_rank(6)
    twin.set_rank(6)                           # the iteration never ran
    assert tuple(twin.q.shape) == (24, 6)
    saved = mapped(sender.state_dict())
    matrix = saved["matrices"]["pp-edge"]
    assert saved["rank"] == 6
    assert torch.equal(matrix["residual"], e0) and torch.equal(matrix["q"], twin.q)
    loaded = ActivationGradSender(rank=1, seed=2)
    loaded.load_state_dict(saved)
    assert loaded.residual is not None and torch.equal(loaded.residual, e0)
    assert torch.equal(loaded.q, twin.q)
    sender.after_step(False)
    assert torch.equal(sender.residual, e0) and torch.equal(sender.q, twin.q)
    twin_next = twin.compress(msgs[2])
    for s in (sender, loaded):                 # each sends what the twin sends next
        assert all(torch.equal(a, b) for a, b in zip(s.compress(msgs[2]), twin_next))


def test_a_save_changes_nothing_of_the_step_in_flight(one_process_group):  # noqa: F811
    """Issue 81: ``state_dict`` gives what the rule leaves if the step in flight is not
    applied (``E`` with ``A Bᵀ`` given back), in a copy: saved twice alike, and when the
    outcome then comes (applied), the residual is the applied step's ``M - A Bᵀ``."""
    comp = BucketCompressor(ENTRIES, rank=2, seed=1, compress_all=True)
    grads = grads_of(7, ranks=1)[0]
    simulated_step([comp], [grads])
    comp.after_step(applied=True)
    grads = grads_of(8, ranks=1)[0]
    simulated_step([comp], [grads], applied=None)       # in flight
    names = [n for g in comp.groups.values() for n in g.names]
    assert names == ["a", "b"]
    live = {name: residual(comp, name).clone() for name in names}
    first, second = comp.state_dict(), comp.state_dict()
    for name in names:
        assert torch.equal(first["matrices"][name]["residual"],
                           second["matrices"][name]["residual"])
        assert torch.equal(residual(comp, name), live[name])
    comp.after_step(applied=True)          # the applied step's M - A Bᵀ, untouched
    for name in names:
        assert torch.equal(residual(comp, name), live[name])
    simulated_step([comp], [grads], applied=None)
    saved = comp.state_dict()
    comp.after_step(applied=False)
    for name in names:
        assert torch.equal(saved["matrices"][name]["residual"], residual(comp, name))


def megatron_lm_args(*argv):
    """Megatron-LM's ``args`` as the plug-in reads them: the ``--edgc-*`` flags parsed from
    ``argv``, the rest a small TP1·PP2·DP2 job's values (``--rerun-mode`` as given)."""
    import argparse

    from megatron_edgc.megatron_lm.flags import add_args

    parser = add_args(argparse.ArgumentParser())
    parser.add_argument("--rerun-mode", default="validate_results")   # Megatron-LM's default
    args = parser.parse_args(list(argv))
    for name, value in dict(
            num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
            seq_length=64, max_position_embeddings=64, tensor_model_parallel_size=1,
            pipeline_model_parallel_size=2, data_parallel_size=2,
            virtual_pipeline_model_parallel_size=None, overlap_grad_reduce=False,
            use_distributed_optimizer=False, micro_batch_size=2, global_batch_size=8,
            train_iters=8, train_samples=None, seed=1234, save=None, load=None).items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize("mode", ["validate_results", "report_stats"])
def test_a_rerun_of_an_iteration_is_refused_by_name(mode, monkeypatch, capsys):
    """Issue 91: Megatron-LM's rerun machine runs an iteration's forward and backward again
    (``validate_results``, its default, after a failed check of the loss; ``report_stats``
    every iteration). A DP bucket takes the first run's gradient into ``E`` in place during
    the backward, before a re-run is decided, so its second run counted the gradient twice
    (``2 G + E_0`` delivered plus kept, the test this replaces pinned it); undoing it would
    take a copy of every residual each iteration. So the plug-in refuses those modes by
    name before any process group exists when the user gives them, and takes ``disabled``
    in place of Megatron-LM's default, saying so; with DP compression off (the pipeline's
    senders roll back to their mark, counting a re-run once) and with EDGC off, every mode
    runs."""
    from megatron_edgc.config import ConfigError
    from megatron_edgc.megatron_lm.flags import run_config

    given = ["--rerun-mode", mode]
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *given])
    with pytest.raises(ConfigError) as refused:
        run_config(megatron_lm_args("--edgc-mode", "static", *given))
    message = str(refused.value)
    assert message.startswith(f"--rerun-mode: {mode} runs an iteration again (")
    assert "count twice" in message and message.endswith(
        "pass --rerun-mode disabled (a NaN or Inf loss still stops the job)")
    assert run_config(megatron_lm_args("--edgc-mode", "edgc", "--rerun-mode", "disabled"))
    assert run_config(megatron_lm_args("--edgc-mode", "off", "--edgc-pp-compression",
                                       "static", *given))
    assert run_config(megatron_lm_args(*given))
    # not given: Megatron-LM's default validate_results, taken as disabled with a line
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--rerun-modes-unrelated"])
    capsys.readouterr()
    args = megatron_lm_args("--edgc-mode", "static")
    assert run_config(args) and args.rerun_mode == "disabled"
    assert capsys.readouterr().out == (
        "EDGC: --rerun-mode disabled, as none was given: validate_results runs an "
        "iteration again (Megatron-LM's default: again after a failed check of the loss "
        "(NaN, Inf, --check-for-spiky-loss, --error-injection-rate), then again from the "
        "checkpoint it saves), which EDGC would count twice: a DP bucket takes the "
        "iteration's gradient into its residual during the backward, in place, before a "
        "re-run is decided (a NaN or Inf loss still stops the job)\n")


