"""The CPU precision of an unset ``--bf16``: chosen by what this CPU computes faster at the
model's shapes, and the same on every rank of the job (issues 80 and 91).

bf16 instructions are necessary, not sufficient. Without them (an AMD EPYC of family 25,
Zen 3: AVX2 only) PyTorch converts every operand: a 512² bf16 matmul ran at 0.8 GFLOP/s
against 67 for fp32 on one thread, the tiny CPU config 6.7-8.3 s an iteration in bf16
against 1.3-1.6 s: fp32 by rule, nothing measured. With them it depends on the CPU: an
Intel Xeon (family 6, model 207) with AVX512-BF16 and no AMX ran a linear + GELU forward
and backward in 229 ms in bf16 against 133 in fp32; an AMD EPYC Zen 4 (family 25, model
17) ran it in about half fp32's time. So where the CPU has them, each rank times that
layer at the model's shapes in both precisions (:func:`measure`, a fraction of a second),
and the job takes bf16 only where every rank found it faster (:func:`agree`).
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import time
from typing import Optional

#: /proc/cpuinfo flags that carry bf16 arithmetic, and how to name them.
_BF16_FLAGS = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16", "bf16": "Arm BF16"}

#: bf16 is taken where its timed layer costs at most this share of fp32's: on a tie fp32
#: (no casts, no rounding), and the margin covers the noise of ranks timing side by side
#: (measured ratios: 0.4-0.6 on a Zen 4, 1.6-1.8 on the Xeon above).
BF16_FASTER_BELOW = 0.9

#: the timed layer's size: tokens are cut so that one forward and backward is at most this
#: many floating-point operations (GPT-2 medium's 1024 x 4096 MLP: 64 tokens of 2048)
PROBE_FLOPS = 1e9
PROBE_REPS = 5


def cpu_bf16_from(cpuinfo: str) -> tuple:
    """``(native, what)`` from the text of ``/proc/cpuinfo``: whether the CPU has bf16
    instructions, and a phrase naming them or the CPU without them."""
    flags, model = set(), ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features"):
            flags |= set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    found = [name for flag, name in _BF16_FLAGS.items() if flag in flags]
    if found:
        return True, f"{model or 'this CPU'} has native bf16 ({', '.join(found)})"
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return False, (f"{model or 'this CPU'} has no native bf16 ({isa}, no AVX512-BF16 or "
                   f"AMX-BF16): bf16 arithmetic is converted, many times slower than fp32")


@functools.lru_cache(maxsize=None)
def cpu_bf16() -> tuple:
    """``(native, what)`` of this machine's CPU (Linux: ``/proc/cpuinfo``; elsewhere:
    not native, as unknown)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return cpu_bf16_from(fh.read())
    except OSError:
        return False, f"{platform.processor() or 'this CPU'}: bf16 support unknown (no " \
                      f"/proc/cpuinfo), taken as not native"


@dataclasses.dataclass(frozen=True)
class CpuPrecision:
    """The precision an unset ``--bf16`` takes on a CPU, and why. ``fp32_ms``/``bf16_ms``:
    the timed layer (None where the rule decided without timing)."""

    bf16: bool
    why: str
    fp32_ms: Optional[float] = None
    bf16_ms: Optional[float] = None


def choose(native: bool, what: str, fp32_s: Optional[float] = None,
           bf16_s: Optional[float] = None) -> CpuPrecision:
    """The choice from the CPU's instructions (:func:`cpu_bf16_from`) and, where it has
    bf16 ones, the timed layer's seconds in each precision."""
    if not native:
        return CpuPrecision(False, what)
    if fp32_s is None or bf16_s is None:
        raise ValueError("a CPU with bf16 instructions is chosen for by timing")
    ratio = bf16_s / fp32_s
    faster = ratio <= BF16_FASTER_BELOW
    return CpuPrecision(
        faster, f"{what}; a linear + GELU at the model's shapes took {bf16_s * 1e3:.2f} ms "
                f"in bf16, {fp32_s * 1e3:.2f} in fp32 ({ratio:.2f}x: "
                f"{'bf16' if faster else 'fp32'} is faster here)", fp32_s * 1e3, bf16_s * 1e3)


def probe_shape(tokens: int, hidden: int, ffn_hidden: int) -> tuple:
    """``(tokens, hidden, ffn_hidden)`` of the timed layer: the model's MLP, with at most
    as many of ``tokens`` as keep it within :data:`PROBE_FLOPS` (at least 64)."""
    per_token = 6 * hidden * ffn_hidden   # forward and backward of x Wᵀ
    return max(64, min(tokens, int(PROBE_FLOPS // per_token))), hidden, ffn_hidden


def time_layer(shape: tuple, reps: int = PROBE_REPS) -> tuple:
    """Median seconds ``(fp32, bf16)`` of a linear + GELU forward and backward at
    ``shape`` on this process's threads, the two precisions interleaved so that a load
    beside it (the job's other ranks timing too) weighs on both alike."""
    import torch

    tokens, hidden, ffn = shape
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, hidden, generator=gen).to(dtype).requires_grad_()
        w = torch.randn(ffn, hidden, generator=gen).mul_(hidden ** -0.5).to(dtype)
        tensors[dtype] = (x, w.requires_grad_())
    times = {dtype: [] for dtype in tensors}
    for rep in range(reps + 1):               # the first of each: warm-up, not counted
        for dtype, (x, w) in tensors.items():
            start = time.perf_counter()
            torch.nn.functional.gelu(x @ w.t()).sum().backward()
            if rep:
                times[dtype].append(time.perf_counter() - start)
    return tuple(sorted(t)[len(t) // 2] for t in times.values())


def measure(tokens: int, hidden: int, ffn_hidden: int) -> CpuPrecision:
    """This process's choice: by rule without bf16 instructions, else timed at the model's
    shapes (:func:`time_layer`)."""
    native, what = cpu_bf16()
    if not native:
        return choose(native, what)
    return choose(native, what, *time_layer(probe_shape(tokens, hidden, ffn_hidden)))


def agree(mine: CpuPrecision, group=None) -> CpuPrecision:
    """The job's choice from every rank's (one all-reduce of ``group``, default the
    world): bf16 only where every rank found it faster; otherwise fp32 on every rank, the
    ``why`` naming how many ranks would have taken bf16."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return mine
    votes = torch.tensor([float(mine.bf16), 1.0], dtype=torch.float64)
    dist.all_reduce(votes, group=group)   # once, before the model: not on a per-step path
    bf16_ranks, ranks = (int(v) for v in votes.tolist())
    if bf16_ranks in (0, ranks):   # every rank chose as this one
        return mine
    return CpuPrecision(False, f"{ranks - bf16_ranks} of {ranks} ranks found fp32 faster "
                               f"and the job trains every rank alike (this rank: {mine.why})",
                        mine.fp32_ms, mine.bf16_ms)
