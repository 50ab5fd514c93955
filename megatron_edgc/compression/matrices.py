"""Matrix views of gradients: shapes, the compressibility rule, seeded Gaussians and the
strided runs that address equally spaced matrices of one buffer as one batch."""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

FLOAT_BYTES = 4  # P, Q and the packed dense part travel in fp32 (by default)
FACTOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def is_compressible(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """EDGC §1's rule: low rank really is lower, and pays at least ``min_compression_rate``."""
    return min(n, m) > rank and (n + m) * rank * min_compression_rate <= n * m


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix view of a gradient: ``(shape[0], numel / shape[0])``; vectors are 1 x n."""
    if len(shape) < 2:
        n = 1
        for s in shape:
            n *= s
        return (1, n)
    m = 1
    for s in shape[1:]:
        m *= s
    return (shape[0], m)


def seeded_gaussian(seed: int, name: str, tag: str, rows: int, cols: int) -> torch.Tensor:
    """A Gaussian (rows x cols) that depends only on (seed, name, tag): equal on all ranks."""
    digest = hashlib.sha256(f"{seed}/{name}/{tag}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randn(rows, cols, generator=gen, dtype=torch.float32)


def strided_runs(mats: Sequence[torch.Tensor], n: int, m: int) -> list:
    """``[(lo, hi, step)]``: maximal runs of ``mats`` (fp32, contiguous ``n x m`` views of
    one storage) that sit at equal, increasing distances ``step`` (elements), each run
    addressable as one ``[hi - lo, n, m]`` view (:func:`run_view`). Host arithmetic on
    pointers only. Megatron's buffer gives one run per shape for a stack of equal layers."""
    runs = []
    lo, step = 0, None
    size = mats[0].element_size()
    for j in range(1, len(mats) + 1):
        if j < len(mats):
            prev, this = mats[j - 1], mats[j]
            gap = (this.data_ptr() - prev.data_ptr()) // size
            if (this.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
                    and gap >= n * m and step in (None, gap)):
                step = gap
                continue
        runs.append((lo, j, n * m if step is None else step))
        lo, step = j, None
    return runs


def run_view(first: torch.Tensor, count: int, step: int, n: int, m: int) -> torch.Tensor:
    """``count`` matrices ``n x m`` from ``first`` on, ``step`` elements apart, as a view."""
    return first.as_strided((count, n, m), (step, m, 1), first.storage_offset())
