"""Megatron-FSDP in HSDP mode on 4 CPU processes with gloo (issue 94, item 3).

    torchrun --nproc-per-node 4 tests/fsdp_hsdp_probe.py CASE[,CASE...] OUT_DIR [STEPS [MB]]

Each CASE trains megatron-core's ``GPTModel`` (2 layers, hidden 64, local spec) for STEPS
optimizer steps (default 3) of MB micro-batches (default 2) of random tokens, with
megatron-core's optimizer (Adam; the distributed optimizer but for ``ddp``), and writes
``OUT_DIR/CASE/rank<r>.pt``: the whole weights after the steps (for Megatron-FSDP, each
instance's shards gathered inside the instance), each step's loss, the calls and bytes of
collectives issued on the outer (inter-instance) group, the outer hop's tensors of the last
step as sent and as reduced, Megatron-FSDP's bucket layout (parameters' coordinates in each
bucket and this rank's shard of it) and, for ``ddp``, the first step's reduced gradients.
A CASE ``NAME:mbN`` runs NAME with N micro-batches a step (written to ``OUT_DIR/NAME:mbN``).

CASES:

* ``ddp``: plain megatron-core DDP over DP 4 (all-reduce, no distributed optimizer);
* ``ddp-inst2``: megatron-core DDP with 2 distributed-optimizer instances of 2 (the
  partial distributed optimizer: reduce-scatter inside the instance, all-reduce across);
* ``hsdp-no_shard``, ``hsdp-optim_grads_params``: Megatron-FSDP
  (``use_megatron_fsdp=True``, ``num_distributed_optimizer_instances=2``,
  ``outer_dp_sharding_strategy="no_shard"``) with that inner sharding strategy.

Every case sees the same tokens per global DP rank and step and the same initial weights
(every rank builds the model from the same seed). The CPU shims
(``megatron_edgc.patches.cpu`` and, for Megatron-FSDP, ``megatron_edgc.patches.fsdp_cpu``)
are applied before anything is built.
"""

from __future__ import annotations

import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_edgc.patches.cpu import apply_cpu_shims, model_parallel_cpu_manual_seed  # noqa: E402

VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES, HIDDEN, LAYERS, HEADS = 128, 32, 2, 2, 64, 2, 4
LR, SEED = 1e-2, 1234


class OuterCounter:
    """Counts the collectives issued on one process group (calls and bytes) by wrapping
    ``torch.distributed``'s functions that Megatron-FSDP and DDP look up at call time."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")

    def __init__(self):
        self.group = None
        self.calls = {n: 0 for n in self.NAMES}
        self.bytes = {n: 0 for n in self.NAMES}
        self.shapes = []
        self.record = False          # keep the tensors of the calls while set
        self.recorded = []           # [(name, tensor as sent (a copy), the tensor itself)]
        self._originals = {}

    def install(self, group) -> None:
        self.group = group
        for name in self.NAMES:
            original = getattr(dist, name)
            self._originals[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                group = kwargs.get("group", args[2] if len(args) > 2 else None)
                if group is not None and group is self.group:
                    # the tensor sent: all_reduce's first, the others' input (second)
                    key = {"all_reduce": "tensor", "reduce_scatter_tensor": "input",
                           "all_gather_into_tensor": "input_tensor"}[_name]
                    pos = 0 if _name == "all_reduce" else 1
                    t = kwargs[key] if key in kwargs else args[pos]
                    self.calls[_name] += 1
                    self.bytes[_name] += t.numel() * t.element_size()
                    self.shapes.append((_name, tuple(t.shape), str(t.dtype)))
                    if self.record:
                        self.recorded.append((_name, t.detach().clone(), t))
                return _original(*args, **kwargs)

            setattr(dist, name, wrapper)

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals = {}


def tokens(step: int, micro: int, dp_rank: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + dp_rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)


def build(case: str):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    instances = 1 if case == "ddp" else 2
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=instances)
    model_parallel_cpu_manual_seed(SEED, 0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32,
                               gradient_accumulation_fusion=False, bias_activation_fusion=False,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    if case.startswith("hsdp-"):
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, use_distributed_optimizer=True,
            data_parallel_sharding_strategy=case[len("hsdp-"):],
            num_distributed_optimizer_instances=2, outer_dp_sharding_strategy="no_shard",
            overlap_grad_reduce=True, overlap_param_gather=True,
            gradient_reduce_div_fusion=False, average_in_collective=False,
            grad_reduce_in_fp32=True, bucket_size=None)
        wrapped = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                           device=torch.device("cpu"))
    else:
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=instances > 1,
            num_distributed_optimizer_instances=instances,
            overlap_grad_reduce=False, grad_reduce_in_fp32=True)
        wrapped = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    return wrapped, config


def full_weights(model) -> dict:
    """Every parameter of the module, whole: a Megatron-FSDP DTensor's local pieces (each
    rank's rows of it, in inner-DP rank order) gathered over this rank's instance only, so
    that the two instances' copies can be compared with each other."""
    from megatron.core import parallel_state

    inner = parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                 partial_data_parallel=True)
    out = {}
    buffer = getattr(model, "param_and_grad_buffer", None)
    # Megatron-FSDP: its optimizer's parameters (DTensors of the main weights); the module's
    # own parameters are views of freed all-gather buckets between steps
    named = buffer.optimizer_named_parameters if hasattr(buffer, "optimizer_named_parameters") \
        else model.module.named_parameters()
    for name, p in named:
        t = p.detach()
        if hasattr(t, "to_local") and not any(pl.is_shard() for pl in t.placements):
            t = t.to_local()   # replicated over the whole mesh (inner no_shard)
        elif hasattr(t, "to_local"):
            pieces = [None] * dist.get_world_size(inner)
            dist.all_gather_object(pieces, t.to_local().clone(), group=inner)
            t = torch.cat([x.reshape(-1) for x in pieces]).view(p.shape)
        out[name.removeprefix("module.")] = t.clone()
    return out


def fsdp_layout(model) -> list:
    """Per Megatron-FSDP bucket (parameter group) with a gradient buffer: what the outer
    all-reduce sends (``main_grad_buffer.data``) and where each parameter sits in it."""
    buffer = model.param_and_grad_buffer
    out = []
    for bucket_id, group in enumerate(buffer.parameter_groups):
        gbuf = group.main_grad_buffer
        if gbuf is None:
            continue
        shard = gbuf.shard_bucket_index
        out.append({
            "bucket_id": bucket_id,
            "params": [buffer.param_to_name[p].removeprefix("module.") for p in gbuf.params],
            "items": [(gbuf.item_index_map[i].global_data_index, gbuf.item_index_map[i].size,
                       tuple(gbuf.item_index_map[i].shape)) for i in range(len(gbuf.params))],
            "bucket_size": gbuf.bucket_index.size, "distributed": gbuf.is_data_distributed,
            "shard_start": shard.bucket_data_index, "shard_size": shard.size,
            "data_numel": gbuf.data.numel(), "chunk_size_factor": group.chunk_size_factor,
            "inner_rank": gbuf.dp_rank, "inner_size": gbuf.dp_world_size,
            "inner_members": dist.get_process_group_ranks(gbuf.data_parallel_group),
            "data_ptr": gbuf.data.data_ptr()})
    return out


def run_case(case: str, out_dir: str, steps: int, micro_batches: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, config = build(case)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0,
                        use_distributed_optimizer=case != "ddp", bf16=False, fp16=False),
        [model])
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    dp_rank = parallel_state.get_data_parallel_rank()
    outer = parallel_state.get_inter_distributed_optimizer_instance_group(check_initialized=False) \
        if case != "ddp" else None
    counter = OuterCounter()
    if outer is not None:
        counter.install(outer)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        ids, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(ids)
        losses = model(ids, position_ids, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach().clone()}

        return losses, loss_func

    initial = full_weights(model) if case == "ddp" else {}
    losses, first_grads, outer_sent, outer_reduced, outer_ptrs = [], {}, [], [], []
    try:
        for step in range(steps):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            counter.record = step == 0
            data = iter([tokens(step, m, dp_rank) for m in range(micro_batches)])
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=model,
                num_microbatches=micro_batches, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                forward_only=False)
            if step == 0:
                # the outer hop's tensors as sent and as reduced (finish_grad_sync has run),
                # from the first step, where every case starts from the same weights
                outer_sent = [sent for _, sent, _ in counter.recorded]
                outer_reduced = [t.detach().clone() for _, _, t in counter.recorded]
                outer_ptrs = [t.data_ptr() for _, _, t in counter.recorded]
                if case == "ddp":   # plain DDP: every reduced gradient whole on every rank
                    first_grads = {n.removeprefix("module."): p.main_grad.detach().clone()
                                  for n, p in model.module.named_parameters()}
            ok, grad_norm, _ = optimizer.step()
            assert ok
            losses.append(float(sum(o["lm loss"] for o in out) / len(out)))
    finally:
        counter.uninstall()
    weights = full_weights(model)
    os.makedirs(out_dir, exist_ok=True)
    torch.save({"rank": dist.get_rank(), "dp_rank": dp_rank, "losses": losses,
                "weights": weights, "initial_weights": initial,
                "outer_calls": counter.calls, "outer_bytes": counter.bytes,
                "outer_shapes": counter.shapes,
                "outer_members": dist.get_process_group_ranks(outer) if outer else None,
                "outer_sent": outer_sent, "outer_reduced": outer_reduced,
                "outer_ptrs": outer_ptrs,
                "first_grads": first_grads,
                "layout": fsdp_layout(model) if case.startswith("hsdp-") else None,
                "params": {n.removeprefix("module."): tuple(p.shape)
                           for n, p in model.module.named_parameters()}},
               os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))


def main() -> None:
    cases, out_dir = sys.argv[1].split(","), sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    micro_batches = int(sys.argv[4]) if len(sys.argv) > 4 else MICRO_BATCHES
    apply_cpu_shims()
    if any(c.startswith("hsdp-") for c in cases):
        from megatron_edgc.patches.fsdp_cpu import apply_fsdp_cpu_shims

        apply_fsdp_cpu_shims()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    for case in cases:
        torch.manual_seed(0)
        name, _, mb = case.partition(":mb")
        run_case(name, os.path.join(out_dir, case), steps, int(mb) if mb else micro_batches)
        parallel_state.destroy_model_parallel()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
