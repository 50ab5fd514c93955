"""One compressed step, phase by phase, for the before/after of issue 33 (shared by
``bench/compression_math.py`` on CPU and ``bench/gpu_kernels.py`` on a GPU).

The gradients are views of one flat buffer (fp32, or bf16 as ``--grad-reduce-in-bf16``
gives) in the model's parameter order, as
megatron-core lays out a bucket (every layer alike, so each shape's matrices are equally
spaced). ``after`` is :class:`~megatron_edgc.compression.powersgd.BucketCompressor`;
``before`` is :class:`bench.step_before.BeforeBucketCompressor` (stacked copy of the
gradients, ``torch.linalg.qr``). One DP rank: the collectives are left out.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter

import torch

from bench.roofline import floor_ms, step_floor
from bench.orthonormal_before import fp32_gram_orthonormalize
from bench.step_before import BeforeBucketCompressor, householder_orthonormalize
from megatron_edgc.compression.orthonormal import orthonormalize, orthonormalize_step
from megatron_edgc.compression.powersgd import BucketCompressor


class Fp32GramBucketCompressor(BucketCompressor):
    """Today's step with the orthonormalization of before issue 56 (fp32 Gram matrices)."""

    orthonormalize = staticmethod(fp32_gram_orthonormalize)


def _per_group_orthonormalize(p, stood_in=None):
    """:func:`orthonormalize` called per shape group whatever the device (before issue 93)."""
    return orthonormalize(p, stood_in=stood_in)


class Before93BucketCompressor(BucketCompressor):
    """Today's step with issue 93's host changes undone (with :func:`issue_93_undone`):
    :func:`orthonormalize` per shape group, and finiteness tested by ``isfinite(x).all()``."""

    orthonormalize = staticmethod(_per_group_orthonormalize)


def _isfinite_all(x, dim=None):
    return torch.isfinite(x).all() if dim is None else torch.isfinite(x).all(dim)


def _where(keep, a, b, out=None):
    return torch.where(keep, a, b) if out is None else torch.where(keep, a, b, out=out)


@contextlib.contextmanager
def issue_93_undone():
    """The step's host kernels of before issue 93 in every module of the step that calls
    them: finiteness by ``isfinite``'s three elementwise passes, selections by
    ``torch.where`` itself (not :func:`~megatron_edgc.compression.kernels.select`'s
    16-byte view), the dense rest one call per tensor (not per
    :func:`~megatron_edgc.compression.kernels.flat_runs` run)."""
    from megatron_edgc.compression import kernels, low_rank_state, orthonormal, powersgd, \
        unit_state

    patches = [(m, "all_finite", _isfinite_all) for m in (kernels, powersgd, unit_state)] + \
        [(m, "select", _where) for m in (kernels, orthonormal, unit_state)] + \
        [(m, "flat_runs", list) for m in (kernels, low_rank_state)]
    saved = [getattr(m, name) for m, name, _ in patches]
    for m, name, fn in patches:
        setattr(m, name, fn)
    try:
        yield
    finally:
        for (m, name, _), fn in zip(patches, saved):
            setattr(m, name, fn)


#: ``before``: the step of before issue 33; ``fp32-gram``: today's step with the
#: orthonormalization of before issue 56; ``before-93``: today's step with issue 93's
#: changes undone; ``after``: today's.
METHODS = {"after": (BucketCompressor, orthonormalize),
           "before": (BeforeBucketCompressor, householder_orthonormalize),
           "fp32-gram": (Fp32GramBucketCompressor, fp32_gram_orthonormalize),
           "before-93": (Before93BucketCompressor, _per_group_orthonormalize)}


def count_ops(fn) -> int:
    """The aten operations ``fn()`` dispatches (views included), as a
    ``TorchDispatchMode`` sees them: what a step pays the per-call overhead for."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


class Timer:
    """Milliseconds of ``fn()``: CUDA events on the current stream, or the calling thread's
    CPU time on the host."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t0 = time.thread_time()   # this thread's CPU time: others' load on the machine
        fn()                      # does not count (one torch thread runs the step on it)
        return (time.thread_time() - t0) * 1e3


def flat_grads(shapes, device, dtype=torch.float32) -> tuple[torch.Tensor, list]:
    """Matrix views ``(n, m)`` of one flat buffer of ``dtype``, in ``shapes``' order."""
    total = sum(n * m for n, m in shapes)
    buf = torch.empty(total, device=device, dtype=dtype)
    views, off = [], 0
    for n, m in shapes:
        views.append(buf[off:off + n * m].view(n, m))
        off += n * m
    return buf, views


def release_freed_heap() -> None:
    """Make the resident set follow the live large allocations: glibc serves every block
    of 1 MiB or more with its own mapping from here on (``mallopt(M_MMAP_THRESHOLD)``), so
    a freed temporary leaves the resident set and a new one faults its pages in, and the
    heap freed so far goes back to the kernel (``malloc_trim``). Otherwise a temporary
    that reuses a freed heap block goes unseen, and heap fragmentation shows as use."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 << 10)  # M_TRIM_THRESHOLD, glibc's default
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def heap_as_in_training() -> None:
    """glibc as a training process runs in its steady state, for timing: blocks under
    32 MiB (the cap of its dynamic mmap threshold, which a process that never calls
    ``mallopt`` reaches once it has freed such a block) come from the heap and stay there
    (trim threshold 64 MiB), so a step's temporaries reuse pages instead of faulting in
    fresh ones (:func:`release_freed_heap`'s rule, for measuring memory, makes every
    block of 1 MiB or more do so)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def time_method(method: str, shapes, rank: int, device, *, repeats: int, warmup: int,
                factor_dtype=torch.float32, ef_dtype=torch.float32,
                grad_dtype=torch.float32, min_compression_rate: float = 2.0) -> dict:
    """Median ms of each phase (start, orth, middle without orth, finish) and the step,
    the step's spread, and memory: the error-feedback state and the step's transient
    (peak minus what stays between steps; CUDA allocator, or peak RSS on Linux CPUs).
    ``grad_dtype``: the gradient buffer's (bf16: the compressor's bf16-buffer path, ``M``
    formed in fp32 slices); ``before`` only ran on fp32 buffers."""
    if method == "before" and grad_dtype != torch.float32:
        raise ValueError("the step before issue 33 takes fp32 gradient buffers only")
    with issue_93_undone() if method == "before-93" else contextlib.nullcontext():
        return _time_method(method, shapes, rank, device, repeats=repeats, warmup=warmup,
                            factor_dtype=factor_dtype, ef_dtype=ef_dtype,
                            grad_dtype=grad_dtype, min_compression_rate=min_compression_rate)


def _time_method(method: str, shapes, rank: int, device, *, repeats: int, warmup: int,
                 factor_dtype, ef_dtype, grad_dtype, min_compression_rate: float) -> dict:
    cls, orth = METHODS[method]
    device = torch.device(device)
    if device.type == "cpu":   # every setting timed under the allocator's same rules
        heap_as_in_training()
    entries = [(f"p{i}", s) for i, s in enumerate(shapes)]
    kwargs = {"ef_dtype": ef_dtype} if method != "before" else {}
    comp = cls(entries, rank, min_compression_rate=min_compression_rate, seed=0, device=device,
               factor_dtype=factor_dtype, **kwargs)
    buf, grads = flat_grads(shapes, device, grad_dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    source = torch.randn(buf.numel(), device=device, generator=gen)
    timer = Timer(device)
    state = {}

    def start():
        state["bufs"], state["step"] = comp.start(grads)

    def middle():
        state["q"] = comp.middle(state["step"], state["bufs"])

    def finish():
        comp.finish(state["step"], state["q"])

    # the step's outcome, reported as the optimizer would after it (untimed): applied. An
    # unreported step is settled as a skip when the next one begins (issue 81), and that
    # give-back is no part of the step being timed
    applied = getattr(comp, "after_step", lambda applied: None)

    buf.copy_(source)
    start(); middle(); finish(); applied(True)  # noqa: E702  (the first step allocates E, Q)
    ps = [torch.randn(len(g.indices), g.n, comp._rank_for(g), device=device, generator=gen)
          for g in comp.groups.values()]
    phases = {"start": [], "orth": [], "middle": [], "finish": [], "step": []}
    for i in range(warmup + repeats):
        buf.copy_(source)
        t = {"start": timer(start), "middle": timer(middle), "finish": timer(finish),
             "orth": timer(lambda: orthonormalize_step(ps, [], comp.orthonormalize))}
        applied(True)
        if i >= warmup:
            for key, ms in t.items():
                phases[key].append(ms)
            phases["step"].append(t["start"] + t["middle"] + t["finish"])
    out = {key: statistics.median(v) for key, v in phases.items()}
    out["middle"] = max(0.0, out["middle"] - out["orth"])  # the middle without the QR
    out["step_min"], out["step_max"] = min(phases["step"]), max(phases["step"])
    out["ef_state_bytes"] = comp.state_bytes()
    buf.copy_(source)
    out["ops"] = count_ops(lambda: (start(), middle(), finish()))
    applied(True)
    buf.copy_(source)
    if device.type == "cuda":
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start(); middle(); finish(); applied(True)  # noqa: E702
        torch.cuda.synchronize()
        out["transient_bytes"] = torch.cuda.max_memory_allocated() - resident
    else:
        try:
            release_freed_heap()
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            resident = _rss_mib("VmRSS")
            start(); middle(); finish(); applied(True)  # noqa: E702
            out["transient_bytes"] = (_rss_mib("VmHWM") - resident) * 2**20
        except OSError:
            pass
    out["groups"] = [(g.n, g.m, len(g.indices)) for g in comp.groups.values()]
    out.update(wire_bytes=sum(comp.wire_bytes()),
               dense_bytes=sum(n * m for _, (n, m) in comp.entries) * 4,
               compressed_matrices=sum(len(g.indices) for g in comp.groups.values()))
    return out


def compare(shapes, rank: int, device, peaks: dict, *, repeats: int, warmup: int,
            factor_dtype=torch.float32, ef_dtype=torch.float32, grad_dtype=torch.float32,
            methods=("before", "after"), min_compression_rate: float = 2.0) -> dict:
    """Before and after, alternating repetitions in one run, with the floor of each phase
    (the gradient buffer's bytes in ``grad_dtype``; ``before`` takes fp32 buffers only)."""
    runs = {}
    for method in methods:
        runs[method] = time_method(method, shapes, rank, device, repeats=repeats,
                                   warmup=warmup, factor_dtype=factor_dtype,
                                   ef_dtype=ef_dtype if method != "before" else torch.float32,
                                   grad_dtype=grad_dtype,
                                   min_compression_rate=min_compression_rate)
    groups = runs[methods[-1]]["groups"]
    ef_bytes = torch.finfo(ef_dtype).bits // 8
    factor_bytes = torch.finfo(factor_dtype).bits // 8
    grad_bytes = torch.finfo(grad_dtype).bits // 8
    floors = floor_ms(step_floor(groups, rank, grad_bytes=grad_bytes, ef_bytes=ef_bytes,
                                 factor_bytes=factor_bytes), peaks)
    residual = sum(n * m * k for n, m, k in groups) * ef_bytes
    return {"runs": runs, "floor_ms": floors, "residual_bytes": residual,
            "matrices": sum(k for _, _, k in groups),
            "shapes": [list(s) for s in Counter(map(tuple, shapes)).items()]}
