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
