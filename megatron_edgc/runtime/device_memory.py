"""GPU memory this process holds outside PyTorch's caching allocator at the moments of
start-up that allocate it (the CUDA context, NCCL's communicators, the cuBLAS and cuSOLVER
workspaces; issue 66: about 8 GB of an H100 per one-rank process): :func:`mark` records
NVML's per-process figure (else ``cudaMemGetInfo``'s) beside ``memory_reserved()``,
:func:`format_marks` gives the trainer's line after its first step. Nothing per step.
"""

from __future__ import annotations

import os

import torch

_MARKS: list = []   # (moment, process bytes, allocator-reserved bytes, source)


def _process_bytes():
    """(bytes this process holds on its device, where the figure came from)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda.current_device()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            index = int(visible.split(",")[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory), "nvml"
    except Exception:  # noqa: BLE001 (no NVML, or no per-process figure: the device's)
        pass
    free, total = torch.cuda.mem_get_info()
    return int(total - free), "device"


def mark(moment: str) -> None:
    """Record the memory at ``moment``; nothing without CUDA or before CUDA is initialized."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    held, source = _process_bytes()
    _MARKS.append((moment, held, int(torch.cuda.memory_reserved()), source))


def marks() -> list:
    """The recorded moments as dicts: held, reserved by the allocator, outside it (bytes)."""
    return [{"moment": m, "held": h, "reserved": r, "outside": h - r, "source": s}
            for m, h, r, s in _MARKS]


def format_marks() -> str | None:
    """``GPU memory outside PyTorch's allocator: 0.52 GiB after ..., ...`` or None."""
    if not _MARKS:
        return None
    gib = 2.0 ** 30
    parts = [f"{d['outside'] / gib:.2f} GiB {d['moment']}" for d in marks()]
    source = "this process (NVML)" if _MARKS[-1][3] == "nvml" else "the whole device"
    return (f"GPU memory outside PyTorch's allocator, {source}: " + ", ".join(parts)
            + f" (reserved by the allocator after the last: {_MARKS[-1][2] / gib:.2f} GiB)")
