"""Error feedback around the optimizer's decisions, in one process (issue 63): a residual
kept in the units of a changing loss scale, and a skipped step that loses nothing
(docs/reliability.md, "One rule for a step's outcome"; docs/method.md, "Error feedback under a loss
scale"). DP ranks are simulated by summing tensors, as in ``test_powersgd.py``."""

import pytest
import torch

from megatron_edgc.compression.activation import ActivationGradSender
from megatron_edgc.compression.kernels import ErrorFeedback
from megatron_edgc.compression.powersgd import BucketCompressor
from test_powersgd import simulated_step
from test_shard_powersgd import SlowHopCluster, random_grads

ENTRIES = [("w", (48, 64)), ("v", (48, 64)), ("u", (64, 40)), ("b", (1, 48))]


def true_grads(seed, ranks=2):
    """Per rank, the unscaled gradients of one step (a decaying spectrum: most of their
    energy in a few directions, as a real gradient's)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ranks):
        grads = []
        for _, (n, m) in ENTRIES:
            if n == 1:
                grads.append(torch.randn(n, m, generator=gen))
                continue
            u = torch.randn(n, 6, generator=gen) * torch.tensor([2.0 ** -i for i in range(6)])
            grads.append(u @ torch.randn(6, m, generator=gen) + 0.05 * torch.randn(
                n, m, generator=gen))
        out.append(grads)
    return out


def without_units(monkeypatch):
    """Today's behaviour before issue 63: the residual read as it is, whatever scale."""
    original = ErrorFeedback.begin

    def begin(self, loss_scale):
        original(self, None)
    monkeypatch.setattr(ErrorFeedback, "begin", begin)


def run_scaled(scales, grad_dtype=torch.float32, ef_dtype=torch.float32, rank=3):
    """Six steps of a bucket on 2 simulated ranks, the loss scale ``scales[t]`` at step
    ``t``; returns each step's decompressed gradients in unscaled units (rank 0's)."""
    comps = [BucketCompressor(ENTRIES, rank, seed=1, ef_dtype=ef_dtype) for _ in range(2)]
    outputs = []
    for t, s in enumerate(scales):
        for c in comps:
            c.loss_scale = torch.tensor([float(s)])
        grads = [[(g * s).to(grad_dtype) for g in gs] for gs in true_grads(t)]
        simulated_step(comps, grads)
        outputs.append(torch.cat([g.float().reshape(-1) for g in grads[0]]) / s)
    return outputs


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


# a scaler's life: backed off twice (overflows), grown at a window, backed off again
CHANGING = [2.0 ** 10, 2.0 ** 9, 2.0 ** 8, 2.0 ** 8, 2.0 ** 9, 2.0 ** 7]


@pytest.mark.parametrize("grad_dtype,ef_dtype,tol", [
    (torch.float32, torch.float32, 1e-5),
    (torch.float16, torch.float32, 2e-3),     # fp16 buffers: M formed in fp32 slices
    (torch.float32, torch.bfloat16, 2e-2),    # a bf16 residual: its own rounding
], ids=["fp32", "fp16-buffers", "bf16-residual"])
def test_a_changing_loss_scale_matches_a_fixed_one(monkeypatch, grad_dtype, ef_dtype, tol):
    """The same gradients under a scale that halves and doubles give, unscaled, the
    outputs of a run at a fixed scale, to the rounding of the buffers; read in the units
    it was formed at, the residual is 2x or 4x off and so is the next output."""
    fixed = run_scaled([2.0 ** 8] * len(CHANGING), grad_dtype, ef_dtype)
    changing = run_scaled(CHANGING, grad_dtype, ef_dtype)
    errors = [relative(a, b) for a, b in zip(changing, fixed)]
    assert max(errors) < tol, errors
    without_units(monkeypatch)
    stale = run_scaled(CHANGING, grad_dtype, ef_dtype)
    assert max(relative(a, b) for a, b in zip(stale, fixed)) > 20 * tol


def test_a_constant_loss_scale_is_bit_identical_to_none():
    """A scale that does not change reads ``E`` times exactly 1: the step is the one
    without a loss scaler, bit for bit (the bf16/fp32 path is unchanged)."""
    a = run_scaled([1.0] * 4)
    comps = [BucketCompressor(ENTRIES, 3, seed=1) for _ in range(2)]
    for t, out in enumerate(a):
        grads = true_grads(t)
        simulated_step(comps, grads)
        assert torch.equal(torch.cat([g.reshape(-1) for g in grads[0]]), out)


def test_pipeline_residual_follows_the_loss_scale(monkeypatch):
    """The pipeline's sender (EDGC §7) keeps its residual net of the loss scale, as a DP bucket."""
    gen = torch.Generator().manual_seed(0)
    msgs = [torch.randn(64, 32, generator=gen) @ torch.diag(torch.logspace(0, -2, 32))
            for _ in range(len(CHANGING))]

    def run(scales):
        sender, out = ActivationGradSender(4, seed=2), []
        for msg, s in zip(msgs, scales):
            sender.loss_scale = torch.tensor([float(s)])
            p, q = sender.compress(msg * s)
            out.append((p @ q.T) / s)
        return out

    fixed = run([2.0 ** 8] * len(CHANGING))
    assert max(relative(a, b) for a, b in zip(run(CHANGING), fixed)) < 1e-5
    without_units(monkeypatch)
    assert max(relative(a, b) for a, b in zip(run(CHANGING), fixed)) > 1e-2


# ---------------------------------------------------------------------- a skipped step

def two_buckets(ef_dtype=torch.float32):
    """Two buckets of the same entries, each on 2 simulated ranks."""
    return [[BucketCompressor(ENTRIES, 3, seed=b, ef_dtype=ef_dtype) for _ in range(2)]
            for b in range(2)]


def state(comps):
    return [[(g.residual.clone(), g.q.clone()) for g in c.groups.values()] for c in comps]


def follows_the_skip_rule(buckets, before, m, bad_bucket, tol):
    """Item 4's rule after a skipped step: a finite bucket's residual is ``M_i`` (what the
    step did not apply), a bucket with a non-finite gradient has its state from before the
    step, bit for bit; the same on every rank."""
    for b, comps in enumerate(buckets):
        for r, c in enumerate(comps):
            for j, g in enumerate(c.groups.values()):
                e_before, q_before = before[b][r][j]
                if b == bad_bucket:
                    if not (torch.equal(g.residual, e_before) and torch.equal(g.q, q_before)):
                        return False
                    continue
                want = torch.stack([m[b][r][i] for i in g.indices])
                if relative(g.residual.float(), want) > tol:
                    return False
    return True


def residual_of(c, i):
    """Entry ``i``'s residual in compressor ``c`` (fp32), or 0 where it is sent dense."""
    for g in c.groups.values():
        if i in g.indices:
            return g.residual[g.indices.index(i)].float()
    return 0.0


def skip_case(buckets, apply_rule=True):
    """Bucket ``b``: step 1 (``true_grads(10 + b)``) applied; step 2 (``true_grads(20 +
    b)``, an Inf in rank 1's ``v`` of bucket 1) skipped. Returns the state before step 2,
    the ``M_i`` of step 2, and each step's gradients as the sync left them."""
    first = [true_grads(10 + b) for b in range(2)]
    for comps, grads in zip(buckets, first):
        simulated_step(comps, grads)
        for c in comps:
            c.after_step(applied=True)
    before = [state(comps) for comps in buckets]
    second = [true_grads(20 + b) for b in range(2)]
    second[1][1][1][3, 7] = float("inf")
    m = [[[gs[i] + residual_of(c, i) for i in range(len(ENTRIES))]
          for c, gs in zip(comps, grads)] for comps, grads in zip(buckets, second)]
    for comps, grads in zip(buckets, second):
        simulated_step(comps, grads, applied=None)
        if apply_rule:
            for c in comps:
                c.after_step(applied=False)
    return before, m, first, second


@pytest.mark.parametrize("ef_dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16-residual"])
def test_a_skipped_step_keeps_what_it_did_not_apply(ef_dtype, tol):
    """An overflow in one bucket of one rank: the step is skipped for every bucket. The
    finite bucket's residual takes back its sent part (``E = M``, nothing lost), the
    failing bucket's state is as before the step; today's mix (the finite bucket keeping
    ``M - P^ Qᵀ``, its sent part thrown away with the skipped step) fails the rule."""
    buckets = two_buckets(ef_dtype)
    before, m, *_ = skip_case(buckets)
    assert follows_the_skip_rule(buckets, before, m, bad_bucket=1, tol=tol)
    mix = two_buckets(ef_dtype)
    before, m, *_ = skip_case(mix, apply_rule=False)
    assert not follows_the_skip_rule(mix, before, m, bad_bucket=1, tol=tol)


def test_nothing_is_lost_across_a_skip():
    """Conservation through a skip: what the applied steps delivered plus every rank's
    residual is every gradient of every step, the skipped step's included."""
    buckets = two_buckets()
    _, _, first, _ = skip_case(buckets)
    comps, third = buckets[0], true_grads(30)
    simulated_step(comps, third)
    for c in comps:
        c.after_step(applied=True)
    for i in range(3):   # the compressed matrices of the finite bucket
        total = sum(g[i] for seed in (10, 20, 30) for g in true_grads(seed))
        delivered = first[0][0][i] + third[0][i]   # steps 1 and 3 (every rank's alike)
        residuals = sum(residual_of(c, i) for c in comps)
        assert relative(delivered + residuals, total) < 1e-5


def test_a_dense_sync_keeps_its_residual_when_the_step_is_skipped():
    """The bypass or warm-up adds the residual into the dense message; the residual is
    zeroed when the optimizer applies the step, and kept, bit for bit, when it skips it."""
    comps = [BucketCompressor(ENTRIES, 3, seed=0) for _ in range(2)]
    simulated_step(comps, true_grads(1))
    c = comps[0]
    kept = [g.residual.clone() for g in c.groups.values()]
    grads = true_grads(2)[0]
    plain = [g.clone() for g in grads]
    c.absorb_residual(grads)
    for j, i in enumerate(c.groups[(48, 64)].indices):
        assert torch.equal(grads[i], plain[i] + kept[0][j])
    c.after_step(applied=False)
    assert all(torch.equal(g.residual, e) for g, e in zip(c.groups.values(), kept))
    assert not c.state.clear
    c.absorb_residual(grads)
    c.after_step(applied=True)
    assert all(not g.residual.any() for g in c.groups.values()) and c.state.clear


def test_the_slow_hop_keeps_what_a_skipped_step_did_not_apply():
    """The slow hop's shards (EDGC across distributed-optimizer instances): after a skip,
    the residuals summed over every rank are everything not yet applied."""
    cluster = SlowHopCluster(2, 2, rank=2)
    g1 = random_grads(2, 2, cluster.total, seed=0)
    shards = cluster.step([[g.clone() for g in inst] for inst in g1])
    out1 = cluster.whole(shards)
    g2 = random_grads(2, 2, cluster.total, seed=1)
    cluster.step([[g.clone() for g in inst] for inst in g2], applied=None)
    for comp in cluster.comps.values():
        comp.after_step(applied=False)
    total = sum(g for grads in (g1, g2) for inst in grads for g in inst)
    matrices = torch.zeros(cluster.total, dtype=torch.bool)
    for comp_k in range(cluster.s):
        for pc in cluster.pieces[comp_k]:
            if pc.row_block:
                matrices[pc.start:pc.start + pc.numel] = True
    got = (out1 + cluster.residual_sum())[matrices]
    assert relative(got, total[matrices]) < 1e-5


def test_a_step_flagged_only_by_the_second_sum_keeps_what_it_did_not_apply():
    """Finite gradients everywhere, and the summed ``Q`` not finite (an overflow in the
    second SUM): the residual was taken in the middle, under the first SUM's clear flag;
    the gradients come out NaN, the warm start keeps its value bit for bit, and once the
    optimizer skips the NaN step the residual is ``M`` (the skip rule: nothing lost)."""
    comps = [BucketCompressor(ENTRIES, 3, seed=0) for _ in range(2)]
    simulated_step(comps, true_grads(1))
    for c in comps:
        c.after_step(applied=True)
    grads = true_grads(2)
    m = [[g + residual_of(c, i) for i, g in enumerate(gs)] for c, gs in zip(comps, grads)]
    q_before = [[g.q.clone() for g in c.groups.values()] for c in comps]
    firsts = [c.start(g) for c, g in zip(comps, grads)]
    reduced = [sum(parts) for parts in zip(*(bufs for bufs, _ in firsts))]
    qs = [c.middle(step, [b.clone() for b in reduced]) for c, (_, step) in zip(comps, firsts)]
    (reduced_q,) = [sum(parts) for parts in zip(*qs)]
    reduced_q[5] = float("inf")
    for c, (_, step) in zip(comps, firsts):
        c.finish(step, [reduced_q.clone()])
        assert bool(step.nonfinite)
    for c, gs, qb, mi in zip(comps, grads, q_before, m):
        assert all(torch.isnan(gs[i]).all() for g in c.groups.values() for i in g.indices)
        assert all(torch.equal(g.q, q) for g, q in zip(c.groups.values(), qb))
        c.after_step(applied=False)
        for g in c.groups.values():
            want = torch.stack([mi[i] for i in g.indices])
            assert relative(g.residual, want) < 1e-6
