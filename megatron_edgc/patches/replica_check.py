"""Whether data-parallel replicas hold bit-identical parameters: a digest of every
bucket's parameter bits, MIN and MAX over its group (``--edgc-check-replicas``, a debug
check)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def bits_digest(data: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """An int64 digest of ``data``'s bits (each element's integer view weighted by its
    position mod a prime): equal tensors give equal digests, a flipped bit changes it.
    Chunked, so the temporaries stay at ``chunk`` elements."""
    ints = data.detach().reshape(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                                           8: torch.int64}[data.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, ints.numel(), chunk):
        part = ints[start:start + chunk].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), device=data.device) % 65521 + 1
        total += (part * weight).sum()
    return total


def bucket_digest(bucket) -> torch.Tensor:
    """The digest of a bucket's parameters: its slice of the parameter buffer (the
    distributed optimizer's), else each parameter's, weighted by its place."""
    if getattr(bucket, "param_data", None) is not None:
        return bits_digest(bucket.param_data)
    return sum((i + 1) * bits_digest(p.data) for i, p in enumerate(bucket.params_list))


def replica_mismatches(groups) -> int:
    """How many buckets hold parameters that differ from another replica's. ``groups``:
    ``[(process group, [bucket, ...])]``, the same groups in the same order on every
    member. One host sync per group."""
    mismatches = 0
    for pg, buckets in groups:
        digest = torch.stack([bucket_digest(b) for b in buckets])
        low, high = digest.clone(), digest
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=pg)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=pg)
        mismatches += int((high != low).sum().item())  # a debug check: one sync
    return mismatches
