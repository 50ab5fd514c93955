"""One 4-process gloo job: the DP patch on bucket groups that megatron-core reduces over
a group other than plain DP (``tests/test_group_sync.py``).

    torchrun --nproc-per-node 4 tests/group_sync_runner.py CASE[,CASE...] OUT_DIR

Each CASE writes ``OUT_DIR/CASE/rank<r>.json``; several run one after the other in the same
4 processes (the model-parallel state destroyed and the seeds set again between them), as
``tests/test_group_sync.py`` runs them: one launch instead of one per case.

CASE ``cp2``: context parallelism 2 × DP 2; megatron-core's DDP reduces the dense buckets
over the DP×CP group (4 ranks). megatron-core's local attention refuses CP > 1 (it needs
Transformer Engine's), so the module is a transformer layer's MLP from the local spec.
CASE ``ep2``: DP 4 with expert parallelism 2; a MoE layer of the local spec (4 experts,
top-2 router, alltoall dispatcher): the router's gradients are reduced over DP (4 ranks),
the experts' over the expert-DP group (2 ranks).
CASE ``inst2``: DP 4 as Megatron's partial distributed optimizer with 2 instances of 2
ranks: each bucket is reduce-scattered inside the instance, and this rank's shard is
compressed across instances (the slow hop); only the shard is compared (the distributed
optimizer reads nothing else), and the residuals are checked for conservation.

For two steps, each rank's gradient buffers after backward are reduced twice: by
megatron-core's own sync, and by the patch at full rank with every matrix compressed
(which must equal it), then at a low rank (bytes from the shapes, replicas bit-identical
over each bucket's group). Each rank writes what it measured as JSON.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from megatron_edgc.patches.cpu import apply_cpu_shims, model_parallel_cpu_manual_seed

HIDDEN, SEQ, BATCH, LOW_RANK = 64, 16, 2, 4


def build(case: str):
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    cp, ep = {"cp2": (2, 1), "ep2": (1, 2), "inst2": (1, 1)}[case]
    instances = 2 if case == "inst2" else 1
    parallel_state.initialize_model_parallel(context_parallel_size=cp,
                                             expert_model_parallel_size=ep,
                                             num_distributed_optimizer_instances=instances)
    model_parallel_cpu_manual_seed(1234, 0, parallel_state.get_expert_model_parallel_rank())
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
               moe_aux_loss_coeff=0.0) if ep > 1 else {}
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                               ffn_hidden_size=4 * HIDDEN, use_cpu_initialization=True,
                               context_parallel_size=cp, expert_model_parallel_size=ep,
                               add_bias_linear=ep == 1, gradient_accumulation_fusion=False,
                               bias_activation_fusion=False, **moe)
    spec = get_gpt_layer_local_spec(num_experts=4 if ep > 1 else None)
    module = build_module(spec.submodules.mlp, config=config)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=instances > 1,
        num_distributed_optimizer_instances=instances)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    return ddp, config


def bypass_agreement(out_dir: str) -> None:
    """CASE ``inst2-bypass``: the bypass on the slow hop, where the ranks of an instance
    hold different shards and so measure different costs: made to disagree (compression
    costs 0 s on instance rank 0, 1000 s on instance rank 1), the decision must still be
    the same on every rank of an instance, or the instance's collectives of a compressed
    bucket would meet another bucket's. Records the decisions and one sync's result."""
    from megatron.core import parallel_state

    from megatron_edgc.compression.bypass import LinkModel
    from megatron_edgc.patches.ddp import DPGradientCompression

    ddp, _ = build("inst2")
    comp = DPGradientCompression([ddp], parallel_state.get_data_parallel_group(),
                                 rank=LOW_RANK, min_compression_rate=2.0, start_iter=0,
                                 seed=7, bypass="auto", link=LinkModel.declared(1.0))
    info = next(iter(comp.plans.values())).reduction
    comp.planner.cost_model = {key: (1e3 * info.intra_rank, 0.0) for key in comp.compressors}
    comp.set_iteration(0)
    comp.prepare_iteration()
    first = sorted(comp.dense_keys)
    comp.prepare_iteration()   # the same rank setting: the agreed decisions, cached
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(5),
                    requires_grad=True)
    output, _ = ddp(x)
    output.float().square().mean().backward()
    ddp.finish_grad_sync()
    comp.stats.resolve()
    out = {"rank": dist.get_rank(), "intra_rank": info.intra_rank, "dense_keys": first,
           "dense_keys_again": sorted(comp.dense_keys), "keys": sorted(comp.compressors),
           "bypassed": comp.stats.bypassed_buckets,
           "finite": all(bool(torch.isfinite(b.grad_data).all())
                         for g in ddp.bucket_groups for b in g.buckets)}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(out, fh)


def main() -> None:
    cases, out_dir = sys.argv[1].split(","), sys.argv[2]
    apply_cpu_shims()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    for case in cases:
        torch.manual_seed(0)
        if case == "inst2-bypass":
            bypass_agreement(os.path.join(out_dir, case))
        else:
            run_case(case, os.path.join(out_dir, case))
        parallel_state.destroy_model_parallel()
        dist.barrier()
    dist.destroy_process_group()


def run_case(case: str, out_dir: str) -> None:
    """One CASE but ``inst2-bypass`` (:func:`bypass_agreement`), in the current world."""
    rank = dist.get_rank()
    ddp, _ = build(case)
    from megatron.core import parallel_state

    from megatron_edgc.patches.ddp import DPGradientCompression, reduction_group

    comp = DPGradientCompression([ddp], parallel_state.get_data_parallel_group(), rank=None,
                                 min_compression_rate=2.0, start_iter=0, seed=7)
    comp.set_iteration(0)
    groups = [(g, comp._group_plans[id(g)][0].reduction.process_group) for g in ddp.bucket_groups
              + ddp.expert_parallel_bucket_groups]
    out = {"rank": rank, "group_sizes": [dist.get_world_size(pg) for _, pg in groups],
           "group_members": [dist.get_process_group_ranks(pg) for _, pg in groups],
           "expert": [i >= len(ddp.bucket_groups) for i in range(len(groups))],
           "bucket_shapes": [[list(p.shape) for p in b.params_list]
                             for g, _ in groups for b in g.buckets],
           "bucket_offsets": [[(p.main_grad.data_ptr() - b.grad_data.data_ptr())
                               // b.grad_data.element_size() for p in b.params_list]
                              for g, _ in groups for b in g.buckets],
           "shard_ranges": [],
           "full_rank_rel_err": [], "low_rank_bytes": [], "low_rank_expert_bytes": [],
           "replicas_identical": [], "low_rank_rel_err": [], "grad_norms": [],
           "slow_hop_bytes": [], "conservation_rel_err": [],
           "state_bytes": None, "shard_numel": [], "bucket_numel": []}
    gen = torch.Generator().manual_seed(100 + rank)
    buckets = [b for g, _ in groups for b in g.buckets]
    key_of = {id(p.bucket): k for k, p in comp.plans.items()}
    keys = [key_of[id(b)] for b in buckets]
    infos = [comp.plans[k].reduction for k in keys]
    # the part of each bucket a rank reads after the sync: its shard, or all of it
    parts = [i.shard_range(b) if i.slow_hop else (0, b.grad_data.numel())
             for b, i in zip(buckets, infos)]
    out["shard_numel"] = [hi - lo for lo, hi in parts]
    out["shard_ranges"] = parts
    out["bucket_numel"] = [b.grad_data.numel() for b in buckets]

    def residual_in_bucket(key, bucket):
        """The compressor's residuals at their places in the bucket (zero elsewhere)."""
        full = torch.zeros_like(bucket.grad_data, dtype=torch.float32)
        matrices = comp.plans[key].matrices
        for g in comp.compressors[key].groups.values():
            if g.residual is None:
                continue
            for j, i in enumerate(g.indices):
                shape, offset = matrices[i]
                full[offset:offset + shape[0] * shape[1]] = g.residual[j].float().view(-1)
        return full
    for step in range(2):
        ddp.zero_grad_buffer()
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, requires_grad=True)
        output, _ = ddp(x)
        output.float().square().mean().backward()
        local = [b.grad_data.clone() for b in buckets]

        def sync(rank_):
            for b, g in zip(buckets, local):
                b.grad_data.copy_(g)
            comp.set_rank(rank_)
            comp.set_iteration(step)
            ddp.finish_grad_sync()
            comp.stats.resolve()
            comp.after_step(applied=True)   # the outcome the runtime reports after a step
            return [b.grad_data.clone() for b in buckets]

        dense = sync(None)                           # megatron-core's own reduction
        dense = [d[lo:hi] for d, (lo, hi) in zip(dense, parts)]
        full = max(min(s) for shapes in out["bucket_shapes"] for s in shapes if len(s) == 2)
        for c in comp.compressors.values():
            c.compress_all = True                    # every matrix, even at full rank
            for g in c.groups.values():              # no error feedback from the last step
                if g.residual is not None:
                    g.residual.zero_()
        compressed = [c[lo:hi] for c, (lo, hi) in zip(sync(full), parts)]
        out["full_rank_rel_err"].append(
            [((c - d).norm() / d.norm()).item() for c, d in zip(compressed, dense)])
        for c in comp.compressors.values():
            c.compress_all = False
            for g in c.groups.values():   # nor from the full-rank sync: the low rank's own
                if g.residual is not None:
                    g.residual.zero_()
        before = [residual_in_bucket(k, b) for k, b in zip(keys, buckets)]
        low = [x[lo:hi] for x, (lo, hi) in zip(sync(LOW_RANK), parts)]
        after = [residual_in_bucket(k, b) for k, b in zip(keys, buckets)]
        # conservation: over the compressed collective's group, the sum of what went in
        # (the instance-reduced shard plus the old residual) less the new residuals is the
        # result every member holds
        errors = []
        for (lo, hi), g, e0, e1, r, info in zip(parts, local, before, after, low, infos):
            scaled = g * (1.0 / 4)                   # megatron's 1/DP before the reduction
            if info.slow_hop:
                shard = torch.empty(hi - lo)
                dist.reduce_scatter_tensor(shard, scaled.clone(), group=info.intra)
            else:
                shard = scaled[lo:hi].clone()
            total = shard + e0[lo:hi] - e1[lo:hi]
            dist.all_reduce(total, group=info.process_group)
            errors.append(((total - r).norm() / r.norm()).item())
        out["conservation_rel_err"].append(errors)
        out["low_rank_bytes"].append(comp.stats.bytes_sent)
        out["slow_hop_bytes"].append(comp.stats.slow_hop_bytes_sent)
        out["low_rank_expert_bytes"].append(comp.stats.expert_bytes_sent)
        out["low_rank_rel_err"].append(
            [((c - d).norm() / d.norm()).item() for c, d in zip(low, dense)])
        out["grad_norms"].append([d.norm().item() for d in dense])
        # bit-identical over each bucket's reduction group
        identical = []
        for (group, pg), start in zip(groups, _offsets(groups)):
            for i, _ in enumerate(group.buckets):
                mine = low[start + i]
                gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
                dist.all_gather(gathered, mine, group=pg)
                identical.append(all(torch.equal(mine, other) for other in gathered))
        out["replicas_identical"].append(identical)
    out["state_bytes"] = comp.state_bytes()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)


def _offsets(groups) -> list:
    offsets, at = [], 0
    for group, _ in groups:
        offsets.append(at)
        at += len(group.buckets)
    return offsets


if __name__ == "__main__":
    main()
