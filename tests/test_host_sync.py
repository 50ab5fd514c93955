"""No host sync in a compressed step, and DP-sync times from the device (issue 26).

The counter (``tests/host_sync.py``) sees, on the CPU, every call that would make the host
wait for a GPU. A compressed step makes none: of one bucket (fp32 and bf16 factors, with
and without the spectrum, finite and not), of the pipeline message path, of the patched
DP sync in one process, and of a real 4-process megatron-core job with
``overlap_grad_reduce``. The DP sync's times are CUDA events, read where the runtime
reads its telemetry; here a fake event clock stands in for the GPU. Over whole trainer
iterations (issue 43) megatron_edgc's code makes none between two log intervals, except
where the EDGC controller reads the job's figures.
"""

import collections
import math
import types

import pytest
import torch
import torch.distributed as dist

from distributed import LAYOUTS, read_jsonl, run_job
from host_sync import HostSyncCounter
from megatron_edgc.compression.activation import ActivationGradSender
from megatron_edgc.compression.powersgd import BucketCompressor
from megatron_edgc.patches import ddp
from megatron_edgc.patches.dense_fallback import FALLBACK_AFTER_FAILURES, DenseFallback
from megatron_edgc.patches.p2p import CompressingP2PCommunicator, PPSendStats
from megatron_edgc.patches.timing import IntervalClock

# ---------------------------------------------------------------------- the counter

_X = torch.randn(4)

#: One host sync each (on a GPU), and the counter's name for it.
SYNCS = {
    "item": (lambda: _X[0].item(), "item"),
    "bool": (lambda: bool(_X[0] > 0), "__bool__"),
    "if": (lambda: 1 if _X[0] > 0 else 0, "__bool__"),
    "tolist": (lambda: _X.tolist(), "tolist"),
    "cpu": (lambda: _X.cpu(), "cpu"),
    "float": (lambda: float(_X[0]), "__float__"),
    "int": (lambda: int(_X[0]), "__int__"),
    "index": (lambda: [0, 1][_X.long()[0].clamp(0, 1)], "__index__"),
    "numpy": (lambda: _X.numpy(), "numpy"),
    "format": (lambda: f"{_X[0]:.3f}", "__format__"),
    "nonzero": (lambda: _X.nonzero(), "nonzero"),
    "bool mask": (lambda: _X[_X > 0], "__getitem__"),
    "where(cond)": (lambda: torch.where(_X > 0), "where"),
    "host data to a device": (lambda: torch.tensor([1.0], device=_X.device), "tensor"),
    "synchronize": (lambda: torch.cuda.synchronize(), "torch.cuda.synchronize"),
}

#: Device-side idioms the compressed step uses instead: no sync.
NO_SYNCS = {
    "flag into a buffer": lambda: _X.clone().__setitem__(-1, (_X > 0).any()),
    "select": lambda: torch.where(_X > 0, _X, 0.0),
    "masked fill": lambda: _X.masked_fill(_X[:1] > 0, float("nan")),
    "filled on the device": lambda: torch.full((1,), 3.0, device=_X.device),
    "host data on the host": lambda: torch.tensor([1.0]),
    "same-device copy": lambda: _X.to(_X.device),
}


@pytest.mark.parametrize("case", SYNCS)
def test_the_counter_sees_each_kind_of_host_sync(case, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    fn, name = SYNCS[case]
    with HostSyncCounter() as syncs:
        fn()
    assert [call.split(".")[-1] if call != "torch.cuda.synchronize" else call
            for call, _ in syncs.calls] == [name]
    assert syncs.calls[0][1].startswith("tests/test_host_sync.py:")


@pytest.mark.parametrize("case", NO_SYNCS)
def test_the_counter_passes_device_side_idioms(case):
    with HostSyncCounter() as syncs:
        NO_SYNCS[case]()
    assert syncs.calls == []


# ---------------------------------------------------------------------- one bucket

ENTRIES = [("w1", (64, 48)), ("w2", (64, 48)), ("w3", (48, 96)), ("b", (1, 48))]


def one_step(comp, grads):
    bufs, step = comp.start(grads)
    comp.finish(step, comp.middle(step, [b.clone() for b in bufs]))


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spectrum", [False, True])
@pytest.mark.parametrize("finite", [True, False])
def test_a_compressed_bucket_step_makes_no_host_sync(factor_dtype, spectrum, finite):
    comp = BucketCompressor(ENTRIES, 4, seed=0, factor_dtype=factor_dtype)
    comp.track_spectrum = spectrum
    gen = torch.Generator().manual_seed(0)
    one_step(comp, [torch.randn(*s, generator=gen) for _, s in ENTRIES])   # Q and E exist
    grads = [torch.randn(*s, generator=gen) for _, s in ENTRIES]
    if not finite:
        grads[0][1, 2] = float("inf")
    with HostSyncCounter() as syncs:
        one_step(comp, grads)
    assert syncs.calls == []
    assert torch.isfinite(grads[0]).all() == finite


def test_a_rank_change_mid_run_makes_no_host_sync_in_the_step():
    """Ranks that change mid-run (EDGC's windows, DAC, the budget controller: 4, 6, 8, 6):
    the step at each new rank makes no host sync; the warm start's new columns are seeded
    before it (``prepare``), the orthonormalization's fixed basis is built on the device
    (``test_orthonormal.py``), one per row count whatever the ranks."""
    from megatron_edgc.compression import orthonormal

    comp = BucketCompressor(ENTRIES, 4, seed=0)
    gen = torch.Generator().manual_seed(0)
    one_step(comp, [torch.randn(*s, generator=gen) for _, s in ENTRIES])
    orthonormal._BASES.clear()
    for rank in (6, 8, 6):
        comp.set_rank(rank)
        comp.prepare()
        grads = [torch.randn(*s, generator=gen) for _, s in ENTRIES]
        with HostSyncCounter() as syncs:
            one_step(comp, grads)
        assert syncs.calls == [], rank
    assert sorted(k[0] for k in orthonormal._BASES) == [48, 64]   # P's rows, per shape


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("finite", [True, False])
def test_a_step_under_a_changed_loss_scale_and_its_skip_make_no_host_sync(grad_dtype,
                                                                          finite):
    """fp16's loss scale: the residual read in the new scale's units (a device ratio), the
    units committed, the skipped step's sent part taken back, and a dense sync's residual
    kept through a skip and zeroed when applied: no host read of the scale or a flag."""
    comp = BucketCompressor(ENTRIES, 4, seed=0)
    comp.loss_scale = torch.tensor([1024.0])
    gen = torch.Generator().manual_seed(0)

    def grads():
        return [(torch.randn(*s, generator=gen) * 64).to(grad_dtype) for _, s in ENTRIES]

    one_step(comp, grads())
    comp.after_step(applied=True)
    comp.loss_scale = torch.tensor([512.0])
    g = grads()
    if not finite:
        g[0][1, 2] = float("inf")
    with HostSyncCounter() as syncs:
        one_step(comp, g)
        comp.after_step(applied=False)
        comp.absorb_residual(grads())
        comp.after_step(applied=False)
        comp.absorb_residual(grads())
        comp.after_step(applied=True)
    assert syncs.calls == []
    assert comp.state.clear


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spectrum", [False, True])
@pytest.mark.parametrize("finite", [True, False])
def test_a_slow_hop_step_makes_no_host_sync(factor_dtype, spectrum, finite):
    """The slow hop's step (``ShardCompressor``: P rows spread, the instance's Q slices,
    every phase of 2 instances × 2 ranks, the collectives done by sums in one process)."""
    from test_shard_powersgd import SlowHopCluster, random_grads

    cluster = SlowHopCluster(2, 2, rank=3, factor_dtype=factor_dtype)
    for comp in cluster.comps.values():
        comp.track_spectrum = spectrum
    cluster.step(random_grads(2, 2, cluster.total, seed=0))   # Q, E and the indices exist
    grads = random_grads(2, 2, cluster.total, seed=1)
    if not finite:
        grads[0][1][3] = float("inf")
    with HostSyncCounter() as syncs:
        shards = cluster.step(grads)
    assert syncs.calls == []
    assert all(torch.isfinite(v).all() == finite for v in shards.values())


def test_pipeline_send_and_receive_make_no_host_sync():
    shape = (32, 2, 48)
    sender = CompressingP2PCommunicator.__new__(CompressingP2PCommunicator)
    sender.pp_size, sender.stage, sender.seed, sender.num_chunks = 2, 1, 0, 1
    sender._send_chunk, sender.senders, sender.rank, sender.table_version = None, {}, 4, 0
    sender._headers, sender.stats = {}, PPSendStats(stage=1)
    receiver = CompressingP2PCommunicator.__new__(CompressingP2PCommunicator)
    receiver.pp_size, receiver.stage, receiver.table_version = 2, 0, 0
    receiver._headers, receiver._received = {}, []
    out = torch.empty(shape)
    receiver._unpack_into(sender._pack(torch.randn(shape), k=0), out, k=0, r=4)  # caches
    bad = torch.randn(shape)
    bad[0, 0, 0] = float("nan")
    with HostSyncCounter() as syncs:
        for k, grad in enumerate([torch.randn(shape), bad, torch.randn(shape)], start=1):
            receiver._unpack_into(sender._pack(grad, k), out, k, r=4)
        ActivationGradSender(4).compress(torch.randn(shape))  # a fresh sender too
    assert syncs.calls == []
    receiver.check_messages()                                 # the once-per-step reads
    sender.stats.resolve()
    assert len(sender.stats.events) == 1


# ---------------------------------------------------------------------- the patched DP sync

#: A bucket group's parameters: two compressed shapes and a dense bias.
SHAPES = {"w1": (64, 48), "w2": (64, 48), "w3": (48, 96), "b": (48,)}


def fake_ddp_chunk(n_buckets: int = 2):
    """A DDP chunk as the patch sees it: one bucket group of ``n_buckets`` buckets, each
    holding every parameter of :data:`SHAPES` as views of its flat ``grad_data``, reduced
    over the (one-process) default group."""
    module = torch.nn.Module()
    buckets = []
    for b in range(n_buckets):
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES.values()]
        for name, p in zip(SHAPES, params):
            module.register_parameter(f"{name}_{b}", p)
        grad_data = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            p.main_grad = grad_data[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
        buckets.append(types.SimpleNamespace(grad_data=grad_data, params_list=params,
                                             gradient_scaling_factor=1.0))
    group = types.SimpleNamespace(
        buckets=buckets, grad_reduce_handle=None, param_gather_dispatched=False,
        ddp_config=types.SimpleNamespace(overlap_grad_reduce=True, average_in_collective=False,
                                         use_distributed_optimizer=False),
        data_parallel_group=dist.group.WORLD,
        start_grad_sync=lambda *a, **k: None, finish_grad_sync=lambda *a, **k: None)
    return types.SimpleNamespace(module=module, bucket_groups=[group],
                                 expert_parallel_bucket_groups=[])


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def compression_of(chunk, group, **settings):
    """The DP compression of ``chunk`` at rank 4 from iteration 0, compressing its single
    replica (the one-process group)."""
    return ddp.DPGradientCompression([chunk], group, rank=4, compress_single_replica=True,
                                     min_compression_rate=2.0, start_iter=0, seed=0,
                                     **settings)


def compressed_dp_step(compression, chunk, gen, nan_in=None, applied=True):
    """Fill the gradients, then start and finish the group's sync as megatron-core would
    (start inside backward under overlap_grad_reduce, finish at the end); ``applied``: the
    optimizer's outcome, reported as the runtime does (None: left to the caller)."""
    group = chunk.bucket_groups[0]
    for b, bucket in enumerate(group.buckets):
        bucket.grad_data.copy_(torch.randn(bucket.grad_data.shape, generator=gen))
        if b == nan_in:
            bucket.grad_data[7] = float("nan")
    group.start_grad_sync()
    group.finish_grad_sync()
    if applied is not None:
        compression.after_step(applied)



def test_factors_that_fail_from_finite_gradients_keep_the_state_go_dense_and_come_back(
        one_process_group):
    """Issue 50: an orthonormal basis that came out NaN from a finite P (the H200's r 64
    steps) left the warm start and the residual NaN for good, and the next steps' P
    with them. Now the step is left non-finite (the optimizer's guard skips it) with the
    compressor's state kept bit for bit, counted as a factor failure without a host
    sync; after FALLBACK_AFTER_FAILURES such steps the bucket is sent dense (its whole
    error with it), named once, for ``fallback_iters`` iterations; then compressed again
    (issue 56), and when its factors fail again the interval doubles; as many iterations
    compressed without a failure reset it. The state is checkpointed."""
    chunk = fake_ddp_chunk()
    compression = compression_of(chunk, one_process_group)
    compression.fallback.iters = 3
    gen = torch.Generator().manual_seed(2)
    key = "chunk0.group0.bucket1"
    comp = compression.compressors[key]
    failing = lambda p, **kw: torch.full_like(p, float("nan"))       # noqa: E731

    def step_at(it, fail=False):
        compression.set_iteration(it)
        compression.prepare_iteration()
        if fail:
            comp.orthonormalize = failing
        with HostSyncCounter() as syncs:
            compressed_dp_step(compression, chunk, gen, applied=None)
        if fail:
            del comp.orthonormalize
        assert syncs.calls == []
        step = compression.stats.take()
        step.resolve()
        # the optimizer's outcome, as the runtime reports it: a non-finite step is skipped
        compression.after_step(applied=not step.nonfinite_buckets)
        compression.observe_failures([step], it + 1)
        return step

    step_at(0)                                                       # Q and E exist
    for it in (1, 2):
        state = [(g.residual.clone(), g.q.clone()) for g in comp.groups.values()]
        assert key not in compression.dense_keys or it > 1
        step = step_at(it, fail=True)
        for (residual, q), g in zip(state, comp.groups.values()):
            assert torch.equal(g.residual, residual) and torch.equal(g.q, q)
        bucket = chunk.bucket_groups[0].buckets[1]
        assert torch.isnan(bucket.params_list[0].main_grad).all()
        assert torch.isfinite(chunk.bucket_groups[0].buckets[0].grad_data).all()
        assert step.factor_failures == [key] and step.nonfinite_buckets == 1
        assert step.events[0] == (f"non-finite factors from finite gradients in {key}: "
                                  f"gradients left non-finite, error feedback untouched")
        if it == 1:
            assert compression.fallback.fallbacks == {}
            quiet = compression.stats.take()      # a read free of failures:
            quiet.compressed = True               # the count starts again
            compression.observe_failures([quiet], it + 1)
            assert compression.fallback.failures == {}
            compression.observe_failures([step], it + 1)
    assert compression.fallback.fallbacks == {key: DenseFallback(6, 3)}
    assert step.events[-1] == (
        f"{key}: compression's factors failed from finite gradients "
        f"{FALLBACK_AFTER_FAILURES} times by iteration 3: sent dense (an all-reduce of "
        f"the bucket, as megatron-core's) for iterations 4-6, then compressed again")
    assert compression.state_dict()["fallbacks"] == {key: [6, 3]}
    residual_sum = sum(float(g.residual.double().sum()) for g in comp.groups.values())
    for it in (3, 4, 5):            # dense, its error with it; the factors are not formed
        step = step_at(it, fail=True)
        assert compression.dense_keys == {key} and step.fallback_buckets == 1
        assert step.factor_failures == [] and step.buckets == 2
        assert torch.isfinite(chunk.bucket_groups[0].buckets[1].grad_data).all()
        assert all(float(g.residual.abs().sum()) == 0 for g in comp.groups.values())
    assert residual_sum != 0
    step = step_at(6)                                   # compressed again, named
    assert compression.dense_keys == frozenset() and step.fallback_buckets == 0
    assert step.events == [f"{key}: compressed again from iteration 7, after 3 iterations "
                           f"sent dense (its factors had failed)"]
    # ... restored from a checkpoint taken while it was dense, the same turn
    restored = compression_of(fake_ddp_chunk(), one_process_group)
    restored.load_state_dict(compression.state_dict())
    assert restored.fallback.fallbacks == compression.fallback.fallbacks
    step_at(7, fail=True)
    step_at(8, fail=True)                               # failing again: twice as long
    assert compression.fallback.fallbacks == {key: DenseFallback(9 + 6, 6)}
    for it in range(9, 15):
        step_at(it)
        assert key in compression.dense_keys
    for it in range(15, 20):                            # compressed, clean
        step_at(it)
        assert key not in compression.dense_keys and key in compression.fallback.fallbacks
    step_at(20)             # an interval (6) compressed without a failure: reset
    assert compression.fallback.fallbacks == {}
    # a checkpoint of before issue 56 (dense for good): tried again at once
    old = compression.state_dict()
    del old["fallbacks"]
    old["fallen_back"] = [key]
    restored.load_state_dict(old)
    assert restored.fallback.fallbacks == {key: DenseFallback(0, 20)}   # its fallback_iters


def test_a_failed_factorization_loses_no_step(one_process_group, monkeypatch):
    """cuSOLVER's Cholesky failing (NaN factors, emulated) on finite gradients: a fixed
    orthonormal basis stands in for the failed matrices, so the step's gradients are
    finite and the error feedback keeps what that basis missed (conserved: E + Ĝ = G +
    E_before); the failure is counted without a host sync."""
    from test_powersgd import cusolver_failing_everywhere

    chunk = fake_ddp_chunk(n_buckets=1)
    compression = compression_of(chunk, one_process_group)
    gen = torch.Generator().manual_seed(3)
    key = "chunk0.group0.bucket0"
    compression.set_iteration(0)
    compressed_dp_step(compression, chunk, gen)                      # Q and E exist
    comp, bucket = compression.compressors[key], chunk.bucket_groups[0].buckets[0]
    before = [g.residual.clone() for g in comp.groups.values()]
    compression.set_iteration(1)
    state = gen.get_state()   # the gradients compressed_dp_step is about to draw
    grads = torch.randn(bucket.grad_data.shape, generator=gen)
    gen.set_state(state)
    cusolver_failing_everywhere(monkeypatch)
    with HostSyncCounter() as syncs:
        compressed_dp_step(compression, chunk, gen)
    monkeypatch.undo()
    assert syncs.calls == []
    assert torch.isfinite(bucket.grad_data).all()
    for g, residual in zip(comp.groups.values(), before):
        rows = [_matrix(grads, g, i) + residual[j] for j, i in enumerate(g.indices)]
        got = [_matrix(bucket.grad_data, g, i) for i in g.indices]
        for j, (m, out) in enumerate(zip(rows, got)):
            assert torch.allclose(out + g.residual[j], m, atol=1e-5)   # nothing lost
    step = compression.stats.take()
    step.resolve()
    assert step.factor_failures == [key] and step.nonfinite_buckets == 0
    stood_in = sum(len(g.indices) for g in comp.groups.values())   # every matrix's
    assert step.factors_stood_in == stood_in
    assert step.events == [f"failed factorization from finite gradients in {key}: a fixed "
                           f"basis stood in for {stood_in} matrices, the error feedback "
                           f"keeps what it missed"]


def _matrix(flat, g, i):
    """Entry ``i`` (of shape group ``g``) in a bucket's flat buffer laid out as
    fake_ddp_chunk's: the parameters of SHAPES in order."""
    sizes = [torch.Size(shape).numel() for shape in SHAPES.values()]
    start = sum(sizes[:i])
    return flat[start:start + g.n * g.m].view(g.n, g.m)


def test_the_patched_dp_sync_makes_no_host_sync(one_process_group):
    chunk = fake_ddp_chunk()
    compression = compression_of(chunk, one_process_group)
    gen = torch.Generator().manual_seed(1)
    compression.set_iteration(0)
    compressed_dp_step(compression, chunk, gen)                      # Q and E exist
    residuals = {k: [g.residual.clone() for g in c.groups.values()]
                 for k, c in compression.compressors.items()}
    compression.set_iteration(1)
    with HostSyncCounter() as syncs:
        compressed_dp_step(compression, chunk, gen, nan_in=1)
    assert syncs.calls == []
    # Resolved once per step: bucket 1's NaN is counted, its EF kept, its gradient NaN.
    assert compression.stats.nonfinite_buckets == 0 and compression.stats.events == []
    compression.stats.resolve()
    key = "chunk0.group0.bucket1"
    assert compression.stats.nonfinite_buckets == 1
    assert compression.stats.events == [f"non-finite gradient in {key}: left non-finite, "
                                        f"error feedback untouched"]
    assert compression.stats.factor_failures == []
    for before, g in zip(residuals[key], compression.compressors[key].groups.values()):
        assert torch.equal(g.residual, before)
    bad, good = chunk.bucket_groups[0].buckets[1], chunk.bucket_groups[0].buckets[0]
    assert torch.isnan(bad.params_list[0].main_grad).all()
    assert torch.isfinite(good.grad_data).all()
    assert compression.stats.compress_s > 0 and compression.stats.comm_s > 0


class FakeDeviceClock:
    """Stands in for a GPU's timeline: ``now_ms`` advances only where the test says the
    device works; :class:`FakeEvent` records it, as ``torch.cuda.Event`` would."""

    def __init__(self):
        self.now_ms = 0.0
        self.synchronized = 0  # device synchronizes
        self.read = 0          # event times read (allowed only after a synchronize)

    def event_class(self):
        clock = self

        class FakeEvent:
            def __init__(self, enable_timing=False, **kwargs):
                assert enable_timing
                self.at_ms = None

            def record(self, stream=None):
                self.at_ms = clock.now_ms

            def elapsed_time(self, end):
                assert clock.synchronized, "event time read before the step's synchronize"
                clock.read += 1
                return end.at_ms - self.at_ms

            def synchronize(self):
                clock.synchronized += 1

        return FakeEvent

    def synchronize(self, *args, **kwargs):
        self.synchronized += 1


#: Device milliseconds the fake GPU spends in each part of a bucket's sync.
DEVICE_MS = {"start": 1.0, "middle": 2.0, "finish": 4.0, "collective": 10.0}


def test_dp_sync_times_are_cuda_events_resolved_once_per_step(one_process_group,
                                                              monkeypatch):
    """With CUDA events the DP sync's times are the device's: compression math between the
    events around start/middle/finish, communication between the events around each
    collective's wait (on the stream that sees it complete) — read once, in resolve()."""
    device = FakeDeviceClock()
    monkeypatch.setattr(torch.cuda, "Event", device.event_class())
    monkeypatch.setattr(torch.cuda, "synchronize", device.synchronize)
    for name in ("start", "middle", "finish"):
        original = getattr(BucketCompressor, name)

        def timed(self, *args, _original=original, _ms=DEVICE_MS[name], **kwargs):
            out = _original(self, *args, **kwargs)
            device.now_ms += _ms
            return out

        monkeypatch.setattr(BucketCompressor, name, timed)
    all_reduce = dist.all_reduce

    class SlowWork:
        def __init__(self, work):
            self.work = work

        def wait(self):
            self.work.wait()
            device.now_ms += DEVICE_MS["collective"]

    def slow_all_reduce(*args, async_op=False, **kwargs):
        work = all_reduce(*args, async_op=True, **kwargs)
        if async_op:
            return SlowWork(work)
        SlowWork(work).wait()

    monkeypatch.setattr(dist, "all_reduce", slow_all_reduce)

    chunk = fake_ddp_chunk(n_buckets=2)
    compression = compression_of(chunk, one_process_group)
    compression.stats.clock = IntervalClock(use_cuda=True)  # as on a GPU
    gen = torch.Generator().manual_seed(2)
    compression.set_iteration(0)
    with HostSyncCounter() as syncs:
        compressed_dp_step(compression, chunk, gen)
    assert syncs.calls == [] and device.synchronized == 0 and device.read == 0
    stats = compression.stats
    assert stats.compress_s == 0.0 and stats.comm_s == 0.0  # nothing read yet
    stats.resolve()
    assert device.synchronized == 1
    # Per bucket: start + middle + finish of math; one [P | dense | flag] and one Q
    # all-reduce waited on.
    per_bucket_ms = DEVICE_MS["start"] + DEVICE_MS["middle"] + DEVICE_MS["finish"]
    assert stats.compress_s * 1e3 == pytest.approx(2 * per_bucket_ms)
    assert stats.comm_s * 1e3 == pytest.approx(2 * 2 * DEVICE_MS["collective"])
    reads = device.read
    stats.resolve()                                       # a second call adds nothing
    assert device.read == reads and stats.compress_s * 1e3 == pytest.approx(14.0)


# ---------------------------------------------------------------------- a real job


def test_a_real_compressed_dp_and_pp_step_makes_no_host_sync(small_model_argv, tmp_path):
    """4 gloo processes, megatron-core DDP with overlap_grad_reduce, DP and PP compression
    from iteration 1: the patched bucket-group syncs and the compressed pipeline messages
    of every compressed iteration make no host sync on any rank."""
    metrics = str(tmp_path / "m.jsonl")
    results = run_job(["--count-host-syncs"] + small_model_argv + LAYOUTS["tp1-pp2-dp2-overlap"]
                      + ["--edgc-mode", "static", "--edgc-rank", "4", "--edgc-start-iter", "1",
                         "--edgc-pp-compression", "static", "--edgc-pp-rank", "4",
                         "--train-iters", "3", "--metrics-file", metrics],
                      str(tmp_path / "out"))
    records = read_jsonl(metrics)
    assert [r["dp_bytes_sent"] < r["dp_bytes_dense"] for r in records] == [False, True, True]
    assert all(math.isfinite(r["loss"]) for r in records)
    syncs = collections.Counter((r["pp"], r["dp"], site, call, where) for r in results
                                for it, site, call, where in r["host_syncs"] if it >= 1)
    assert not syncs, "(pp, dp, site, call, where) over 2 iterations:\n" + "\n".join(
        f"{n} x {key}" for key, n in sorted(syncs.items()))


# ---------------------------------------------------------------------- the trainer


def run_counted_job(argv, out_dir, timeout=300) -> list:
    """A trainer job under ``tests/host_sync.py``'s counter; every rank's syncs."""
    import json
    import os
    import sys

    import warm

    here = os.path.dirname(os.path.abspath(__file__))
    proc = warm.run([sys.executable, os.path.join(here, "host_sync.py"), out_dir, *argv],
                    timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ranks = sorted(f for f in os.listdir(out_dir) if f.startswith("syncs_rank"))
    assert len(ranks) == 4, ranks
    out = []
    for name in ranks:
        with open(os.path.join(out_dir, name)) as fh:
            out.append(json.load(fh))
    return out


def test_the_trainer_makes_no_host_sync_between_log_intervals(small_model_argv, tmp_path):
    """4 gloo processes (PP2 x DP2, overlap_grad_reduce), DP and PP compression from
    iteration 2, 7 iterations at --log-interval 3: over whole iterations (step, records,
    evaluation, logging), megatron_edgc's code makes no host sync (and waits for no device
    clock) on any rank except in iterations 3, 6 and 7 (the log intervals and the last),
    where it reads every record since the last one; those reads are there on every rank.
    megatron-core's own syncs (its grad-norm clipping reads the norm) are not ours."""
    metrics = str(tmp_path / "m.jsonl")
    results = run_counted_job(
        small_model_argv + LAYOUTS["tp1-pp2-dp2-overlap"]
        + ["--edgc-mode", "static", "--edgc-rank", "4", "--edgc-start-iter", "1",
           "--edgc-pp-compression", "static", "--edgc-pp-rank", "4", "--train-iters", "7",
           "--log-interval", "3", "--eval-interval", "6", "--metrics-file", metrics],
        str(tmp_path / "out"))
    records = read_jsonl(metrics)
    assert [r["iteration"] for r in records] == list(range(1, 8))
    assert [r["dp_bytes_sent"] < r["dp_bytes_dense"] for r in records] == [False] + [True] * 6
    assert all(math.isfinite(r["loss"]) and r["iter_ms"] > 0 for r in records)
    ours = collections.Counter((r["rank"], s["tag"], s["call"], s["where"]) for r in results
                               for s in r["syncs"] if s["maker"] == "megatron_edgc")
    between = {key: n for key, n in ours.items() if key[1] not in (0, 3, 6, 7)}
    assert not between, "(rank, iteration, call, where) between log intervals:\n" + "\n".join(
        f"{n} x {key}" for key, n in sorted(between.items()))
    for rank in range(4):   # the reads at the log intervals (the counter sees them)
        assert {tag for r, tag, call, _ in ours if r == rank and call == "IntervalClock.wait"} \
            == {3, 6, 7}, rank


def test_in_edgc_mode_only_the_controllers_reads_add_host_syncs(small_model_argv, tmp_path):
    """EDGC mode with DAC and the PP controller (window 4, entropy on every 4th iteration),
    12 iterations at --log-interval 5: besides the log intervals (5, 10, 12), the host
    reads the device only where the controller reads the job's figures: the measured
    iterations (1, 5, 9: the entropies) and the window ends (4, 8, 12: DAC's fits decide,
    the table is broadcast). Iterations 2, 3, 6, 7 and 11 make none of ours."""
    results = run_counted_job(
        small_model_argv + LAYOUTS["tp1-pp2-dp2"]
        + ["--edgc-mode", "edgc", "--edgc-window", "4", "--edgc-warmup-max-iters", "4",
           "--edgc-rank-max", "8", "--edgc-rank-min", "2", "--edgc-rank-step", "2",
           "--edgc-iter-sample-rate", "0.25", "--edgc-pp-compression", "edgc",
           "--edgc-pp-rank-max", "16", "--edgc-dac", "on", "--train-iters", "12",
           "--log-interval", "5", "--eval-interval", "10"],
        str(tmp_path / "out"))
    tags = {s["tag"] for r in results for s in r["syncs"] if s["maker"] == "megatron_edgc"}
    assert tags - {0} == {1, 4, 5, 8, 9, 10, 12}
