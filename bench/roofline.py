"""The compressed step's floor: what one step must move and compute, phase by phase, and
the machine's peaks to turn that into time (issue 33).

For one bucket of shape groups ``(n, m, k)`` at rank ``r``, with a ``g``-byte gradient,
an ``e``-byte residual and ``f``-byte factors, the least any implementation of the step
(``tests/test_powersgd.py`` holds ours to the same data flow) must do:

* **start**: read ``G`` and ``E``, write ``M = G + E`` where ``G`` was (``g + e + g``
  bytes per element), and ``P = M Q`` (``2 n m r`` flops); ``P`` out (``n r f``);
* **orthogonalization**: read ``P`` and write ``P^`` (``2 n r · 4`` bytes), and a QR's
  ``4 n r²`` flops (Householder's count: the least a stable method spends);
* **middle** (without the orthogonalization): read ``M`` once for ``Q = Mᵀ P^``
  (``g`` bytes per element, ``2 n m r`` flops);
* **finish**: read ``M``, write ``E`` and ``G`` (``g + e + g`` bytes per element), the
  residual ``M - P^ Q_iᵀ`` and ``P^ Qᵀ`` (``4 n m r`` flops).

A gradient buffer narrower than fp32 (``g = 2``: bf16, ``--grad-reduce-in-bf16``) cannot
hold ``M`` without rounding it, so it keeps ``G`` and each phase that reads ``M`` forms it
again from ``G`` and ``E`` (``ErrorFeedback.blocks`` in
``megatron_edgc/compression/kernels.py``): **start** reads ``G`` and ``E`` and writes no
``M`` (``g + e``), **middle** reads ``G`` and ``E`` (``g + e``), **finish** reads ``G``
and ``E`` and writes ``E`` and ``G`` (``g + e + e + g``); the flops are the same.
(Keeping ``M`` in an fp32 copy instead costs as much at ``e = 4`` and more at ``e = 2``.)

A phase's floor is ``max(bytes / copy rate, flops / matmul rate)``, with both rates
measured on the machine in the same run: a large device copy (bytes read + written per
second) and a large square matmul in the step's math dtype (fp32, TF32 off).
"""

from __future__ import annotations

import time

import torch

PHASES = ("start", "orth", "middle", "finish")


def step_floor(groups, rank: int, grad_bytes: int = 4, ef_bytes: int = 4,
               factor_bytes: int = 4) -> dict:
    """``{phase: {"bytes": .., "flops": ..}}`` for shape groups ``[(n, m, k), ...]``
    (``grad_bytes`` < 4: ``M`` formed again from ``G`` and ``E`` by each phase)."""
    in_buffer = grad_bytes >= 4                 # M = G + E held where G was
    reads_m = grad_bytes if in_buffer else grad_bytes + ef_bytes
    writes_m = grad_bytes if in_buffer else 0
    out = {phase: {"bytes": 0.0, "flops": 0.0} for phase in PHASES}
    for n, m, k in groups:
        r = min(rank, n, m)
        nm = n * m * k
        out["start"]["bytes"] += nm * (grad_bytes + ef_bytes + writes_m) \
            + k * (n + m) * r * 4 + k * n * r * factor_bytes
        out["start"]["flops"] += 2 * nm * r
        out["orth"]["bytes"] += 2 * k * n * r * 4
        out["orth"]["flops"] += 4 * k * n * r * r
        out["middle"]["bytes"] += nm * reads_m + k * (n + m) * r * 4
        out["middle"]["flops"] += 2 * nm * r
        out["finish"]["bytes"] += nm * (reads_m + ef_bytes + grad_bytes) + 2 * k * (n + m) * r * 4
        out["finish"]["flops"] += 4 * nm * r
    return out


def floor_ms(floor: dict, peaks: dict) -> dict:
    """Each phase's floor in ms and the whole step's (the sum)."""
    ms = {phase: 1e3 * max(v["bytes"] / peaks["copy_bytes_per_s"],
                           v["flops"] / peaks["matmul_flops_per_s"])
          for phase, v in floor.items()}
    ms["step"] = sum(ms.values())
    return ms


def _best_seconds(fn, device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        else:
            t0 = time.thread_time()   # as bench/step_phases.py's Timer: this thread's
            fn()
            best = min(best, time.thread_time() - t0)
    return best


def measure_peaks(device, copy_mib: int = 256, matmul_n: int = 4096,
                  repeats: int = 5) -> dict:
    """A large fp32 copy (bytes read + written per second) and an ``n³`` fp32 matmul
    (flops per second, TF32 off), best of ``repeats``."""
    device = torch.device(device)
    src = torch.ones(copy_mib << 18, device=device)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device, repeats)
    a = torch.randn(matmul_n, matmul_n, device=device)
    b = torch.randn(matmul_n, matmul_n, device=device)
    c = torch.empty_like(a)
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:
        mm_s = _best_seconds(lambda: torch.mm(a, b, out=c), device, repeats)
    finally:
        matmul.allow_tf32 = saved
    return {"copy_bytes_per_s": 2 * src.numel() * 4 / copy_s,
            "matmul_flops_per_s": 2 * matmul_n ** 3 / mm_s,
            "copy_mib": copy_mib, "matmul_n": matmul_n}
