"""One 4-process gloo job: the DP patch on bucket groups that megatron-core reduces over
a group other than plain DP (``tests/test_group_sync.py``).

    torchrun --nproc-per-node 4 tests/group_sync_runner.py CASE OUT_DIR

CASE ``cp2``: context parallelism 2 × DP 2; megatron-core's DDP reduces the dense buckets
over the DP×CP group (4 ranks). megatron-core's local attention refuses CP > 1 (it needs
Transformer Engine's), so the module is a transformer layer's MLP from the local spec.
CASE ``ep2``: DP 4 with expert parallelism 2; a MoE layer of the local spec (4 experts,
top-2 router, alltoall dispatcher): the router's gradients are reduced over DP (4 ranks),
the experts' over the expert-DP group (2 ranks).

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

    cp, ep = (2, 1) if case == "cp2" else (1, 2)
    parallel_state.initialize_model_parallel(context_parallel_size=cp,
                                             expert_model_parallel_size=ep)
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
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(),
                                  module=module)
    return ddp, config


def main() -> None:
    case, out_dir = sys.argv[1], sys.argv[2]
    apply_cpu_shims()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp, _ = build(case)
    from megatron.core import parallel_state

    from megatron_edgc.patches.ddp import DPGradientCompression, reduction_group

    comp = DPGradientCompression([ddp], parallel_state.get_data_parallel_group(), rank=None,
                                 min_compression_rate=2.0, start_iter=0, seed=7)
    comp.set_iteration(0)
    groups = [(g, reduction_group(g)) for g in ddp.bucket_groups
              + ddp.expert_parallel_bucket_groups]
    out = {"rank": rank, "group_sizes": [dist.get_world_size(pg) for _, pg in groups],
           "group_members": [dist.get_process_group_ranks(pg) for _, pg in groups],
           "expert": [i >= len(ddp.bucket_groups) for i in range(len(groups))],
           "bucket_shapes": [[list(p.shape) for p in b.params_list]
                             for g, _ in groups for b in g.buckets],
           "full_rank_rel_err": [], "low_rank_bytes": [], "low_rank_expert_bytes": [],
           "replicas_identical": [], "low_rank_rel_err": [], "grad_norms": []}
    gen = torch.Generator().manual_seed(100 + rank)
    buckets = [b for g, _ in groups for b in g.buckets]
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
            return [b.grad_data.clone() for b in buckets]

        dense = sync(None)                           # megatron-core's own reduction
        full = max(min(s) for shapes in out["bucket_shapes"] for s in shapes if len(s) == 2)
        for c in comp.compressors.values():
            c.compress_all = True                    # every matrix, even at full rank
            for g in c.groups.values():              # no error feedback from the last step
                if g.residual is not None:
                    g.residual.zero_()
        compressed = sync(full)
        out["full_rank_rel_err"].append(
            [((c - d).norm() / d.norm()).item() for c, d in zip(compressed, dense)])
        for c in comp.compressors.values():
            c.compress_all = False
        low = sync(LOW_RANK)
        out["low_rank_bytes"].append(comp.stats.bytes_sent)
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
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)
    dist.destroy_process_group()


def _offsets(groups) -> list:
    offsets, at = [], 0
    for group, _ in groups:
        offsets.append(at)
        at += len(group.buckets)
    return offsets


if __name__ == "__main__":
    main()
