"""The plug-in's ``--edgc-*`` flags in Megatron-LM's parser, and the validated
:class:`~megatron_edgc.config.RunConfig` built from Megatron-LM's ``args``: the same
names, defaults, ranges and one-line errors as this project's trainer."""

from __future__ import annotations

import argparse
import sys
import dataclasses

from megatron_edgc.config import (ConfigError, EdgcConfig, RunConfig, add_knob_arguments,
                                  check_writable, validate_edgc)
from megatron_edgc.config.rules import check_megatron_fsdp

#: Checkpoint formats whose iteration directory and ``latest`` pointer the EDGC state
#: follows (docs/megatron-lm-seams.md §3); ``--async-save`` included.
CKPT_FORMATS = ("torch", "torch_dist")

#: Megatron-LM's ``--rerun-mode`` values that run an iteration's forward and backward again
#: (its rerun state machine, core_v0.16.1 and core_v0.19.0 alike), and when.
RERUN_MODES = {
    "validate_results": "Megatron-LM's default: again after a failed check of the loss "
                        "(NaN, Inf, --check-for-spiky-loss, --error-injection-rate), then "
                        "again from the checkpoint it saves",
    "report_stats": "every iteration twice",
}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the ``--edgc-*`` flags, in the trainer's
    groups (EDGC method, controller, diagnostics); returns the parser."""
    groups = add_knob_arguments(parser, EdgcConfig, title="EDGC",
                                dest=lambda f: f"edgc_{f.name}", default=lambda f: f.default)
    groups["diagnostics"].add_argument(
        "--edgc-metrics-file", default=None,
        help="JSONL file, one EDGC record per iteration (logging rank)")
    groups["diagnostics"].add_argument(
        "--edgc-allow-untested-megatron", action="store_true",
        help="run on a megatron-core version the patches were not tested with")
    return parser


def chain(*providers):
    """Several ``extra_args_provider``s as one (e.g. ``chain(add_modelopt_args, add_args)``)."""
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser
    return provider


def run_config(args) -> RunConfig:
    """A validated :class:`RunConfig` from Megatron-LM's ``args`` (the ``--edgc-*`` flags
    and the model/parallel/training values EDGC reads). Raises :class:`ConfigError`."""
    if not hasattr(args, "edgc_mode"):
        raise ConfigError("--edgc-mode", "the EDGC flags are not registered: pass "
                                         "extra_args_provider=megatron_edgc.megatron_lm.add_args"
                                         " to pretrain(...)")
    cfg = RunConfig(allow_untested_megatron=args.edgc_allow_untested_megatron)
    for f in dataclasses.fields(EdgcConfig):
        setattr(cfg.edgc, f.name, getattr(args, f"edgc_{f.name}"))
    m, p, t = cfg.model, cfg.parallel, cfg.training
    m.num_layers, m.hidden_size = args.num_layers, args.hidden_size
    m.num_attention_heads, m.ffn_hidden_size = args.num_attention_heads, args.ffn_hidden_size
    m.seq_length, m.max_position_embeddings = args.seq_length, args.max_position_embeddings
    p.tensor_model_parallel_size = args.tensor_model_parallel_size
    p.pipeline_model_parallel_size = args.pipeline_model_parallel_size
    p.data_parallel_size = args.data_parallel_size
    p.virtual_pipeline_model_parallel_size = args.virtual_pipeline_model_parallel_size
    p.overlap_grad_reduce = args.overlap_grad_reduce
    p.use_distributed_optimizer = args.use_distributed_optimizer
    p.num_distributed_optimizer_instances = getattr(args, "num_distributed_optimizer_instances",
                                                    1)
    p.expert_model_parallel_size = getattr(args, "expert_model_parallel_size", 1)
    t.micro_batch_size, t.global_batch_size = args.micro_batch_size, args.global_batch_size
    t.train_iters = args.train_iters or (args.train_samples or 0) // args.global_batch_size
    t.seed = args.seed
    if getattr(args, "use_megatron_fsdp", False):
        _megatron_fsdp_values(args, cfg)
    validate_edgc(cfg)  # the trainer's rules; the shapes' rule once the model exists (seams)
    e = cfg.edgc
    if e.mode == "off" and e.pp_compression == "off":
        return cfg
    if p.use_megatron_fsdp:   # the trainer's rules: HSDP as tested, the rest by name
        check_megatron_fsdp(cfg)
        if not getattr(args, "overlap_param_gather", False):
            raise ConfigError("--overlap-param-gather",
                              "Megatron-FSDP needs it on here: without it megatron-core "
                              "0.16.1's start_param_sync gathers every bucket synchronously "
                              "and fails on inner no_shard (no weight buffer to fetch); pass "
                              "--overlap-param-gather (the trainer sets it)")
        for flag, name in (("--ddp-average-in-collective", "ddp_average_in_collective"),
                           ("--fsdp-double-buffer", "fsdp_double_buffer"),
                           ("--use-nccl-ub", "nccl_ub")):
            if getattr(args, name, False):
                raise ConfigError(flag, "not yet with --use-megatron-fsdp and EDGC on (no "
                                        "test ran it; the trainer leaves it off)")
    _refuse_unsupported(args)
    if args.edgc_metrics_file:
        check_writable("--edgc-metrics-file", args.edgc_metrics_file, is_file=True)
    return cfg


def _megatron_fsdp_values(args, cfg: RunConfig) -> None:
    """``--use-megatron-fsdp``: what the trainer's Megatron-FSDP rules
    (:func:`~megatron_edgc.config.rules.check_megatron_fsdp`) and the runtime's outer-hop
    compression read, from Megatron-LM's ``args``."""
    p, t, ck = cfg.parallel, cfg.training, cfg.checkpoint
    p.use_megatron_fsdp = True
    p.data_parallel_sharding_strategy = getattr(args, "data_parallel_sharding_strategy",
                                                "no_shard")
    p.outer_dp_sharding_strategy = getattr(args, "outer_dp_sharding_strategy", "no_shard")
    cfg.model.num_experts = getattr(args, "num_experts", None)
    t.fp16, t.bf16 = bool(getattr(args, "fp16", False)), bool(getattr(args, "bf16", False))
    ck.save, ck.load = args.save, args.load


def _refuse_unsupported(args) -> None:
    """Megatron-LM features the EDGC seams do not cover, each named by its flag."""
    def refuse(flag: str, why: str):
        raise ConfigError(flag, f"not supported with EDGC compression on ({why})")

    if getattr(args, "use_torch_fsdp2", False):
        refuse("--use-torch-fsdp2", "the patch compresses DDP's buckets and Megatron-FSDP's "
                                    "outer hop (--use-megatron-fsdp)")
    if getattr(args, "moe_grouped_gemm", False) and \
            getattr(args, "transformer_impl", "") != "transformer_engine":
        refuse("--moe-grouped-gemm", "without --transformer-impl transformer_engine Megatron "
                                     "stacks the experts into one parameter; with it each "
                                     "expert is its own weight, compressed as its own matrix")
    import torch

    from megatron_edgc.patches.features import refuse_instances_overlap

    why = refuse_instances_overlap(getattr(args, "num_distributed_optimizer_instances", 1),
                                   args.overlap_grad_reduce, torch.cuda.is_available())
    if why:
        raise ConfigError("--overlap-grad-reduce", why)
    if getattr(args, "non_persistent_save_interval", None):
        refuse("--non-persistent-save-interval", "EDGC state is saved with persistent "
                                                 "checkpoints only")
    if (args.save or args.load) and getattr(args, "ckpt_format", "torch") not in CKPT_FORMATS:
        refuse("--ckpt-format", f"{args.ckpt_format}; use --ckpt-format "
                                f"{' or '.join(CKPT_FORMATS)}")
    if getattr(args, "cuda_graph_impl", "none") not in ("none", None):
        refuse("--cuda-graph-impl", "graphs would skip the per-step hooks")
    if args.edgc_pp_compression != "off" and getattr(args, "rampup_batch_size", None):
        refuse("--rampup-batch-size", "PP compression fixes the micro-batch count")
    mode = getattr(args, "rerun_mode", "disabled")
    mode = getattr(mode, "value", mode)   # the enum, where a script set it so
    if args.edgc_mode == "off" or mode == "disabled":   # the pipeline's senders roll back
        return
    why = (f"{mode} runs an iteration again ({RERUN_MODES.get(mode, 'a re-run')}), which "
           "EDGC would count twice: a DP bucket takes the iteration's gradient into its "
           "residual during the backward, in place, before a re-run is decided")
    if _given("--rerun-mode"):
        raise ConfigError("--rerun-mode", f"{why}; pass --rerun-mode disabled (a NaN or Inf "
                                          f"loss still stops the job)")
    args.rerun_mode = "disabled"   # Megatron-LM's default, not the user's choice
    if getattr(args, "rank", 0) == 0:
        print(f"EDGC: --rerun-mode disabled, as none was given: {why} (a NaN or Inf loss "
              f"still stops the job)", flush=True)


def _given(flag: str, argv=None) -> bool:
    """Whether ``flag`` is on the command line (Megatron-LM's parser takes no
    abbreviations: the flag itself, or ``flag=value``)."""
    return any(a == flag or a.startswith(flag + "=") for a in
               (sys.argv[1:] if argv is None else argv))
