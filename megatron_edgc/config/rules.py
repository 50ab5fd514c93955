"""The rules between sections: :func:`validate_edgc`, the one entry both front-ends call
for EDGC's flags against the run, and :func:`check_run_layout`, the trainer's parallel
layout and batch rules (Megatron-LM checks its own)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from megatron_edgc.config.knobs import ConfigError, check_ranges

if TYPE_CHECKING:
    from megatron_edgc.config.run import RunConfig


def validate_edgc(cfg: "RunConfig", shapes: Optional[Sequence[tuple]] = None) -> None:
    """Check the ``--edgc-*`` values of ``cfg`` and every rule between them and the run;
    fill their derived defaults (r_min, PP r_min). Raises :class:`ConfigError`.

    Both front-ends call this: the trainer's :meth:`RunConfig.validate` and the plug-in's
    ``megatron_lm.flags.run_config``, whose ``cfg.parallel`` holds Megatron-LM's values.
    ``shapes`` (every parameter shape of the model, all stages): also the rule that the
    ranks in force compress something, which fills ``cfg.compression_notes``, the start-up
    summary's lines; the trainer passes the shapes it predicts once its tokenizer is read
    (:mod:`~megatron_edgc.config.run_inputs`), the plug-in the real ones once the model
    exists.
    """
    e, p = cfg.edgc, cfg.parallel
    check_ranges(e)
    e.resolve()
    if e.budget_weight == "adam" and p.use_distributed_optimizer:
        raise ConfigError("--edgc-budget-weight", "adam reads each parameter's whole "
                                                  "second moment; the distributed "
                                                  "optimizer shards it (drop "
                                                  "--use-distributed-optimizer or use "
                                                  "elements)")
    if e.link_latency_ms is not None and e.link_gbps is None:
        raise ConfigError("--edgc-link-latency-ms", "declares the latency of a declared "
                                                    "link: needs --edgc-link-gbps")
    if e.pp_compression != "off" and p.pipeline_model_parallel_size < 2:
        raise ConfigError("--edgc-pp-compression", f"compresses pipeline sends: needs "
                                                   f"--pipeline-model-parallel-size >= 2, got "
                                                   f"{p.pipeline_model_parallel_size}")
    if shapes is not None:
        cfg.compression_notes = _check_compression_ranks(cfg, list(shapes))


def _check_compression_ranks(cfg: "RunConfig", shapes: list) -> list:
    """A rank at which nothing of this model compresses trains dense while the user
    believes compression is on: an error for the ranks in force (static DP rank, r_min,
    PP ranks), a note for an r_max the controller clamps or leaves (EDGC mode). Returns
    the notes."""
    from megatron_edgc.model_shapes import (activation_grad_max_rank, compressibility,
                                            largest_compressing_rank)

    e, notes = cfg.edgc, []
    rate = e.min_compression_rate
    top = largest_compressing_rank(shapes, rate)
    rule = (f"a matrix n x m compresses at rank r when r < min(n, m) and (n + m) r x "
            f"{rate:g} <= n m (--edgc-min-compression-rate)")

    def share(rank: int) -> str:
        c = compressibility(shapes, rank, rate)
        return (f"at rank {rank} {c.compressible} of {c.matrices} weight matrices compress "
                f"({100 * c.byte_share:.1f} % of the gradient bytes)")

    def refuse(flag: str, rank: int) -> None:
        raise ConfigError(flag, f"no weight matrix of this model compresses at rank {rank} "
                                f"({rule}); the largest rank at which one does is {top}")

    if e.mode == "static":
        if compressibility(shapes, e.rank, rate).compressible == 0:
            refuse("--edgc-rank", e.rank)
        notes.append(f"DP compression (static): {share(e.rank)}")
    elif e.mode == "edgc":
        if compressibility(shapes, e.rank_min, rate).compressible == 0:
            refuse("--edgc-rank-min", e.rank_min)
        note = (f"DP compression (edgc): r_max: {share(e.rank_max)}; "
                f"r_min: {share(e.rank_min)}")
        if compressibility(shapes, e.rank_max, rate).compressible == 0:
            note += (f"; warning: nothing compresses at --edgc-rank-max {e.rank_max} "
                     f"(largest compressing rank {top})")
        notes.append(note)
    if e.pp_compression != "off":
        limit = activation_grad_max_rank(cfg.model, cfg.training.micro_batch_size)
        full = min(cfg.model.seq_length * cfg.training.micro_batch_size,
                   cfg.model.hidden_size)
        flag, rank = ("--edgc-pp-rank", e.pp_rank) if e.pp_compression == "static" else \
            ("--edgc-pp-rank-max", e.pp_rank_max)
        if rank > full:
            raise ConfigError(flag, f"{rank} exceeds the full rank {full} of a backward "
                                    f"activation gradient (sequence x micro-batch rows, "
                                    f"hidden columns); ranks up to {limit} save bytes")
        note = f"PP compression ({e.pp_compression}): backward sends at rank " + (
            f"{e.pp_rank}" if e.pp_compression == "static" else
            f"{e.pp_rank_min}..{e.pp_rank_max}") + f" (ranks up to {limit} save bytes)"
        if rank > limit:
            note += (f"; warning: at {flag} {rank} a send is no smaller than dense (full "
                     f"rank {full} reproduces dense exactly)")
        notes.append(note)
    return notes


def check_run_layout(cfg: "RunConfig") -> None:
    """The trainer's rules between model, parallel layout, batch and precision."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, \
        p.data_parallel_size
    if m.num_attention_heads % tp:
        raise ConfigError("--num-attention-heads", f"must be divisible by "
                                                   f"--tensor-model-parallel-size ({m.num_attention_heads} % {tp} != 0)")
    if m.ffn_hidden_size % tp:
        raise ConfigError("--ffn-hidden-size", f"must be divisible by "
                                               f"--tensor-model-parallel-size ({m.ffn_hidden_size} % {tp} != 0)")
    vp = p.virtual_pipeline_model_parallel_size
    if vp is not None:
        if pp < 2:
            raise ConfigError("--virtual-pipeline-model-parallel-size",
                              "needs --pipeline-model-parallel-size >= 2")
        if m.num_layers % (pp * vp):
            raise ConfigError("--num-layers", f"must be divisible by PP x virtual stages "
                                              f"({pp} x {vp}); got {m.num_layers}")
    elif m.num_layers % pp:
        raise ConfigError("--num-layers", f"must be divisible by "
                                          f"--pipeline-model-parallel-size ({pp}); got {m.num_layers}")
    if p.distributed_backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--distributed-backend", "nccl needs CUDA devices and this "
                                                       "machine has none: use gloo (the "
                                                       "default without CUDA)")
    ep = p.expert_model_parallel_size
    if ep > 1 and m.num_experts is None:
        raise ConfigError("--expert-model-parallel-size", f"splits MoE experts: needs "
                                                          f"--num-experts; got EP {ep}")
    if ep > 1 and dp % ep:
        raise ConfigError("--expert-model-parallel-size", f"must divide the DP size "
                                                          f"({dp}); got {ep}")
    if m.num_experts is not None and m.num_experts % ep:
        raise ConfigError("--num-experts", f"must be divisible by "
                                           f"--expert-model-parallel-size ({ep}); got "
                                           f"{m.num_experts}")
    check_megatron_fsdp(cfg)
    instances = p.num_distributed_optimizer_instances
    if instances > 1 and not p.use_distributed_optimizer:
        raise ConfigError("--num-distributed-optimizer-instances",
                          f"shards the distributed optimizer: needs "
                          f"--use-distributed-optimizer; got {instances}")
    if instances > 1 and dp % instances:
        raise ConfigError("--num-distributed-optimizer-instances",
                          f"must divide the DP size ({dp}); got {instances}")
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError("--global-batch-size",
                          f"must be a multiple of micro batch x DP = {t.micro_batch_size} x {dp}"
                          f" = {t.micro_batch_size * dp}; got {t.global_batch_size}")
    if pp > 1 and cfg.num_microbatches < pp:
        raise ConfigError("--global-batch-size",
                          f"gives {cfg.num_microbatches} micro-batches per iteration; 1F1B "
                          f"needs at least PP = {pp} (raise it to >= "
                          f"{pp * t.micro_batch_size * dp})")
    if vp is not None and cfg.num_microbatches % pp:
        raise ConfigError("--global-batch-size",
                          f"interleaved 1F1B needs the micro-batch count "
                          f"({cfg.num_microbatches}) to be a multiple of PP ({pp})")
    if t.grad_reduce_in_bf16 and (cfg.bf16_by_cpu or not cfg.bf16_resolved):
        raise ConfigError("--grad-reduce-in-bf16", "reduces the bf16 gradients of bf16 "
                                                   "mixed precision: needs --bf16 (on a CPU "
                                                   "an unset --bf16 is chosen at start-up "
                                                   "by measured speed: set it)")
    if p.overlap_grad_reduce and p.bucket_size is not None and p.bucket_size < 1:
        raise ConfigError("--bucket-size", "must be >= 1")


#: Megatron-FSDP's inner sharding strategies the trainer runs (and the outer-hop
#: compression reads): :data:`megatron_edgc.patches.fsdp_outer.INNER_STRATEGIES`.
FSDP_INNER_STRATEGIES = ("no_shard", "optim_grads_params")


def check_megatron_fsdp(cfg: "RunConfig") -> None:
    """``--use-megatron-fsdp``: the trainer runs Megatron-FSDP as HSDP only, in the form
    tested on CPU (docs/megatron-fsdp-cpu.md), and compresses its outer hop with
    :class:`~megatron_edgc.patches.fsdp_outer.FSDPOuterCompression`; what that class refuses
    and what no test ran is refused here by name, before any process group."""
    import torch

    m, p, t, e, ck = cfg.model, cfg.parallel, cfg.training, cfg.edgc, cfg.checkpoint
    if not p.use_megatron_fsdp:
        for flag, value in (("--data-parallel-sharding-strategy",
                             p.data_parallel_sharding_strategy),
                            ("--outer-dp-sharding-strategy", p.outer_dp_sharding_strategy)):
            if value != "no_shard":
                raise ConfigError(flag, f"is Megatron-FSDP's: needs --use-megatron-fsdp "
                                        f"(got {value})")
        return
    inner = p.data_parallel_sharding_strategy
    if inner not in FSDP_INNER_STRATEGIES:
        raise ConfigError("--data-parallel-sharding-strategy",
                          f"{inner}: not yet (no test ran it, and the outer-hop compression "
                          f"reads only the buffer layouts of "
                          f"{' and '.join(FSDP_INNER_STRATEGIES)}); allowed: "
                          f"{', '.join(FSDP_INNER_STRATEGIES)}")
    if p.outer_dp_sharding_strategy != "no_shard":
        raise ConfigError("--outer-dp-sharding-strategy",
                          f"{p.outer_dp_sharding_strategy}: not yet (the outer hop EDGC "
                          f"compresses is no_shard's all-reduce across instances); allowed: "
                          f"no_shard")
    instances, dp = p.num_distributed_optimizer_instances, p.data_parallel_size
    if instances < 2:
        raise ConfigError("--num-distributed-optimizer-instances",
                          f"with --use-megatron-fsdp the trainer runs HSDP only: needs >= 2 "
                          f"instances dividing the DP size ({dp}); got {instances} (plain "
                          f"FSDP: not yet)")
    if dp % instances:
        raise ConfigError("--num-distributed-optimizer-instances",
                          f"must divide the DP size ({dp}); got {instances}")
    if not p.use_distributed_optimizer:
        raise ConfigError("--use-megatron-fsdp", "needs --use-distributed-optimizer "
                                                 "(megatron-core's optimizer over "
                                                 "Megatron-FSDP's sharded main weights)")
    if p.tensor_model_parallel_size > 1 or p.pipeline_model_parallel_size > 1:
        raise ConfigError("--use-megatron-fsdp",
                          f"not yet with TP {p.tensor_model_parallel_size} x PP "
                          f"{p.pipeline_model_parallel_size} (tested: TP1 PP1, DP only)")
    if not p.overlap_grad_reduce:
        raise ConfigError("--overlap-grad-reduce",
                          "Megatron-FSDP needs it on here: its synchronous path "
                          "(all_reduce_gradients) is not the pipeline the outer hop's "
                          "compression wraps, and in megatron-core 0.16.1 it skips every "
                          "buffer; pass --overlap-grad-reduce")
    if m.num_experts is not None:
        raise ConfigError("--num-experts", "not yet with --use-megatron-fsdp (expert "
                                           "parameters reduce over their own data-parallel "
                                           "group, which the outer-hop compression refuses)")
    if t.fp16:
        raise ConfigError("--fp16", "not yet with --use-megatron-fsdp (no test ran "
                                    "Megatron-FSDP with fp16's loss scaler); allowed: fp32 "
                                    "(--no-bf16)")
    if t.bf16 is not False:
        raise ConfigError("--bf16", f"{'set' if t.bf16 else 'unset (bf16 on CUDA; timed on a CPU)'}"
                                    f": not yet with --use-megatron-fsdp (no test ran "
                                    f"Megatron-FSDP with bf16 parameters); allowed: fp32, "
                                    f"pass --no-bf16")
    if e.mode == "edgc":
        raise ConfigError("--edgc-mode", "edgc: not yet with --use-megatron-fsdp (EDGC's "
                                         "controller sets ranks per matrix shape, reads the "
                                         "spectrum and the budget through the DDP patch; the "
                                         "outer-hop compression takes one static rank); "
                                         "allowed: off, static")
    if e.mode == "static":
        if e.bypass != "off":
            raise ConfigError("--edgc-bypass", f"{e.bypass}: not yet with --use-megatron-fsdp "
                                               f"(the outer hop has no link model: every "
                                               f"bucket compresses); allowed: off")
        if e.dense_wire != "grad":
            raise ConfigError("--edgc-dense-wire", f"{e.dense_wire}: not yet with "
                                                   f"--use-megatron-fsdp (the outer hop's "
                                                   f"dense rest travels in the gradient "
                                                   f"buffer's dtype); allowed: grad")
        for flag, value in (("--edgc-link-gbps", e.link_gbps),
                            ("--edgc-debug-dump", e.debug_dump)):
            if value is not None:
                raise ConfigError(flag, "not yet with --use-megatron-fsdp")
        if e.check_replicas:
            raise ConfigError("--edgc-check-replicas", "not yet with --use-megatron-fsdp "
                                                       "(the digest reads DDP's buckets)")
    for flag, value in (("--save", ck.save), ("--load", ck.load)):
        if value is not None:
            why = ("Megatron-FSDP's own checkpoint (fsdp_dtensor) gathers uneven shards, "
                   "which gloo's all-gather refuses (docs/megatron-fsdp-cpu.md)"
                   if not torch.cuda.is_available() else
                   "the trainer's checkpoint is written for DDP's buffers and Megatron-FSDP's "
                   "own (fsdp_dtensor) is not wired")
            raise ConfigError(flag, f"not yet with --use-megatron-fsdp: {why}; train "
                                    f"without --save/--load")
