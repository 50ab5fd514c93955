"""The compression math and the device clock on an accelerator.

The device comes from ``EDGC_TEST_DEVICE`` (``scripts/gpu_check.py`` sets it: ``cuda`` on a
GPU machine, ``cpu`` in its dry run); unset, these tests run on CUDA when there is one and
are skipped otherwise. The numbers asserted are the CPU suite's (``test_powersgd.py``):
error against the SVD optimum, replicas bit-identical, error feedback conserving the sum,
full rank equal to the dense all-reduce; plus agreement with the same step on the CPU.
"""

import os
import time

import pytest
import torch

from megatron_edgc.compression.activation import ActivationGradSender, decompress
from megatron_edgc.compression.powersgd import BucketCompressor
from megatron_edgc.patches.timing import IntervalClock

DEVICE = os.environ.get("EDGC_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = pytest.mark.skipif(
    DEVICE is None or (DEVICE.startswith("cuda") and not torch.cuda.is_available()),
    reason="no CUDA device (set EDGC_TEST_DEVICE=cpu to run these on the CPU)")
FACTORS = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def exact_fp32_matmul():
    """TF32 would make fp32 products ~1e-3 relative: the trainer's math is plain fp32."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def simulated_step(compressors, grads_per_rank, applied=True):
    """One compressed all-reduce over simulated DP ranks (the collectives are sums)."""
    firsts = [c.start(g) for c, g in zip(compressors, grads_per_rank)]
    reduced = [sum(parts) for parts in zip(*(bufs for bufs, _ in firsts))]
    qs = [c.middle(step, [b.clone() for b in reduced]) for c, (_, step) in zip(compressors, firsts)]
    reduced_q = [sum(parts) for parts in zip(*qs)]
    for c, (_, step) in zip(compressors, firsts):
        c.finish(step, [b.clone() for b in reduced_q])
        if applied is not None:   # the optimizer's outcome (None: left unreported)
            c.after_step(applied)


def decaying_spectrum(n, m, decay, seed, device):
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n, n, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(m, m, generator=gen))
    k = min(n, m)
    s = torch.tensor([decay ** i for i in range(k)])
    return ((u[:, :k] * s) @ v[:, :k].T).to(device)


@pytest.mark.parametrize("factor", list(FACTORS))
def test_error_near_svd_optimum_on_device(factor):
    n, m, r = 256, 512, 8
    target = decaying_spectrum(n, m, 0.8, seed=1, device=DEVICE)
    svd_err = torch.linalg.svdvals(target.cpu())[r:].pow(2).sum().sqrt().item()
    comp = BucketCompressor([("w", (n, m))], r, seed=3, device=DEVICE,
                            factor_dtype=FACTORS[factor])
    for _ in range(6):
        g = target.clone()
        simulated_step([comp], [[g]])
        comp.groups[(n, m)].residual.zero_()
    assert g.device.type == torch.device(DEVICE).type
    assert comp.groups[(n, m)].q.device.type == torch.device(DEVICE).type
    err = torch.linalg.norm(target - g).item()
    # bf16 factors round Q on the wire (8 bits of mantissa): within 15 % instead of 10 %
    assert err <= (1.10 if factor == "fp32" else 1.15) * svd_err, (err, svd_err)


@pytest.mark.parametrize("factor", list(FACTORS))
def test_replicas_identical_and_error_feedback_conserves_the_sum(factor):
    n, m, r, world = 64, 128, 4, 4
    entries = [("w1", (n, m)), ("w2", (n, m)), ("w3", (128, 64)), ("b", (1, 64))]
    comps = [BucketCompressor(entries, r, seed=1, device=DEVICE, factor_dtype=FACTORS[factor])
             for _ in range(world)]
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randn(*s, generator=gen).to(DEVICE) for _, s in entries]
             for _ in range(world)]
    originals = [[g.clone() for g in gs] for gs in grads]
    simulated_step(comps, grads)
    for i in range(len(entries)):
        for rk in range(1, world):
            assert torch.equal(grads[0][i], grads[rk][i])
    for key, g in comps[0].groups.items():
        for j, i in enumerate(g.indices):
            total_in = sum(originals[rk][i] for rk in range(world))
            total_res = sum(comps[rk].groups[key].residual[j] for rk in range(world))
            # bf16: each rank's residual is against the Q it sent, the SUM's rounding is lost
            tol = 1e-4 if factor == "fp32" else 5e-2
            assert torch.allclose(grads[0][i] + total_res, total_in, atol=tol)


def test_full_rank_equals_the_dense_allreduce():
    n, m, world = 48, 96, 4
    entries = [("a", (n, m)), ("b", (n, m)), ("bias", (1, n))]
    comps = [BucketCompressor(entries, n, compress_all=True, seed=7, device=DEVICE)
             for _ in range(world)]
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(*s, generator=gen).to(DEVICE) for _, s in entries]
             for _ in range(world)]
    expected = [sum(grads[r][i] for r in range(world)) for i in range(len(entries))]
    simulated_step(comps, grads)
    for i, exp in enumerate(expected):
        rel = (torch.linalg.norm(grads[0][i] - exp) / torch.linalg.norm(exp)).item()
        assert rel < 1e-5, (i, rel)


def test_device_step_matches_the_cpu_step():
    """The same inputs through the same compressor on the device and on the CPU."""
    n, m, r = 96, 160, 8
    entries = [("w1", (n, m)), ("w2", (n, m)), ("b", (1, n))]
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randn(*s, generator=gen) for _, s in entries]
    out = {}
    for dev in ("cpu", DEVICE):
        comp = BucketCompressor(entries, r, seed=2, device=dev)
        grads = [x.clone().to(dev) for x in inputs]
        for _ in range(2):
            simulated_step([comp], [grads])
        out[dev] = [g.cpu() for g in grads]
    for a, b in zip(out["cpu"], out[DEVICE]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()


def test_state_round_trips_through_the_cpu():
    """A checkpoint holds CPU tensors; loading puts them back on the device, exactly."""
    n, m, r = 64, 96, 4
    entries = [("w", (n, m))]
    comp = BucketCompressor(entries, r, seed=4, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    simulated_step([comp], [[torch.randn(n, m, generator=gen).to(DEVICE)]])
    state = comp.state_dict()
    assert state["matrices"]["w"]["residual"].device.type == "cpu"
    fresh = BucketCompressor(entries, r, seed=4, device=DEVICE)
    assert fresh.load_state_dict(state) == []
    g0, g1 = comp.groups[(n, m)], fresh.groups[(n, m)]
    assert g1.q.device.type == torch.device(DEVICE).type
    assert torch.equal(g0.q, g1.q) and torch.equal(g0.residual, g1.residual)


def test_activation_gradient_compression_on_device():
    """EDGC §7's pipeline send: rank-r approximation of [seq, batch, hidden], residual kept."""
    seq, batch, hidden, r = 32, 2, 64, 8
    sender = ActivationGradSender(r, seed=5)
    grad = torch.randn(seq, batch, hidden, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    p_hat, q = sender.compress(grad)
    assert p_hat.device.type == torch.device(DEVICE).type
    approx = decompress(p_hat, q, grad.shape, grad.dtype)
    flat = grad.reshape(-1, hidden)
    best = torch.linalg.svdvals(flat.cpu())[r:].pow(2).sum().sqrt().item()
    err = torch.linalg.norm(flat - approx.reshape(-1, hidden)).item()
    assert best <= err <= 1.6 * best, (err, best)  # one power step from a random Q



def test_pipeline_sender_resumes_on_device_from_a_host_mapped_checkpoint():
    """Issue 71: a pipeline sender's checkpoint loaded with ``map_location="cpu"`` (as both
    front-ends load) compresses on the device: the runtime's ``prepare`` moves its warm
    start and residual there, and the next messages equal those of a sender that never
    left the device; the receiver rebuilds them on the device."""
    import io

    seq, batch, hidden, r = 32, 2, 64, 8
    gen = torch.Generator().manual_seed(11)
    msgs = [torch.randn(seq, batch, hidden, generator=gen).to(DEVICE) for _ in range(4)]
    straight = ActivationGradSender(r, seed=5, name="pp-stage1-chunk0")
    resumed = ActivationGradSender(r, seed=5, name="pp-stage1-chunk0")
    for msg in msgs[:2]:
        straight.compress(msg)
        resumed.compress(msg)
    buf = io.BytesIO()
    torch.save(resumed.state_dict(), buf)
    buf.seek(0)
    resumed = ActivationGradSender(r, seed=5, name="pp-stage1-chunk0")
    resumed.load_state_dict(torch.load(buf, map_location="cpu", weights_only=False))
    assert resumed.q.device.type == "cpu"
    resumed.prepare(seq * batch, hidden, torch.device(DEVICE))
    assert resumed.q.device.type == resumed.residual.device.type == torch.device(DEVICE).type
    for msg in msgs[2:]:
        (p0, q0), (p1, q1) = straight.compress(msg), resumed.compress(msg)
        assert torch.equal(p0, p1) and torch.equal(q0, q1)
        out = decompress(p1, q1, msg.shape, msg.dtype)
        assert out.device.type == torch.device(DEVICE).type and torch.isfinite(out).all()

def test_interval_clock_times_device_work():
    """The stage timer's clock: CUDA events on a GPU; ordered stamps, work takes time."""
    clock = IntervalClock(use_cuda=torch.device(DEVICE).type == "cuda")
    x = torch.randn(1024, 1024, device=DEVICE)
    clock.start()
    a = clock.stamp()
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    b = clock.stamp()
    if clock.use_cuda:
        torch.cuda.synchronize()
    assert 0.0 <= clock.ms(a) < clock.ms(b)
    assert clock.ms(b) - clock.ms(a) > 0.01  # 20 1024^3 products: > 10 µs anywhere


def test_collective_completion_stamp_without_waiting():
    """The bypass's link timing: a collective's completion stamped without the caller's
    stream waiting for it (NCCL: an event on a side stream made to wait for the work;
    gloo on CPU: its completion callback); the stamp lies after the issue stamp and the
    collective's result is right. One process: NCCL on a GPU, gloo on CPU."""
    import torch.distributed as dist

    device = torch.device(DEVICE)
    on_gpu = device.type == "cuda"
    if on_gpu and device.index is None:  # init_process_group's device_id needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if on_gpu else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, **({"device_id": device} if on_gpu else {}))
    try:
        clock = IntervalClock(use_cuda=on_gpu)
        x = torch.ones(1 << 22, device=DEVICE)
        issued = clock.stamp()
        work = dist.all_reduce(x, async_op=True)
        done = clock.completion(work)
        work.wait()
        clock.wait()
        for _ in range(100):   # CPU: the callback may run just after wait() returns
            seconds = clock.seconds_between(issued, done)
            if seconds == seconds:
                break
            time.sleep(0.01)
        assert 0.0 <= seconds < 10.0, seconds
        assert torch.equal(x, torch.ones_like(x))
    finally:
        dist.destroy_process_group()


def test_orthonormalize_bound_and_strided_step_on_device():
    """The batched CholeskyQR on the device: the CPU suite's orthogonality bound on zero,
    rank-deficient and 1e7-conditioned P (TF32 left on by the caller: orthonormalize turns
    it off inside), and a step on strided views of one flat buffer, as Megatron's bucket,
    with no host sync (CUDA's sync debug mode raises on one)."""
    from test_powersgd import _orthogonality_cases, flat_bucket

    from megatron_edgc.compression.orthonormal import ORTHOGONALITY_BOUND, orthonormalize

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True  # the fixture restores it
    gen = torch.Generator().manual_seed(5)
    for n, r in [(129, 64), (6288, 64)]:
        for name, p in _orthogonality_cases(n, r, gen).items():
            q = orthonormalize(p.to(DEVICE))
            gram = q.transpose(1, 2).double() @ q.double()
            err = (gram - torch.eye(r, dtype=torch.float64, device=DEVICE)).abs().max().item()
            assert err <= ORTHOGONALITY_BOUND, (n, r, name, err)
    layer = [("qkv", (96, 32)), ("fc1", (128, 32)), ("fc2", (32, 128)), ("bias", (1, 32))]
    entries = [(f"l{i}.{name}", s) for i in range(6) for name, s in layer]
    comp = BucketCompressor(entries, 4, seed=0, device=DEVICE)
    buf, grads = flat_bucket(layer, layers=6)
    buf = buf.to(DEVICE)
    grads = [buf[v.storage_offset():v.storage_offset() + v.numel()].view(v.shape) for v in grads]
    buf.normal_()
    simulated_step([comp], [grads])  # the first step allocates E, Q and the fills
    buf.normal_()
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        simulated_step([comp], [grads])
    finally:
        if DEVICE.startswith("cuda"):
            torch.cuda.set_sync_debug_mode(0)
    assert all(len(g.runs) == 1 for g in comp.groups.values())
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.cuda_only
def test_model_parallel_groups_take_no_communicator_until_used():
    """The trainer's start-up on CUDA: megatron-core's ~20 process groups hold no NCCL
    communicator before their first collective. Bound to the device
    (``init_process_group(device_id=...)``), each group got one at once: 7.1 GiB of an
    H200 outside PyTorch's allocator for one rank (``bench/gpu_memory.py --bind-device``,
    2026-11-28); unbound, 0. A fresh process: the figure is per process (NVML)."""
    import json
    import socket
    import subprocess
    import sys

    if not DEVICE.startswith("cuda"):
        pytest.skip("NCCL communicators: CUDA only")
    code = (
        "import json, types\n"
        "from megatron.core import parallel_state\n"
        "from megatron_edgc.runtime import device_memory\n"
        "from megatron_edgc.training.loop import init_worker\n"
        "cfg = types.SimpleNamespace(parallel=types.SimpleNamespace(distributed_backend=None),\n"
        "                            allow_untested_megatron=False)\n"
        "init_worker(cfg, 0, 1, 0)\n"
        "parallel_state.initialize_model_parallel(1, 1)\n"
        "device_memory.mark('after the model-parallel groups')\n"
        "print(json.dumps(device_memory.marks()))\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    marks = json.loads(done.stdout.strip().splitlines()[-1])
    outside = {m["moment"]: m["outside"] for m in marks}
    grown = outside["after the model-parallel groups"] - outside["with the CUDA context"]
    assert grown < 0.25 * 2 ** 30, f"{grown / 2 ** 30:.2f} GiB of communicators before any use"
