"""PowerSGD on the slow hop (``compression/shard_powersgd.py``), in one process: ``N``
instances of ``s`` ranks, every collective of ``patches/ddp.py``'s slow-hop path done here
by summing tensors. Against flat PowerSGD of the whole (transposed) matrices
(``BucketCompressor``): the same output step after step (both depend only on the sums),
conservation of the residuals, full rank = the dense sum, the bytes per rank on the slow
hop, and the non-finite guarantee."""

import pytest
import torch

from megatron_edgc.compression.powersgd import BucketCompressor
from megatron_edgc.compression.shard import shard_pieces
from megatron_edgc.compression.shard_powersgd import ShardCompressor, shard_compressor_inputs

# a bucket as Megatron lays it out: matrices and vectors, cut by the shards inside rows
SHAPES = [(24, 16), (16,), (24, 16), (40, 12), (12,), (32, 20), (7,)]


def bucket_layout(s, shapes=SHAPES):
    matrices, at = [], 0
    for i, shape in enumerate(shapes):
        n, m = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        matrices.append((f"w{i}", (n, m), at))
        at += n * m
    total = at + (-at) % s
    return matrices, total


class SlowHopCluster:
    """``instances × s`` ranks; rank ``(t, k)`` owns shard ``k`` of instance ``t``."""

    def __init__(self, instances, s, rank, factor_dtype=torch.float32, shapes=SHAPES, **kw):
        self.n_inst, self.s = instances, s
        self.matrices, self.total = bucket_layout(s, shapes)
        self.size = self.total // s
        self.pieces = [shard_pieces([(nm, off, sh) for nm, sh, off in self.matrices],
                                    k * self.size, (k + 1) * self.size) for k in range(s)]
        self.comps = {}
        for t in range(instances):
            for k in range(s):
                entries, parents = shard_compressor_inputs(self.pieces[k], self.matrices)
                self.comps[t, k] = ShardCompressor(
                    entries, parents, [(nm, sh) for nm, sh, _ in self.matrices], s, rank,
                    seed=3, factor_dtype=factor_dtype, **kw)
        self.slow_hop_numel = {}

    def views(self, shard, k):
        lo = k * self.size
        return [shard[pc.start - lo:pc.start - lo + pc.numel].view(pc.shape)
                for pc in self.pieces[k]]

    def step(self, grads, applied=True):
        """``grads[t][k]``: each rank's whole-bucket gradient. Returns each rank's shard
        after the sync, ``out[t, k]``; ``applied``: the optimizer's outcome reported to
        every compressor (None: left unreported)."""
        n, s = self.n_inst, self.s
        shards = {}
        for t in range(n):   # the instance's reduce-scatter of the gradients
            summed = sum(grads[t][k] for k in range(s))
            for k in range(s):
                shards[t, k] = summed[k * self.size:(k + 1) * self.size].clone()
        started = {tk: self.comps[tk].start(self.views(shards[tk], tk[1])) for tk in shards}
        shared = self.comps[0, 0].shares_factor()   # the same answer on every rank
        assert all(c.shares_factor() == shared for c in self.comps.values())
        sent = {}
        for t in range(n):   # the instance's reduce-scatter of P
            if not shared:
                break
            summed = sum(started[t, k][0][0] for k in range(s)).view(s, -1)
            for k in range(s):
                sent[t, k] = self.comps[t, k].to_send(summed[k].clone())
        gathered = {}
        for k in range(s):   # the slow hop: 1/s of P per rank
            self.slow_hop_numel[k] = 0
            if not shared:
                continue
            total = sum(sent[t, k].float() for t in range(n)).to(sent[0, k].dtype)
            self.slow_hop_numel[k] = total.numel()
            for t in range(n):
                gathered[t, k] = total
        second = {}
        for t in range(n):   # the instance's all-gather of P, then Q_b' = M_b P^
            p_full = [torch.cat([gathered[t, k] for k in range(s)])] if shared else []
            for k in range(s):
                second[t, k] = self.comps[t, k].middle(started[t, k][1],
                                                       [p.clone() for p in p_full])
        for k in range(s):   # the slow hop: [Q_b' | dense | flag]
            bufs = [sum(second[t, k][j].float() for t in range(n)).to(b.dtype)
                    for j, b in enumerate(second[0, k])]
            self.slow_hop_numel[k] += sum(b.numel() for b in bufs)
            for t in range(n):
                self.comps[t, k].finish(started[t, k][1], [b.clone() for b in bufs])
        if applied is not None:
            for comp in self.comps.values():
                comp.after_step(applied)
        return shards

    def residual_sum(self):
        """Σ over every rank of its residuals, laid out as the bucket."""
        out = torch.zeros(self.total)
        for (t, k), comp in self.comps.items():
            for g in comp.groups.values():
                if g.residual is None:
                    continue
                for j, i in enumerate(g.indices):
                    pc = self.pieces[k][i]
                    out[pc.start:pc.start + pc.numel] += g.residual[j].float().reshape(-1)
        return out

    def whole(self, shards, t=0):
        return torch.cat([shards[t, k] for k in range(self.s)])


def flat_compressor(matrices, rank, **kw):
    """Flat PowerSGD of the transposed matrices (the slow hop orthonormalizes the
    columns' factor), same seeds."""
    return BucketCompressor([(nm, (sh[1], sh[0])) for nm, sh, _ in matrices], rank, seed=3,
                            **kw)


def transposed_views(x, matrices):
    return [x[off:off + n * m].view(n, m).t() for _, (n, m), off in matrices]


def flat_step(comp, matrices, grads, dense_at):
    """Flat PowerSGD with every rank's sum as one worker (it depends only on the sums),
    the partial rows a shard boundary cuts (``dense_at``, a mask) sent dense: the
    matrices are compressed without them, and they arrive exact."""
    dense = sum(grads)
    total = dense.masked_fill(dense_at, 0.0)
    bufs, step = comp.start(transposed_views(total, matrices))
    comp.finish(step, comp.middle(step, bufs))
    comp.after_step(applied=True)
    return torch.where(dense_at, dense, total)


def cut_rows(cluster):
    """Mask of the partial rows at shard boundaries (the pieces sent dense)."""
    mask = torch.zeros(cluster.total, dtype=torch.bool)
    rows = {name: n for name, (n, m), _ in cluster.matrices}
    for pieces in cluster.pieces:
        for pc in pieces:
            if not pc.row_block and rows[pc.parent] > 1:
                mask[pc.start:pc.start + pc.numel] = True
    return mask


def random_grads(instances, s, total, seed, shapes=SHAPES):
    """Every rank's gradient; the bucket's padding is zero, as in Megatron's buffer."""
    gen = torch.Generator().manual_seed(seed)
    params = sum(n * m for _, (n, m), _ in bucket_layout(s, shapes)[0])
    grads = [[torch.randn(total, generator=gen) for _ in range(s)] for _ in range(instances)]
    for inst in grads:
        for g in inst:
            g[params:] = 0
    return grads


@pytest.mark.parametrize("instances,s", [(2, 2), (2, 4), (3, 2)])
def test_same_output_as_flat_powersgd_step_after_step(instances, s):
    cluster = SlowHopCluster(instances, s, rank=3)
    assert cut_rows(cluster).any()   # the shards cut matrices inside rows
    flat = flat_compressor(cluster.matrices, 3)
    params = sum(n * m for _, (n, m), _ in cluster.matrices)
    for it in range(4):
        grads = random_grads(instances, s, cluster.total, seed=it)
        shards = cluster.step(grads)
        expected = flat_step(flat, cluster.matrices, [g for inst in grads for g in inst],
                             cut_rows(cluster))
        for t in range(instances):   # every instance holds the same result
            assert torch.equal(cluster.whole(shards, t), cluster.whole(shards, 0))
        err = (cluster.whole(shards)[:params] - expected[:params]).abs().max().item()
        assert err < 1e-4 * expected.abs().max().item(), (it, err)
        # it is a low-rank approximation: far from the dense sum
        dense = sum(g for inst in grads for g in inst)
        assert (cluster.whole(shards) - dense).abs().max() > 0.1


def test_residuals_conserve_what_compression_missed():
    cluster = SlowHopCluster(2, 2, rank=2)
    grads = random_grads(2, 2, cluster.total, seed=7)
    dense = sum(g for inst in grads for g in inst)
    out = cluster.whole(cluster.step(grads))
    missed = dense - out
    assert (cluster.residual_sum() - missed).abs().max().item() < 1e-5
    # the residuals are spread: every rank holds only its own rows (half the bucket)
    for (t, k), comp in cluster.comps.items():
        ef = sum(g.residual.numel() for g in comp.groups.values())
        assert ef < 0.6 * sum(n * m for _, (n, m), _ in cluster.matrices if n > 1)


def test_full_rank_is_the_dense_sum_and_leaves_no_residual():
    cluster = SlowHopCluster(2, 2, rank=64, compress_all=True)
    grads = random_grads(2, 2, cluster.total, seed=1)
    dense = sum(g for inst in grads for g in inst)
    out = cluster.whole(cluster.step(grads))
    assert (out - dense).abs().max().item() < 1e-5 * dense.abs().max().item() * 10
    assert cluster.residual_sum().abs().max().item() < 1e-5 * dense.abs().max().item()


@pytest.mark.parametrize("s", [2, 4])
def test_slow_hop_carries_own_rows_and_one_q_per_instance(s):
    r = 3
    cluster = SlowHopCluster(2, s, rank=r)
    cluster.step(random_grads(2, s, cluster.total, seed=0))
    lq = sum(m * r for _, (n, m), _ in cluster.matrices if n > 1)
    lq_padded = -(-(lq + 1) // s) * s   # the column factors, then the flag
    for k in range(s):
        comp = cluster.comps[0, k]
        rows = sum(pc.shape[0] * r for pc in cluster.pieces[k] if pc.row_block)
        dense = sum(pc.numel for pc in cluster.pieces[k] if not pc.row_block)
        expected = rows + dense + 1 + lq_padded // s
        assert cluster.slow_hop_numel[k] == expected == sum(comp.wire_bytes()) // 4
        assert sum(comp.wire_bytes()) == 4 * expected
    # one column factor per instance: its elements on the slow hop do not grow with s
    assert sum(sum(cluster.comps[0, k].phase_bytes()[0]) for k in range(s)) == 4 * lq_padded


@pytest.mark.parametrize("at", [5, 1265], ids=["in-a-matrix-of-shard-0",
                                              "in-a-vector-of-shard-1"])
def test_nonfinite_anywhere_keeps_every_ranks_state_and_q(at):
    cluster = SlowHopCluster(2, 2, rank=2)
    (piece,) = [pc for pcs in cluster.pieces for pc in pcs
                if pc.start <= at < pc.start + pc.numel]
    assert piece.row_block == (at == 5)   # a row block's P, or a dense piece's flag
    cluster.step(random_grads(2, 2, cluster.total, seed=0))
    before = {tk: [(g.q.clone(), g.residual.clone()) for g in c.groups.values()]
              for tk, c in cluster.comps.items()}
    grads = random_grads(2, 2, cluster.total, seed=1)
    grads[1][0][at] = float("nan")   # one element of instance 1's rank 0's gradient
    shards = cluster.step(grads)
    for tk, comp in cluster.comps.items():   # every rank, whichever shard it reached
        for (q, e), g in zip(before[tk], comp.groups.values()):
            assert torch.equal(q, g.q) and torch.equal(e, g.residual)
        assert torch.isnan(shards[tk]).any()
    # and the next finite step runs on as before
    shards = cluster.step(random_grads(2, 2, cluster.total, seed=2))
    assert all(torch.isfinite(v).all() for v in shards.values())


def test_bf16_factors_conserve_what_compression_missed():
    cluster = SlowHopCluster(2, 2, rank=2, factor_dtype=torch.bfloat16)
    grads = random_grads(2, 2, cluster.total, seed=3)
    dense = sum(g for inst in grads for g in inst)
    out = cluster.whole(cluster.step(grads))
    # each instance's residual is against the bf16 Q_t it sent; only the rounding of the
    # SUM across instances is not fed back
    err = (cluster.residual_sum() - (dense - out)).abs().max().item()
    assert err < 2e-2 * dense.abs().max().item()


def test_local_step_times_the_math_without_collectives():
    cluster = SlowHopCluster(2, 2, rank=2)
    comp = cluster.comps[0, 1].fresh(2)
    shard = torch.randn(cluster.size)
    comp.local_step(cluster.views(shard, 1))
    assert comp.groups and all(g.q is not None for g in comp.groups.values())


def test_spectrum_is_the_instances_column_energies():
    """The budget controller's measured error curves: summed over every rank, the shard
    compressors' spectrum is flat PowerSGD's with one worker per instance (its instance
    sum, the cut rows left out), up to the cut rows' share of the column energies."""
    n_inst, s, r = 2, 2, 3
    cluster = SlowHopCluster(n_inst, s, rank=r)
    flats = [flat_compressor(cluster.matrices, r) for _ in range(n_inst)]
    for comp in [*cluster.comps.values(), *flats]:
        comp.track_spectrum = True
    cut = cut_rows(cluster)
    for it in range(2):
        grads = random_grads(n_inst, s, cluster.total, seed=10 + it)
        cluster.step(grads)
        inst = [sum(g).masked_fill(cut, 0.0) for g in grads]
        views = [transposed_views(x, cluster.matrices) for x in inst]
        started = [f.start(v) for f, v in zip(flats, views)]
        summed = [sum(st[0][j] for st in started) for j in range(len(started[0][0]))]
        qs = [f.middle(st[1], summed) for f, st in zip(flats, started)]
        for f, st in zip(flats, started):
            f.finish(st[1], [sum(parts) for parts in zip(*qs)])
            f.after_step(applied=True)
    shard = {}
    for comp in cluster.comps.values():
        for shape, (total, cols, _) in comp.spectrum.items():
            t, c = shard.get(shape, (0.0, 0.0))
            shard[shape] = (t + total, c + cols)
    flat = {}
    for comp in flats:
        for (m, n), (total, cols, _) in comp.spectrum.items():
            t, c = flat.get((n, m), (0.0, 0.0))
            flat[n, m] = (t + total, c + cols)
    assert set(shard) == {(n, m) for _, (n, m), _ in cluster.matrices if n > 1}
    whole = {name: shape for name, shape, _ in cluster.matrices}
    cut = {whole[pc.parent] for pieces in cluster.pieces for pc in pieces
           if pc.row_block and pc.shape[0] < whole[pc.parent][0]}
    assert cut   # a matrix split between two ranks
    for shape, (total, cols) in flat.items():
        assert abs(shard[shape][0] - total) <= 1e-6 * total
        # the captured energy over all columns is exact; per column too for a matrix in
        # one shard; a matrix split between ranks has its columns sorted per block
        assert abs(shard[shape][1].sum() - cols.sum()) <= 1e-5 * cols.sum()
        rel = ((shard[shape][1] - cols).abs().max() / cols.max()).item()
        assert rel < (0.15 if shape in cut else 1e-5), (shape, rel)


def test_a_bucket_without_a_compressed_matrix_syncs_exactly():
    """All matrices too small to compress: every rank skips the first phase and sends its
    shard's dense rest, the exact sum."""
    shapes = [(40,), (3, 4)]
    cluster = SlowHopCluster(2, 4, rank=2, shapes=shapes)
    assert not any(c.shares_factor() for c in cluster.comps.values())
    grads = random_grads(2, 4, cluster.total, seed=4, shapes=shapes)
    dense = sum(g for inst in grads for g in inst)
    out = cluster.whole(cluster.step(grads))
    assert torch.allclose(out[:52], dense[:52], atol=1e-6)
    assert all(n == cluster.size + 1 for n in cluster.slow_hop_numel.values())


def test_a_shard_of_bucket_padding_takes_part():
    """A shard with no piece (only the bucket's padding) still runs both phases."""
    comp = ShardCompressor([], [], [("w", (64, 32))], 4, 2)
    assert comp.shares_factor() and tuple(map(sum, comp.phase_bytes())) == (4 * comp.slice_numel(), 4)
    (p_full,), step = comp.start([])
    assert p_full.abs().sum() == 0
    bufs = comp.middle(step, [p_full])
    comp.finish(step, bufs)
    assert [b.numel() for b in bufs] == [1] and bufs[0][0] == 0
