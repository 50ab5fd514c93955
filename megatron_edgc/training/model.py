"""GPT-2 on megatron-core: model chunks, Megatron DDP, Megatron's Adam and LR schedule."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module


def layer_spec(num_experts=None):
    """The transformer-engine layer spec when TE imports, else megatron-core's local one
    (with ``num_experts``: its MoE layer, one parameter per expert)."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import \
            get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts)
    except Exception:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(num_experts=num_experts)


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:  # absent, or built against another torch/CUDA
        return False


def fusions(on_gpu: bool) -> dict:
    """megatron-core's fused paths, each on only where what it needs imports (as
    Megatron-LM users without Apex pass ``--no-masked-softmax-fusion`` and the like);
    all off on CPU. megatron-core imports these kernels at first use, without a fallback:

    * ``masked_softmax_fusion``: the softmax kernels of Apex (or of Megatron-LM's
      ``fused_kernels``): ``scaled_masked_softmax_cuda``,
      ``scaled_upper_triang_masked_softmax_cuda`` (causal masks), ``scaled_softmax_cuda``;
    * ``bias_activation_fusion`` (bias-GeLU), ``bias_dropout_fusion``: functions compiled by
      ``megatron.core.jit.jit_fuser``; ``torch.compile`` (torch >= 2.2) needs ``triton`` on a GPU;
    * ``gradient_accumulation_fusion``: Apex's ``fused_weight_gradient_mlp_cuda`` (the
      output layer is megatron-core's own linear layer, TE spec or not);
    * ``persist_layer_norm``: Apex's ``apex.contrib.layer_norm`` (only Apex's FusedLayerNorm
      has the persistent kernel; the local spec's torch norm refuses the flag).

    RoPE fusion does not apply: the positions are learned.
    """
    from megatron.core import jit

    def needs(*modules: str) -> bool:
        return on_gpu and all(map(_importable, modules))

    compiled = needs("triton") if jit.jit_fuser is torch.compile else needs()
    return dict(
        masked_softmax_fusion=needs("scaled_masked_softmax_cuda",
                                    "scaled_upper_triang_masked_softmax_cuda",
                                    "scaled_softmax_cuda"),
        bias_activation_fusion=compiled,
        bias_dropout_fusion=compiled,
        gradient_accumulation_fusion=needs("fused_weight_gradient_mlp_cuda"),
        persist_layer_norm=needs("apex.contrib.layer_norm.layer_norm"),
    )


def transformer_config(cfg, bf16: bool, on_gpu: bool, fp16: bool = False) -> TransformerConfig:
    m, p = cfg.model, cfg.parallel
    vp = p.virtual_pipeline_model_parallel_size
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    moe = {}
    if m.num_experts is not None:  # Mixtral-style: top-k router, load-balancing loss
        moe = dict(num_moe_experts=m.num_experts, moe_router_topk=m.moe_router_topk,
                   moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
                   expert_model_parallel_size=p.expert_model_parallel_size)
    return TransformerConfig(
        **moe,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        layernorm_epsilon=m.layernorm_epsilon,
        init_method_std=m.init_method_std,
        normalization="LayerNorm",
        activation_func=F.gelu,
        add_bias_linear=True,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=bf16,
        fp16=fp16,
        use_cpu_initialization=not on_gpu,
        sequence_parallel=False,
        **fusions(on_gpu),
        # PP=2 with virtual stages and batched p2p swaps tensors (FINDINGS.md): use
        # Megatron-LM's setting for the interleaved schedule.
        batch_p2p_comm=vp is None,
        overlap_p2p_comm=vp is not None,
        batch_p2p_sync=on_gpu,
        # Freeing a sent activation's storage (``out.data = empty(1)``) is safe under
        # NCCL's stream ordering, but gloo's async isend (the interleaved schedule's
        # overlap_p2p_comm) may still be reading it: measured NaN losses from iteration 2
        # with >= 4 micro-batches. Keep the storage on CPU with virtual stages.
        deallocate_pipeline_outputs=on_gpu or vp is None,
    )


@dataclass
class ModelBundle:
    chunks: list  # DDP- (or Megatron-FSDP-) wrapped model chunks (one per virtual stage)
    optimizer: object
    scheduler: OptimizerParamScheduler
    config: TransformerConfig

    def weights(self) -> list:
        """The weights this rank holds, as plain tensors: each chunk's parameters, or under
        Megatron-FSDP the local pieces of its optimizer's main weights (the module's own
        parameters are views of all-gather buckets freed between steps)."""
        from megatron_edgc.runtime.frontend import local_weights

        return local_weights(self.chunks)


def megatron_fsdp(cfg, tconf: TransformerConfig, module, on_gpu: bool):
    """``module`` under megatron-core's Megatron-FSDP in HSDP mode (the calls
    ``tests/fsdp_hsdp_probe.py`` makes; the config's rules admit only this form: fp32,
    distributed optimizer, overlap on, outer ``no_shard``). On CPU: gloo lacks NCCL's
    premul-sum (``gradient_reduce_div_fusion`` off) and user-buffer registration
    (``nccl_ub`` off), and the Megatron-FSDP CPU shims go on first."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    p = cfg.parallel
    if not on_gpu:
        from megatron_edgc.patches.fsdp_cpu import apply_fsdp_cpu_shims

        apply_fsdp_cpu_shims()
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True,
        data_parallel_sharding_strategy=p.data_parallel_sharding_strategy,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        outer_dp_sharding_strategy=p.outer_dp_sharding_strategy,
        overlap_grad_reduce=True, overlap_param_gather=True,
        gradient_reduce_div_fusion=on_gpu, nccl_ub=False, average_in_collective=False,
        grad_reduce_in_fp32=True, bucket_size=p.bucket_size)
    kwargs = {} if on_gpu else dict(device=torch.device("cpu"))
    return FullyShardedDataParallel(config=tconf, ddp_config=ddp_config, module=module,
                                    **kwargs)


def build_model_and_optimizer(cfg, padded_vocab_size: int, bf16: bool, on_gpu: bool) -> ModelBundle:
    """The model chunks in DDP and megatron-core's optimizer; with ``--fp16`` (which
    excludes ``bf16``) its fp16 optimizer and loss scaler, dynamic unless ``--loss-scale``."""
    t = cfg.training
    fp16 = t.fp16
    tconf = transformer_config(cfg, bf16, on_gpu, fp16=fp16)
    vp = cfg.parallel.virtual_pipeline_model_parallel_size
    spec = layer_spec(cfg.model.num_experts)
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        model = GPTModel(
            config=tconf,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size,
            max_sequence_length=cfg.model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp is None,
                                                                vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp is None,
                                                                vp_stage=stage),
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
            vp_stage=stage,
        )
        if on_gpu:
            model.cuda(torch.cuda.current_device())
        if bf16 or fp16:
            # As Megatron-LM's get_model: every parameter in bf16/fp16 (the local spec's
            # torch LayerNorm included), first-stage inputs cast in, losses cast out.
            model = Float16Module(tconf, model)
        chunks.append(model)

    if cfg.parallel.use_megatron_fsdp:
        chunks = [megatron_fsdp(cfg, tconf, chunk, on_gpu) for chunk in chunks]
    else:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=(bf16 and not t.grad_reduce_in_bf16) or
            cfg.fp16_grads_in_fp32,
            overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
            bucket_size=cfg.parallel.bucket_size,
            num_distributed_optimizer_instances=cfg.parallel.num_distributed_optimizer_instances,
        )
        chunks = [DistributedDataParallel(config=tconf, ddp_config=ddp_config, module=chunk,
                                          disable_bucketing=i > 0)
                  for i, chunk in enumerate(chunks)]

    opt_config = OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, bf16=bf16, fp16=fp16, params_dtype=tconf.params_dtype,
        loss_scale=t.loss_scale, initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale, loss_scale_window=t.loss_scale_window,
        hysteresis=t.hysteresis,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters, lr_decay_steps=t.lr_decay_iters,
        lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=t.train_iters, wd_incr_style="constant")
    return ModelBundle(chunks, optimizer, scheduler, tconf)


def count_parameters(cfg, padded_vocab_size: int) -> int:
    """GPT-2 parameter count of the whole model (tied embeddings), from the shapes."""
    m = cfg.model
    h, f, L = m.hidden_size, m.ffn_hidden_size or 4 * m.hidden_size, m.num_layers
    per_layer = (2 * h            # input layernorm
                 + 3 * h * h + 3 * h  # QKV
                 + h * h + h      # attention projection
                 + 2 * h          # pre-MLP layernorm
                 + h * f + f      # fc1
                 + f * h + h)     # fc2
    embeddings = padded_vocab_size * h + (m.max_position_embeddings or m.seq_length) * h
    return L * per_layer + embeddings + 2 * h  # + final layernorm
