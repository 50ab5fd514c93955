"""megatron-core's bucket groups as the DP patch reads them, across versions 0.13–0.19:
the attributes it needs, the group each bucket is reduced on, the bytes megatron-core's
own sync places, a rank's shard, where a parameter's gradient sits in its bucket, and the
stream megatron-core runs the instances' collectives on."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_edgc.patches import features

#: Attributes of a live bucket group / bucket the patch reads or writes.
GROUP_ATTRIBUTES = ("buckets", "ddp_config", "grad_reduce_handle", "param_gather_dispatched")
BUCKET_ATTRIBUTES = ("grad_data", "params_list", "gradient_scaling_factor")
_INSTANCE_ATTRIBUTES = ("intra_distributed_optimizer_instance_group",
                        "intra_distributed_optimizer_instance_size",
                        "intra_distributed_optimizer_instance_rank",
                        "inter_distributed_optimizer_instance_group")


def require_attributes(obj, names, what: str) -> None:
    for name in names:
        if not hasattr(obj, name):
            raise features.UnsupportedMegatronVersion(
                f"megatron-core {features.megatron_core_version()} lacks {what}.{name} "
                f"(the ddp patch); supported versions: "
                f"{', '.join(features.SUPPORTED_MEGATRON_CORE_VERSIONS)}")


def bucket_grad_bytes(bucket) -> int:
    return bucket.grad_data.numel() * bucket.grad_data.element_size()


def reduction_group(bucket_group):
    """The process group megatron-core reduces ``bucket_group`` on: the one it was built
    with, kept as ``intra_distributed_optimizer_instance_group`` with the distributed
    optimizer and as ``data_parallel_group`` without (dense buckets on DP×CP, MoE experts'
    on the expert-data-parallel group)."""
    if bucket_group.ddp_config.use_distributed_optimizer:
        name = "intra_distributed_optimizer_instance_group"
    else:
        name = "data_parallel_group"
    require_attributes(bucket_group, (name,), "_ParamAndGradBucketGroup")
    return getattr(bucket_group, name)


@dataclass(frozen=True)
class Reduction:
    """A bucket group's reduction: the group the compressed collectives run on, whether it
    holds expert parameters, and with the partial distributed optimizer
    (``--num-distributed-optimizer-instances`` > 1) the instance's group, whose dense
    reduce-scatter comes first (``process_group`` is then the inter-instance group: the
    slow hop, where only this rank's shard is compressed)."""

    process_group: object
    size: int
    expert: bool
    intra: object = None
    intra_size: int = 1
    intra_rank: int = 0

    @property
    def slow_hop(self) -> bool:
        return self.intra is not None

    @classmethod
    def of(cls, bucket_group, expert: bool) -> "Reduction":
        instances = getattr(bucket_group.ddp_config, "num_distributed_optimizer_instances", 1)
        if instances > 1:
            require_attributes(bucket_group, _INSTANCE_ATTRIBUTES, "_ParamAndGradBucketGroup")
            inter = bucket_group.inter_distributed_optimizer_instance_group
            return cls(inter, dist.get_world_size(inter), expert,
                       intra=bucket_group.intra_distributed_optimizer_instance_group,
                       intra_size=bucket_group.intra_distributed_optimizer_instance_size,
                       intra_rank=bucket_group.intra_distributed_optimizer_instance_rank)
        pg = reduction_group(bucket_group)
        return cls(pg, dist.get_world_size(pg), expert)

    def shard_range(self, bucket) -> tuple:
        """This rank's shard of ``bucket`` after the instance's reduce-scatter
        (megatron-core's ``shard_buffer``: equal contiguous parts in intra-instance rank
        order); the whole bucket without instances."""
        size = bucket.grad_data.numel() // self.intra_size
        return self.intra_rank * size, (self.intra_rank + 1) * size

    def megatron_bytes(self, bucket) -> tuple:
        """``(bytes, of those across instances)`` megatron-core's own sync of ``bucket``
        places into collectives: the bucket over its group (nothing over a group of one),
        or the whole bucket reduce-scattered inside the instance and this rank's shard
        across."""
        dense = bucket_grad_bytes(bucket)
        if self.slow_hop:
            shard = dense // self.intra_size
            return dense + shard, shard
        return (dense if self.size > 1 else 0), 0


def megatron_sync_bytes(bucket_group) -> tuple:
    """``(bytes, of those across instances)`` of megatron-core's own sync of
    ``bucket_group`` per iteration (:meth:`Reduction.megatron_bytes` summed)."""
    reduction = Reduction.of(bucket_group, expert=False)
    pairs = [reduction.megatron_bytes(b) for b in bucket_group.buckets]
    return sum(t for t, _ in pairs), sum(s for _, s in pairs)


@dataclass(frozen=True)
class MegatronSyncBytes:
    """What one rank places into megatron-core's own gradient sync per iteration, without
    compression: ``dp`` in all, of those ``expert`` over expert-DP and ``slow_hop`` across
    instances; ``fsdp_inner``: Megatron-FSDP's reduction inside the instance (its outer
    hop is the ``slow_hop``), which the outer-hop compression leaves as it is."""

    dp: int
    expert: int
    slow_hop: int
    has_experts: bool
    fsdp_inner: int = 0


def ddp_sync_bytes(chunks) -> MegatronSyncBytes:
    """:class:`MegatronSyncBytes` of megatron-core DDP's ``chunks`` (their bucket groups,
    MoE's expert buckets apart)."""
    dense = [megatron_sync_bytes(g) for c in chunks for g in c.bucket_groups]
    expert = [megatron_sync_bytes(g) for c in chunks for g in c.expert_parallel_bucket_groups]
    expert_bytes = sum(total for total, _ in expert)
    return MegatronSyncBytes(dp=expert_bytes + sum(total for total, _ in dense),
                             expert=expert_bytes,
                             slow_hop=sum(slow for _, slow in dense + expert),
                             has_experts=any(c.expert_parallel_bucket_groups for c in chunks))


def grad_in_buffer(param) -> torch.Tensor:
    """A parameter's gradient in its bucket's ``grad_data``: its ``main_grad``, or where
    megatron-core 0.19+ accumulates it apart in fp32
    (``param_name_patterns_for_fp32_local_accumulation``) the slice it copies it into."""
    copy = getattr(param, "main_grad_copy_in_grad_buffer", None)
    return param.main_grad if copy is None else copy


def copy_extra_main_grads(bucket, into_buffer: bool) -> None:
    """megatron-core 0.19+: the fp32 ``main_grad``s kept apart from the bucket, copied into
    it before the reduction and back after (as its own start/finish_grad_sync do)."""
    for param in getattr(bucket, "params_with_extra_main_grads", ()):
        copy = getattr(param, "main_grad_copy_in_grad_buffer", None)
        if copy is None:
            continue
        if into_buffer:
            copy.copy_(param.main_grad)
        else:
            param.main_grad.copy_(copy)


def is_first_batch(bucket_group) -> bool:
    """0.16+: with ``overlap_grad_reduce`` the first batch's sync starts in
    ``finish_grad_sync``; 0.13.x-0.15.x have no first-batch mode."""
    return getattr(bucket_group, "is_first_batch", False)


def instances_stream(bucket_group, reduction: Reduction):
    """The stream megatron-core runs a group's collectives on, where it does: with the
    partial distributed optimizer and ``overlap_grad_reduce`` on a GPU, its
    ``communication_stream`` (the slow hop then runs there, off the compute stream; the
    caller makes it wait for the current stream first, and the current stream wait for it
    at the end). None elsewhere."""
    stream = getattr(bucket_group, "communication_stream", None)
    if (reduction.slow_hop and bucket_group.ddp_config.overlap_grad_reduce
            and stream is not None and torch.cuda.is_available()):
        return stream
    return None


def stream_context(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
