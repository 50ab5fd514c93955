"""The DP patch's bucket plans and driver in one process: the slow-hop strategy against the
flat one, and megatron-core's ``force_all_reduce``."""

import types

import pytest
import torch
import torch.distributed as dist

from megatron_edgc.patches import ddp
from megatron_edgc.patches.dp_plans import BucketPlan
from megatron_edgc.patches.megatron_buckets import Reduction, megatron_sync_bytes
from rounding import assert_within_rounding, two_paths_bound
from test_host_sync import fake_ddp_chunk, one_process_group  # noqa: F401 (a fixture)

# ---------------------------------------------------------------------- slow hop vs flat

#: One bucket: two matrices of one shape, one of another, a bias (sent dense).
MATRICES = [("w1", (48, 40)), ("w2", (48, 40)), ("w3", (40, 96)), ("b", (1, 40))]
INTER, INTRA = object(), object()   # the groups, as tokens: collectives are simulated


def one_bucket(seed: int, transposed: bool = False):
    """A bucket of :data:`MATRICES` and its layout; ``transposed``: each matrix stored as
    its transpose (``m × n``)."""
    numel = sum(n * m for _, (n, m) in MATRICES)
    bucket = types.SimpleNamespace(grad_data=torch.zeros(numel))
    offset, layout = 0, []
    for name, (n, m) in MATRICES:
        layout.append((name, (m, n) if transposed else (n, m), offset))
        offset += n * m
    return bucket, layout


def transpose_matrices(flat: torch.Tensor, shapes) -> torch.Tensor:
    """A bucket's data with each matrix (``shapes``, in order) transposed."""
    out, offset = torch.empty_like(flat), 0
    for n, m in shapes:
        out[offset:offset + n * m] = flat[offset:offset + n * m].view(n, m).t().reshape(-1)
        offset += n * m
    return out


def run_in_lockstep(strategies: list) -> None:
    """Every simulated rank's strategy, one phase at a time; each collective's result is
    the SUM over the group (the inter-instance token: every rank; the instance's: the rank
    alone, one rank per instance)."""
    while True:
        phases = []
        for s in strategies:
            try:
                phases.append(next(s))
            except StopIteration:
                phases.append(None)
        if all(p is None for p in phases):
            return
        assert all(p is not None for p in phases)
        for j in range(len(phases[0].collectives)):
            cs = [p.collectives[j] for p in phases]
            assert len({c.kind for c in cs}) == 1 and len({id(c.group) for c in cs}) == 1
            if cs[0].group is INTRA:         # a group of one: the identity
                for c in cs:
                    if c.recv is not None:
                        c.recv.copy_(c.send)
                continue
            assert cs[0].kind == "all_reduce" and cs[0].group is INTER
            total = sum(c.send.float() for c in cs).to(cs[0].send.dtype)
            for c in cs:
                c.send.copy_(total)


def slow_hop_rounding_bound(factor_dtype: torch.dtype, step: int, inner: int) -> float:
    """How far the two strategies may drift apart after ``step + 1`` steps (relative,
    Frobenius): :func:`rounding.two_paths_bound` (each product's rounding differs between
    kernels by ~``√k u`` in norm, a factor rounded on the other side of a tie by ``u_f``,
    the error feedback carries a step's difference into the next; margin 8). The measured
    drift (AMD EPYC, ``M P^`` with ``P^`` row- against column-major, issue 59) was 1.6e-7 /
    3.8e-7 / 5.4e-7 in fp32 and up to 5.3e-4 with bf16 factors, against bounds of 5.2e-6 /
    1.0e-5 / 1.6e-5 and 3.1e-2 / 6.3e-2 / 9.4e-2. A wrong side, a lost residual or a wrong
    factor differ by O(1) (0.72-1.23: checked with broken variants)."""
    return two_paths_bound(inner, step + 1, factor_dtype)


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
def test_slow_hop_with_one_rank_per_instance_equals_the_flat_strategy(factor_dtype):
    """With s = 1 the slow hop's shard is the whole bucket: its strategy (dense
    reduce-scatter, ``[L | flag]`` reduce-scattered, the slice across, the all-gather,
    ``[Q' | dense | flag]`` across) must give what the flat strategy gives with the factor
    on the same side (the flat one on the transposed matrices, PowerSGD of ``Mᵀ``):
    gradients, residuals, warm starts, over three steps,
    within :func:`slow_hop_rounding_bound` (two code paths: their products may round
    differently on another CPU); and every replica of each strategy bit for bit the same."""
    instances, rank = 3, 4
    settings = dict(min_compression_rate=1.0, seed=5, factor_dtype=factor_dtype,
                    device=torch.device("cpu"))
    slow, flat = [], []
    for t in range(instances):
        bucket, layout = one_bucket(t)
        slow.append(BucketPlan.build("b0", bucket, Reduction(INTER, instances, False, INTRA, 1, 0),
                                     layout, [], rank, settings))
        bucket, layout = one_bucket(t, transposed=True)
        flat.append(BucketPlan.build("b0", bucket, Reduction(INTER, instances, False), layout,
                                     [], rank, settings))
    assert slow[0].compressor.groups and slow[0].compressor.dense_indices
    inner = max(max(shape) for _, shape in MATRICES)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        shapes = [shape for _, shape in MATRICES]
        for s, f in zip(slow, flat):
            g = torch.randn(s.bucket.grad_data.shape, generator=gen)
            s.bucket.grad_data.copy_(g)
            f.bucket.grad_data.copy_(transpose_matrices(g, shapes))
        run_in_lockstep([p.strategy(dense=False) for p in slow])
        run_in_lockstep([p.strategy(dense=False) for p in flat])
        tol = slow_hop_rounding_bound(factor_dtype, step, inner)
        back = [(m, n) for n, m in shapes]
        for s, f in zip(slow, flat):
            assert_within_rounding(s.bucket.grad_data,
                                   transpose_matrices(f.bucket.grad_data, back), tol,
                                   f"gradients, step {step}")
            flat_groups = {tuple(g.seed_names): g for g in f.compressor.groups.values()}
            assert len(flat_groups) == len(s.compressor.groups)
            for gs in s.compressor.groups.values():
                gf = flat_groups[tuple(gs.seed_names)]
                assert_within_rounding(gs.residual, gf.residual.transpose(1, 2), tol,
                                       f"residual, step {step}")
                assert_within_rounding(gs.q, gf.q, tol, f"warm start, step {step}")
        # the replicas of one strategy: the same code on the same sums, bit for bit
        for plans in (slow, flat):
            assert all(torch.equal(p.bucket.grad_data, plans[0].bucket.grad_data)
                       for p in plans)


# ---------------------------------------------------------------------- force_all_reduce

def chunk_with_megatron_sync(calls: list):
    """:func:`test_host_sync.fake_ddp_chunk` with one bucket, no overlap, and megatron-core's
    own start/finish: they record the ``force_all_reduce`` they were called with and
    all-reduce the bucket dense."""
    chunk = fake_ddp_chunk(n_buckets=1)
    group = chunk.bucket_groups[0]
    group.ddp_config.overlap_grad_reduce = False
    bucket = group.buckets[0]

    def start(force_all_reduce=False):
        calls.append(("start", force_all_reduce))
        bucket.grad_data *= bucket.gradient_scaling_factor
        dist.all_reduce(bucket.grad_data, group=dist.group.WORLD)

    def finish(force_all_reduce=False):
        calls.append(("finish", force_all_reduce))
        group.start_grad_sync(force_all_reduce=force_all_reduce)   # megatron-core's form

    group.start_grad_sync, group.finish_grad_sync = start, finish
    return chunk


def test_force_all_reduce_runs_megatrons_dense_sync_with_the_whole_error(one_process_group):
    """``force_all_reduce`` (core_v0.19's ``training.py`` sets it to save weight gradients)
    asks for a dense all-reduce of the whole bucket: megatron-core's own sync runs, with
    every residual added into the gradients first (nothing is lost; in the units of the
    gradients megatron-core then scales) and zeroed once the step is applied; the bytes are the dense ones; the next
    step compresses again from the kept warm start."""
    calls = []
    chunk = chunk_with_megatron_sync(calls)
    chunk.bucket_groups[0].buckets[0].gradient_scaling_factor = 0.25   # 1/DP of 4
    comp = ddp.DPGradientCompression([chunk], one_process_group, rank=4,
                                     compress_single_replica=True, min_compression_rate=2.0,
                                     start_iter=0, seed=0)
    group, bucket = chunk.bucket_groups[0], chunk.bucket_groups[0].buckets[0]
    gen = torch.Generator().manual_seed(1)
    comp.set_iteration(0)
    comp.prepare_iteration()
    bucket.grad_data.copy_(torch.randn(bucket.grad_data.shape, generator=gen))
    group.finish_grad_sync()
    assert calls == []                                   # compressed: megatron's not called
    plan = comp.plans["chunk0.group0.bucket0"]
    groups = list(plan.compressor.groups.values())
    residuals, qs = [g.residual.clone() for g in groups], [g.q.clone() for g in groups]
    assert all(r.abs().sum() > 0 for r in residuals)
    comp.after_step(applied=True)   # the optimizer's outcome (the runtime reports it)

    comp.set_iteration(1)
    fresh = torch.randn(bucket.grad_data.shape, generator=gen)
    bucket.grad_data.copy_(fresh)
    group.finish_grad_sync(force_all_reduce=True)
    assert calls == [("finish", True), ("start", True)]
    expected = fresh * 0.25
    views = plan.grads(expected)
    for g, residual in zip(groups, residuals):
        for j, i in enumerate(g.indices):
            views[i] += residual[j]
    assert torch.equal(bucket.grad_data, expected)       # G/4 + E, summed dense
    # kept until the optimizer applies the step (a skip keeps them), then zeroed
    assert all(torch.equal(g.residual, r) for g, r in zip(groups, residuals))
    comp.after_step(applied=True)
    assert all(g.residual.abs().sum() == 0 for g in groups)
    assert all(torch.equal(g.q, q) for g, q in zip(groups, qs))
    # megatron-core's own bytes (none over a group of one), counted as dense
    assert comp.stats.bytes_sent == comp.stats.bytes_dense == megatron_sync_bytes(group)[0]

    comp.set_iteration(2)
    bucket.grad_data.copy_(torch.randn(bucket.grad_data.shape, generator=gen))
    group.finish_grad_sync()
    assert len(calls) == 2 and comp.stats.bytes_sent < comp.stats.bytes_dense
