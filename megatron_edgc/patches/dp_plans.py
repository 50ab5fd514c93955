"""One plan per DDP bucket — its reduction, layout, compressor and gradient views — and the
three ways to sync it: flat PowerSGD over the group, PowerSGD on the slow hop after the
instance's dense reduce-scatter, or dense (the bypass). Each strategy is a generator of
:class:`~megatron_edgc.patches.dp_pipeline.Phase` s run by the bucket pipeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_edgc.compression.low_rank_state import LowRankState
from megatron_edgc.compression.kernels import dtype_bytes
from megatron_edgc.compression.powersgd import BucketCompressor
from megatron_edgc.compression.shard import shard_pieces
from megatron_edgc.compression.shard_powersgd import ShardCompressor, shard_compressor_inputs
from megatron_edgc.patches.dp_pipeline import (Phase, Strategy, all_gather, all_reduce,
                                               reduce_scatter)
from megatron_edgc.patches.megatron_buckets import Reduction, bucket_grad_bytes


@dataclass
class BucketPlan:
    """A bucket's compression: ``matrices`` are ``((n, m), offset)`` of the compressor's
    entries in the bucket (whole matrices, or on the slow hop this rank's pieces)."""

    key: str
    bucket: object
    reduction: Reduction
    compressor: LowRankState
    matrices: list
    param_names: list          # [(name, param)] of the bucket
    #: (bytes, across instances) of the dense sync this plan replaces: the bucket's
    #: all-reduce (counted even over one replica), or its reduce-scatter in the instance
    #: and this rank's shard across
    replaced_bytes: tuple

    @classmethod
    def build(cls, key: str, bucket, reduction: Reduction, matrices: list, param_names: list,
              rank: int, settings: dict) -> "BucketPlan":
        """``matrices``: ``(name, (n, m), offset)`` of every matrix of the bucket."""
        if reduction.slow_hop:  # this rank's shard: row blocks and dense pieces
            pieces = shard_pieces([(name, offset, shape) for name, shape, offset in matrices],
                                  *reduction.shard_range(bucket))
            entries, parents = shard_compressor_inputs(pieces, matrices)
            comp = ShardCompressor(entries, parents,
                                   [(name, shape) for name, shape, _ in matrices],
                                   reduction.intra_size, rank, **settings)
            layout = [(pc.shape, pc.start) for pc in pieces]
        else:
            comp = BucketCompressor([(name, shape) for name, shape, _ in matrices], rank,
                                    **settings)
            layout = [(shape, offset) for _, shape, offset in matrices]
        dense = bucket_grad_bytes(bucket)
        shard = dense // reduction.intra_size if reduction.slow_hop else 0
        return cls(key, bucket, reduction, comp, layout, param_names, (dense + shard, shard))

    def grads(self, data: torch.Tensor = None) -> list:
        """Views of the compressor's entries in ``data`` (default: the bucket's gradients),
        laid out as the bucket."""
        data = self.bucket.grad_data if data is None else data
        return [data[o:o + shape[0] * shape[1]].view(shape) for shape, o in self.matrices]

    def scratch_grads(self) -> list:
        """Random gradients laid out as the bucket's, in its dtype (the cost model times
        the strided path the real step takes)."""
        return self.grads(torch.randn_like(self.bucket.grad_data))

    @property
    def dense_bytes(self) -> int:
        """The dense alternative on the compressed group in the dense wire dtype: the
        bucket, or on the slow hop this rank's shard of it."""
        numel = self.bucket.grad_data.numel() // self.reduction.intra_size
        return numel * dtype_bytes(self.compressor.dense_dtype)

    def shard(self) -> torch.Tensor:
        lo, hi = self.reduction.shard_range(self.bucket)
        return self.bucket.grad_data[lo:hi]

    # ------------------------------------------------------------------ strategies

    def fast_hop(self):
        """The instance's dense reduce-scatter: this rank's shard summed over the
        instance, in place (as megatron-core does)."""
        yield Phase([reduce_scatter(self.shard(), self.bucket.grad_data, self.reduction.intra)],
                    inline=True, common=True)

    def scales_in_cast(self, dense: bool) -> bool:
        """Whether a sync of this bucket scales its gradients in the cast to the dense wire
        (:meth:`dense`, nothing to absorb) rather than in place before it."""
        return (dense and not self.reduction.slow_hop and self.compressor.state.clear
                and self.bucket.grad_data.dtype != self.compressor.dense_dtype)

    def dense(self, scale: float = 1.0) -> Strategy:
        """The bypass and the warm-up: the whole error into the dense message (a switch,
        timed apart), then the all-reduce (on the slow hop, the shard across instances)
        in the dense wire dtype; a buffer wider than the wire travels in slices of at most
        the workspace, each cast there and back (its rounding is not fed back, as the bf16
        wire of Megatron-LM's ``--grad-reduce-in-bf16`` or torch's ``bf16_compress_hook``).
        ``scale``: the gradient scaling not yet applied (:meth:`scales_in_cast`), done in
        the cast: one pass over the buffer, as torch's hook scales its bf16 copy."""
        r = self.reduction
        if r.slow_hop:
            yield from self.fast_hop()
        grads = self.grads()
        # residuals to absorb: the bucket switches to dense (an exploration, its return, a
        # new decision); that pass is timed apart, the steady price of neither path
        switch = not self.compressor.state.clear
        if switch:
            yield Phase([], inline=True)
        self.compressor.absorb_residual(grads)
        if switch:
            yield Phase([], inline=True, switch=True)
        data = self.shard() if r.slow_hop else self.bucket.grad_data
        wire = self.compressor.dense_dtype
        if data.dtype == wire:
            yield Phase([all_reduce(data, r.process_group, slow_hop=r.slow_hop)])
            return None
        step = max(1, self.compressor.workspace_bytes // dtype_bytes(wire))
        for lo in range(0, data.numel(), step):
            part = data[lo:lo + step]
            sent = torch.empty(part.shape, dtype=wire, device=part.device)
            torch.mul(part, scale, out=sent)
            yield Phase([all_reduce(sent, r.process_group, slow_hop=r.slow_hop)])
            part.copy_(sent)
        return None

    def flat(self, dump=None, events: Optional[list] = None) -> Strategy:
        """PowerSGD over the group: ``[P | dense | flag]``, then ``[Q]``
        (:class:`~megatron_edgc.compression.powersgd.BucketCompressor`); ``dump``, a
        :class:`~megatron_edgc.patches.debug_dump.DebugDump`, captures the step (its
        events into ``events``)."""
        comp, pg = self.compressor, self.reduction.process_group
        grads = self.grads()
        capture = dump.begin(self, grads) if dump is not None else None
        bufs, step = comp.start(grads)
        yield Phase([all_reduce(b, pg) for b in bufs])
        if capture is not None:
            capture.summed("p", bufs)
        bufs = comp.middle(step, bufs)
        yield Phase([all_reduce(b, pg) for b in bufs])
        if capture is not None:
            capture.summed("q", bufs)
        comp.finish(step, bufs)
        flags = step.flags()
        if capture is not None:
            dump.end(capture, flags, events)
        return flags

    def slow_hop(self) -> Strategy:
        """PowerSGD across instances on this rank's shard
        (:class:`~megatron_edgc.compression.shard_powersgd.ShardCompressor`): the dense
        reduce-scatter inside the instance, ``[L | flag]`` reduce-scattered inside it, the
        slice across, the all-gather inside, then ``[Q_b' | dense | flag]`` across."""
        r = self.reduction
        yield from self.fast_hop()
        return (yield from shard_hop(self.compressor, self.grads(), r.intra, r.intra_size,
                                     r.process_group))

    def strategy(self, dense: bool, dump=None, events: Optional[list] = None,
                 scale: float = 1.0) -> Strategy:
        """``scale``: where :meth:`scales_in_cast`, the scaling the dense cast applies."""
        if dense:
            return self.dense(scale)
        return self.slow_hop() if self.reduction.slow_hop else self.flat(dump, events)


def shard_hop(comp: ShardCompressor, grads, inner, inner_size: int, outer) -> Strategy:
    """PowerSGD across ``outer`` on the shard this rank holds of a gradient the group
    ``inner`` (``inner_size`` ranks) has already reduced: ``[L | flag]`` reduce-scattered
    inside, the slice across, the all-gather inside, then ``[Q_b' | dense | flag]`` across.
    The slow hop of the partial distributed optimizer and Megatron-FSDP HSDP's outer hop."""
    bufs, step = comp.start(grads)
    sent = None
    if bufs:
        own = bufs[0].new_empty(bufs[0].numel() // inner_size)
        yield Phase([reduce_scatter(own, bufs[0], inner)], inline=True)
        sent = comp.to_send(own)
    yield Phase([all_reduce(sent, outer, slow_hop=True)] if bufs else [])
    gathered = []
    if sent is not None:
        p_full = sent.new_empty(sent.numel() * inner_size)
        yield Phase([all_gather(p_full, sent, inner)], inline=True)
        gathered = [p_full]
    bufs = comp.middle(step, gathered)
    yield Phase([all_reduce(b, outer, slow_hop=True) for b in bufs])
    comp.finish(step, bufs)
    return step.flags()
