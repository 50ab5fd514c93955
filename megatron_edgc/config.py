"""Validated run configuration: one dataclass per concern, YAML sections and flags 1:1.

Every field is a knob with a default, a help line and (where it has one) a range. The
YAML file has one section per dataclass (``model:``, ``parallel:``, ...) whose keys are
the field names; each field is also a Megatron-style flag (``num_layers`` is
``--num-layers``). Precedence: dataclass default < YAML < command line.

Validation (:meth:`RunConfig.validate`) checks values only; the files a run reads and
writes are checked at run start (:func:`check_run_inputs`). :func:`parse_config`, the
trainer's entry, does both, in one process, before any process group exists; every error
is a :class:`ConfigError` whose message starts with the flag it is about.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence

import numpy
import yaml


# ---------------------------------------------------------------------- knobs


class ConfigError(ValueError):
    """A bad configuration value; ``str()`` is one line that starts with the flag."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


def knob(default: Any, help: str, *, min: Optional[float] = None, max: Optional[float] = None,
         choices: Optional[tuple] = None, min_exclusive: bool = False,
         group: Optional[str] = None):
    """A dataclass field carrying its help text and allowed range; ``group``: the key of
    the section's ``GROUPS`` entry its flag is listed under (sections that have them)."""
    return field(default=default, metadata=dict(help=help, min=min, max=max, choices=choices,
                                                min_exclusive=min_exclusive, group=group))


def flag_of(name: str, section=None) -> str:
    """``num_layers`` -> ``--num-layers``; a section may prefix its flags (``--edgc-rank``)."""
    prefix = getattr(section, "FLAG_PREFIX", "") if section is not None else ""
    return "--" + (prefix + name).replace("_", "-")


def base_type(tp) -> type:
    """int for ``Optional[int]``, etc."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # annotations are strings under __future__
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def check_ranges(section) -> None:
    """Apply every field's declared type, range and choices (integral numbers become int)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if value is None:
            continue
        meta, flag = f.metadata, flag_of(f.name, section)
        base = base_type(f.type)
        if base is bool and not isinstance(value, bool):
            raise ConfigError(flag, f"must be true or false (got {value!r})")
        if base in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                     or (base is int and not float(value).is_integer())):
            raise ConfigError(flag, f"must be {'an integer' if base is int else 'a number'} "
                                    f"(got {value!r})")
        if base is float and not math.isfinite(value):
            raise ConfigError(flag, f"must be a finite number (got {value})")
        if base is int:
            setattr(section, f.name, int(value))
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise ConfigError(flag, f"must be one of {', '.join(map(str, meta['choices']))} "
                                    f"(got {value!r})")
        lo, hi = meta.get("min"), meta.get("max")
        if lo is not None and (value <= lo if meta.get("min_exclusive") else value < lo):
            rng = f"({lo}, {hi if hi is not None else 'inf'}]" if meta.get("min_exclusive") else \
                  f"[{lo}, {hi if hi is not None else 'inf'}]"
            raise ConfigError(flag, f"must be in {rng} (got {value})")
        if hi is not None and value > hi:
            raise ConfigError(flag, f"must be in [{lo if lo is not None else '-inf'}, {hi}] "
                                    f"(got {value})")


# ---------------------------------------------------------------------- sections


@dataclass
class ModelConfig:
    """GPT-2 architecture: learned absolute positions, GeLU, LayerNorm, tied embeddings."""

    num_layers: int = knob(4, "number of transformer layers", min=1)
    hidden_size: int = knob(128, "hidden size", min=1)
    num_attention_heads: int = knob(4, "attention heads", min=1)
    ffn_hidden_size: Optional[int] = knob(None, "MLP hidden size (default 4 x hidden size)", min=1)
    seq_length: int = knob(128, "training sequence length in tokens", min=2)
    max_position_embeddings: Optional[int] = knob(
        None, "learned position table size (default: seq length)", min=1)
    hidden_dropout: float = knob(0.1, "dropout after attention and MLP", min=0.0, max=1.0)
    attention_dropout: float = knob(0.1, "dropout on attention probabilities", min=0.0, max=1.0)
    init_method_std: float = knob(0.02, "std of the normal weight init", min=0.0,
                                  min_exclusive=True)
    layernorm_epsilon: float = knob(1e-5, "LayerNorm epsilon", min=0.0, min_exclusive=True)
    make_vocab_size_divisible_by: int = knob(
        128, "pad the vocabulary to a multiple of this (times TP), as Megatron does", min=1)
    num_experts: Optional[int] = knob(
        None, "MoE: expert MLPs per layer behind a top-k router (megatron-core's MoE layer, "
              "alltoall dispatcher); unset = the dense GPT-2 MLP", min=2)
    moe_router_topk: int = knob(2, "MoE: experts each token is sent to", min=1)

    def resolve(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.seq_length > self.max_position_embeddings:
            raise ConfigError("--seq-length", f"must be <= --max-position-embeddings "
                                              f"({self.max_position_embeddings}), got {self.seq_length}")
        if self.num_experts is not None and self.moe_router_topk > self.num_experts:
            raise ConfigError("--moe-router-topk", f"must be <= --num-experts "
                                                   f"({self.num_experts}), got "
                                                   f"{self.moe_router_topk}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("--hidden-size", f"must be divisible by --num-attention-heads "
                                               f"({self.hidden_size} % {self.num_attention_heads} != 0)")


@dataclass
class ParallelConfig:
    """The TP x PP x DP layout and Megatron DDP options."""

    tensor_model_parallel_size: int = knob(1, "tensor-parallel size (TP)", min=1)
    pipeline_model_parallel_size: int = knob(1, "pipeline-parallel size (PP)", min=1)
    data_parallel_size: Optional[int] = knob(
        None, "data-parallel size (DP); default: world size / (TP x PP)", min=1)
    virtual_pipeline_model_parallel_size: Optional[int] = knob(
        None, "model chunks per pipeline stage (interleaved 1F1B); unset = plain 1F1B", min=1)
    expert_model_parallel_size: int = knob(
        1, "MoE: expert-parallel size (EP): the experts are split over this many DP ranks, "
           "each expert reduced over DP / EP replicas", min=1)
    num_distributed_optimizer_instances: int = knob(
        1, "Megatron's partial distributed optimizer: DP split into this many instances; "
           "gradients are reduce-scattered inside an instance (the fast hop) and each shard "
           "all-reduced across instances (the slow hop, the one EDGC compresses)", min=1)
    overlap_grad_reduce: bool = knob(False, "launch each DP bucket's reduction during backward")
    use_distributed_optimizer: bool = knob(False, "shard optimizer state over DP (ZeRO-1)")
    bucket_size: Optional[int] = knob(None, "DDP bucket size in elements (default: Megatron's)",
                                      min=1)
    distributed_backend: Optional[str] = knob(
        None, "process-group backend (default: nccl with CUDA, gloo without)",
        choices=("nccl", "gloo"))
    master_port: Optional[int] = knob(
        None, "rendezvous port for a plain local launch (default: a free port)", min=1, max=65535)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def resolve(self, world_size: Optional[int]) -> None:
        """Fix DP from the world size (external launch) or the world size from DP (local)."""
        mp = self.model_parallel_size
        if world_size is None:  # plain launch: we spawn TP x PP x DP processes
            if self.data_parallel_size is None:
                self.data_parallel_size = 1
            return
        if self.data_parallel_size is None:
            if world_size % mp:
                raise ConfigError("--tensor-model-parallel-size",
                                  f"TP x PP = {mp} does not divide the world size {world_size}")
            self.data_parallel_size = world_size // mp
        if mp * self.data_parallel_size != world_size:
            raise ConfigError("--data-parallel-size",
                              f"TP x PP x DP = {self.tensor_model_parallel_size} x "
                              f"{self.pipeline_model_parallel_size} x {self.data_parallel_size} = "
                              f"{mp * self.data_parallel_size} != world size {world_size}")

    @property
    def world_size(self) -> int:
        return self.model_parallel_size * (self.data_parallel_size or 1)


@dataclass
class TrainingConfig:
    """Batches, iterations and Megatron's Adam with warm-up + cosine LR."""

    micro_batch_size: int = knob(4, "sequences per micro-batch per DP rank", min=1)
    global_batch_size: int = knob(16, "sequences per iteration over all DP ranks", min=1)
    train_iters: int = knob(200, "training iterations (sets the LR schedule and data size)", min=1)
    exit_interval: Optional[int] = knob(
        None, "stop (after saving, with --save) once the iteration is a multiple of this", min=1)
    lr: float = knob(1e-3, "peak learning rate", min=0.0)
    min_lr: float = knob(1e-4, "final learning rate of the decay", min=0.0)
    lr_warmup_iters: int = knob(20, "linear LR warm-up iterations", min=0)
    lr_decay_iters: Optional[int] = knob(None, "LR decay length (default: --train-iters)", min=1)
    lr_decay_style: str = knob("cosine", "LR decay after warm-up",
                               choices=("cosine", "linear", "constant"))
    weight_decay: float = knob(0.01, "AdamW weight decay", min=0.0)
    clip_grad: float = knob(1.0, "gradient clipping by global norm (0 = off)", min=0.0)
    adam_beta1: float = knob(0.9, "Adam beta1", min=0.0, max=1.0)
    adam_beta2: float = knob(0.95, "Adam beta2", min=0.0, max=1.0)
    adam_eps: float = knob(1e-8, "Adam epsilon", min=0.0, min_exclusive=True)
    seed: int = knob(1234, "random seed (model init, dropout, data order)", min=0)
    bf16: Optional[bool] = knob(None, "bf16 mixed precision (default: on with CUDA, off on CPU)")
    grad_reduce_in_bf16: bool = knob(
        False, "keep and reduce the gradients in bf16, as Megatron-LM's --grad-reduce-in-bf16 "
               "(megatron-core grad_reduce_in_fp32=False): half the dense bytes; needs --bf16. "
               "EDGC compresses the bf16 buffers with fp32 math")

    def resolve(self) -> None:
        if self.lr_decay_iters is None:
            self.lr_decay_iters = self.train_iters
        if self.min_lr > self.lr:
            raise ConfigError("--min-lr", f"must be <= --lr ({self.lr}), got {self.min_lr}")
        if self.lr_warmup_iters >= self.lr_decay_iters:
            raise ConfigError("--lr-warmup-iters", f"must be < --lr-decay-iters "
                                                   f"({self.lr_decay_iters}), got {self.lr_warmup_iters}")


@dataclass
class DataConfig:
    """A Megatron indexed dataset (.bin/.idx) and its tokenizer."""

    data_path: Optional[str] = knob(
        None, "prefix of the .bin/.idx made by scripts/prepare_data.py")
    split: str = knob("949,50,1", "train,valid,test weights of the document split")
    tokenizer_type: str = knob("GPT2BPETokenizer", "GPT-2's BPE, or a small BPE trained on the "
                               "corpus by scripts/prepare_data.py",
                               choices=("GPT2BPETokenizer", "CorpusBPETokenizer"))
    vocab_file: Optional[str] = knob(
        None, "GPT2BPETokenizer: the .tiktoken ranks file (default: the copy shipped by "
              "openai-whisper); CorpusBPETokenizer: its tokenizer JSON (default: "
              "<data prefix>.tokenizer.json, where prepare_data.py writes it)")
    data_cache_path: Optional[str] = knob(
        None, "where GPTDataset caches its sample indices (default: <data dir>/cache)")

    #: Not a knob: the tokenizer's id count, set at run start by
    #: :func:`check_run_inputs` (the shape check's).
    tokenizer_vocab_size: ClassVar[Optional[int]] = None

    @property
    def split_weights(self) -> list:
        """``--split`` as numbers ([] when it does not parse)."""
        try:
            return [float(x) for x in self.split.split(",")]
        except ValueError:
            return []

    def resolve(self) -> None:
        if self.data_path is None:
            raise ConfigError("--data-path", "is required (make one with scripts/prepare_data.py)")
        weights = self.split_weights
        if len(weights) != 3 or min(weights) < 0 or weights[0] <= 0 or weights[1] <= 0:
            raise ConfigError("--split", f"must be three comma-separated non-negative weights "
                                         f"train,valid,test with train and valid > 0 (got {self.split!r})")
        if self.data_cache_path is None:
            self.data_cache_path = os.path.join(os.path.dirname(os.path.abspath(self.data_path)),
                                                "cache")


@dataclass
class EvalConfig:
    """Validation loss and perplexity; zero-shot last-word accuracy at the end."""

    eval_interval: int = knob(50, "evaluate every this many iterations (and at the end)", min=1)
    eval_iters: int = knob(10, "validation batches (of the global batch size) per evaluation",
                           min=1)
    last_word_examples: int = knob(
        0, "after the final evaluation, zero-shot last-word (LAMBADA-style) accuracy on this "
           "many sentence-final words of held-out documents (test split, topped up from the "
           "validation split); 0 = off", min=0)


@dataclass
class LoggingConfig:
    """Progress line, JSONL metrics and TensorBoard."""

    log_interval: int = knob(10, "print a progress line every this many iterations", min=1)
    metrics_file: Optional[str] = knob(None, "JSONL file, one record per iteration")
    tensorboard_dir: Optional[str] = knob(None, "TensorBoard event directory")


@dataclass
class CheckpointConfig:
    """Save and resume: model, optimizer, LR schedule, data position, RNG states."""

    save: Optional[str] = knob(None, "checkpoint directory to save into")
    save_interval: Optional[int] = knob(
        None, "save every this many iterations (and at the end); needs --save", min=1)
    load: Optional[str] = knob(None, "checkpoint directory to resume from (latest iteration); "
                                     "the same directory as --save resumes when it holds a "
                                     "checkpoint and starts fresh otherwise (restarts)")

    @property
    def auto_resume(self) -> bool:
        """``--load`` = ``--save``: a (re)started job continues from its own checkpoints."""
        return (self.load is not None and self.save is not None
                and os.path.abspath(self.load) == os.path.abspath(self.save))

    def resolve(self) -> None:
        if self.save_interval is not None and self.save is None:
            raise ConfigError("--save-interval", "needs --save")


# ---------------------------------------------------------------------- edgc


@dataclass
class EdgcConfig:
    """Gradient compression of Megatron's DP gradient sync (EDGC §1).

    YAML section ``edgc:`` with keys ``mode``, ``rank``, ...; flags ``--edgc-mode``, ...
    """

    FLAG_PREFIX = "edgc_"
    #: ``group`` key of a field -> (argparse group title, description), in --help order.
    GROUPS = {
        "method": ("EDGC method", "what is compressed and how: PowerSGD on the DP gradient "
                                  "sync and on pipeline backward sends (megatron_edgc)"),
        "controller": ("EDGC controller", "how --edgc-mode edgc chooses the rank per window "
                                          "(defaults: the paper's, EDGC §8)"),
        "diagnostics": ("EDGC diagnostics", "study, debug, validation and benchmark switches; "
                                            "off by default"),
    }

    # The method: DP compression (EDGC §1), its wire format, and PP backward sends (§7).
    mode: str = knob("off", "off: plain megatron-core DP sync; static: PowerSGD at --edgc-rank; "
                            "edgc: rank chosen per stage by the entropy controller",
                     choices=("off", "static", "edgc"), group="method")
    rank: int = knob(8, "PowerSGD rank (static mode)", min=1, group="method")
    min_compression_rate: float = knob(
        2.0, "compress a matrix only if it shrinks at least this much: (n+m) r x rate <= n m",
        min=1.0, group="method")
    start_iter: int = knob(0, "iterations of dense DP sync before compression starts", min=0,
                           group="method")
    bypass: str = knob("auto", "auto: send a bucket dense when the communication time its "
                               "compression saves (alpha-beta link measured on the DP group) "
                               "is below the measured compress + decompress time; off: always "
                               "compress (force)", choices=("auto", "off"), group="method")
    link_gbps: Optional[float] = knob(None, "bypass: declare the DP all-reduce rate in Gbit/s "
                                            "instead of measuring it", min=0.0,
                                      min_exclusive=True, group="method")
    factor_dtype: str = knob("bf16", "dtype of the PowerSGD factors P and Q on the wire: "
                                     "bf16 halves their bytes (all math and the error "
                                     "feedback stay fp32; the dense rest travels in fp32); "
                                     "paired against fp32 on three testbeds x 3 seeds the val "
                                     "loss differed inside the seed spread (BENCHMARKS.md)",
                             choices=("fp32", "bf16"), group="method")
    ef_dtype: str = knob("fp32", "dtype of the PowerSGD error-feedback residual kept between "
                                 "steps: bf16 halves that state (its rounding is not fed "
                                 "back); checkpointed with it", choices=("fp32", "bf16"),
                         group="method")
    pp_compression: str = knob("off", "pipeline backward sends: off: dense; static: "
                                      "rank --edgc-pp-rank; edgc: rank chosen by its own "
                                      "entropy controller (needs --edgc-mode edgc)",
                               choices=("off", "static", "edgc"), group="method")
    pp_rank: int = knob(8, "rank of compressed backward sends (static PP compression)", min=1,
                        group="method")
    pp_epilogue_only: bool = knob(False, "compress only the backward sends of the 1F1B "
                                         "cool-down, where they are on the critical path",
                                  group="method")

    # The controller (edgc mode), EDGC §2-6: windows, entropy sampling (GDS), the rank
    # model (CQM) or the byte budget, warm-up, the PP controller, stage alignment (DAC).
    controller: str = knob("paper", "edgc mode's rank controller after the warm-up: paper: "
                                    "entropy change -> rank (CQM, EDGC §4, with DAC); budget: "
                                    "per-matrix-shape ranks that spend --edgc-byte-budget where "
                                    "PowerSGD's measured residual falls most "
                                    "(megatron_edgc/control/rank_allocation.py)",
                           choices=("paper", "budget"), group="controller")
    window: int = knob(1000, "window w in iterations between rank decisions (paper: 1000)",
                       min=1, group="controller")
    iter_sample_rate: float = knob(0.1, "GDS iteration sampling rate α: entropy is measured on "
                                        "every round(1/α)-th iteration of a window",
                                   min=0.0, max=1.0, min_exclusive=True, group="controller")
    grad_sample_rate: float = knob(0.25, "GDS gradient sampling rate β: fraction of a stage's "
                                         "gradient elements in the entropy sample",
                                   min=0.0, max=1.0, min_exclusive=True, group="controller")
    rank_max: int = knob(64, "r_max: the rank when warm-up ends, and the upper clamp", min=1,
                         group="controller")
    rank_min: Optional[int] = knob(None, "r_min: the lower clamp (default r_max / 4)", min=1,
                                   group="controller")
    rank_step: int = knob(8, "s: the largest rank change per window", min=1, group="controller")
    warmup_eps: float = knob(0.01, "ε_H: warm-up ends when the window-mean entropy moves less "
                                   "than this (nats) ...", min=0.0, min_exclusive=True,
                             group="controller")
    warmup_windows: int = knob(2, "... for this many consecutive windows (K)", min=1,
                               group="controller")
    warmup_max_iters: Optional[int] = knob(None, "end warm-up here at the latest (default: no "
                                                 "cap)", min=1, group="controller")
    entropy: str = knob("gaussian", "entropy estimator", choices=("gaussian", "histogram"),
                        group="controller")
    g: str = knob("marchenko-pastur", "g(r) of the rank model: Gaussian theory, or residuals "
                                      "measured on the real gradients at warm-up end",
                  choices=("marchenko-pastur", "calibrated"), group="controller")
    byte_budget: float = knob(0.5, "budget controller: compressed DP bytes per iteration as a "
                                   "fraction of every shape at r_max", min=0.0, max=1.0,
                              min_exclusive=True, group="controller")
    budget_schedule: str = knob("constant", "budget controller over time: constant: the same "
                                            "budget every window; lr: the window's budget "
                                            "follows sqrt(LR) with the same mean over the "
                                            "compressed windows (an error costs more while the "
                                            "LR is high)", choices=("constant", "lr"),
                                group="controller")
    budget_step_limit: str = knob("off", "budget controller: on: each matrix shape's rank "
                                         "moves at most --edgc-rank-step per window (EDGC's "
                                         "step limit s); off: any change",
                                  choices=("off", "on"), group="controller")
    budget_weight: str = knob("elements", "budget controller: what a matrix shape's error "
                                          "costs: elements: its relative error times its "
                                          "element count; adam: its residual as Adam's "
                                          "update sees it (divided by the optimizer's second "
                                          "moment, read at each window end)",
                              choices=("elements", "adam"), group="controller")
    pp_rank_max: int = knob(64, "PP r_max: the PP rank when its warm-up ends, and the upper "
                                "clamp (edgc PP compression)", min=1, group="controller")
    pp_rank_min: Optional[int] = knob(None, "PP r_min: the lower clamp (default "
                                            "--edgc-pp-rank-max / 4)", min=1,
                                      group="controller")
    dac: str = knob("on", "DAC: later pipeline stages spend their slack on a higher DP rank "
                          "so that all stages finish their DP sync together (edgc mode, "
                          "PP > 1)", choices=("on", "off"), group="controller")

    # Diagnostics: none is needed to train.
    check_table: bool = knob(False, "debug: compare a hash of the rank table over all ranks "
                                    "at every window end and fail loudly on a mismatch",
                             group="diagnostics")
    check_replicas: bool = knob(False, "debug: every iteration, compare a digest of each "
                                       "DDP bucket's parameters over the group it is reduced "
                                       "on (JSONL dp_replica_mismatches: 0 when every "
                                       "replica is bit-identical)", group="diagnostics")
    compress_single_replica: bool = knob(
        False, "validation: compress buckets reduced over a single replica too (DP 1, "
               "expert-DP 1), which by default are left to megatron-core (nothing to send, "
               "nothing to approximate): exercises the compression path on one device",
        group="diagnostics")
    entropy_reference: bool = knob(False, "benchmark: also estimate the entropy of the full "
                                          "gradient every iteration (JSONL entropy_full, "
                                          "entropy_full_ms); changes no decision",
                                   group="diagnostics")
    grad_stats: bool = knob(False, "study: on measured iterations also record the sampled "
                                   "gradient's skewness and excess kurtosis per stage and the "
                                   "entropy per layer type (JSONL grad_skew, grad_kurt, "
                                   "entropy_by_type); changes no decision", group="diagnostics")

    def resolve(self) -> None:
        """Derived defaults and the rules among these flags (the rules against the rest of
        the run: :func:`validate_edgc`)."""
        if self.rank_min is None:
            self.rank_min = max(1, self.rank_max // 4)
        if self.rank_min > self.rank_max:
            raise ConfigError("--edgc-rank-min", f"must be <= --edgc-rank-max ({self.rank_max}),"
                                                 f" got {self.rank_min}")
        if self.pp_rank_min is None:
            self.pp_rank_min = max(1, self.pp_rank_max // 4)
        if self.pp_rank_min > self.pp_rank_max:
            raise ConfigError("--edgc-pp-rank-min", f"must be <= --edgc-pp-rank-max "
                                                    f"({self.pp_rank_max}), got {self.pp_rank_min}")
        if self.budget_weight == "adam" and (self.mode != "edgc" or self.controller != "budget"):
            raise ConfigError("--edgc-budget-weight", "adam weighs the budget controller's "
                                                      "allocation: needs --edgc-mode edgc "
                                                      "--edgc-controller budget")
        if self.pp_compression == "edgc" and self.mode != "edgc":
            raise ConfigError("--edgc-pp-compression", "edgc needs --edgc-mode edgc (the "
                                                       "window machinery); use static otherwise")

    @property
    def dac_active(self) -> bool:
        return self.mode == "edgc" and self.dac == "on" and self.controller == "paper"


# ---------------------------------------------------------------------- rules


def validate_edgc(cfg: RunConfig, shapes: Optional[Sequence[tuple]] = None) -> None:
    """Check the ``--edgc-*`` values of ``cfg`` and every rule between them and the run;
    fill their derived defaults (r_min, PP r_min). Raises :class:`ConfigError`.

    Both front-ends call this: the trainer's :meth:`RunConfig.validate` and the plug-in's
    ``megatron_lm.flags.run_config``, whose ``cfg.parallel`` holds Megatron-LM's values.
    ``shapes`` (every parameter shape of the model, all stages): also the rule that the
    ranks in force compress something, which fills ``cfg.compression_notes``, the start-up
    summary's lines; the trainer passes the shapes it predicts once its tokenizer is read
    (:func:`check_run_inputs`), the plug-in the real ones once the model
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
    if e.pp_compression != "off" and p.pipeline_model_parallel_size < 2:
        raise ConfigError("--edgc-pp-compression", f"compresses pipeline sends: needs "
                                                   f"--pipeline-model-parallel-size >= 2, got "
                                                   f"{p.pipeline_model_parallel_size}")
    if shapes is not None:
        cfg.compression_notes = _check_compression_ranks(cfg, list(shapes))


def _check_compression_ranks(cfg: RunConfig, shapes: list) -> list:
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


def check_run_layout(cfg: RunConfig) -> None:
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
    if t.grad_reduce_in_bf16 and not cfg.bf16_resolved:
        raise ConfigError("--grad-reduce-in-bf16", "reduces the bf16 gradients of bf16 "
                                                   "mixed precision: needs --bf16 (off by "
                                                   "default without CUDA)")
    if p.overlap_grad_reduce and p.bucket_size is not None and p.bucket_size < 1:
        raise ConfigError("--bucket-size", "must be >= 1")


# ---------------------------------------------------------------------- run


@dataclass
class RunConfig:
    """Everything one training run needs; sections map to YAML sections."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    edgc: EdgcConfig = field(default_factory=EdgcConfig)
    config_file: Optional[str] = None
    allow_untested_megatron: bool = False
    #: The start-up summary's compression lines (filled by :func:`validate_edgc` given the
    #: model's shapes).
    compression_notes: list = field(default_factory=list, repr=False, compare=False)

    @property
    def bf16_resolved(self) -> bool:
        """``--bf16`` as the run takes it: unset means on with CUDA, off without."""
        if self.training.bf16 is not None:
            return self.training.bf16
        import torch

        return torch.cuda.is_available()

    @property
    def num_microbatches(self) -> int:
        return self.training.global_batch_size // (
            self.training.micro_batch_size * self.parallel.data_parallel_size)

    def sections(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                yield f.name, value

    def validate(self, world_size: Optional[int] = None) -> RunConfig:
        """Check every value and the cross-section rules; fill derived defaults. Reads no
        file (the run's files: :func:`check_run_inputs`).

        ``world_size`` is the launcher's (torchrun/srun) or None for a plain local launch.
        """
        for _, section in self.sections():
            check_ranges(section)
        self.model.resolve()
        self.parallel.resolve(world_size)
        self.training.resolve()
        self.data.resolve()
        self.checkpoint.resolve()
        validate_edgc(self)
        check_run_layout(self)
        return self

    def _check_compression_ranks(self, shapes: list) -> None:
        """Kept for ``megatron_lm/seams.py``: :func:`validate_edgc` with the model's shapes."""
        validate_edgc(self, shapes)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(section) for name, section in self.sections()}


# ---------------------------------------------------------------------- run_inputs


def check_writable(flag: str, path: str, is_file: bool = False) -> None:
    """Fail now, naming ``flag``, if the run could not write ``path`` later (a directory it
    creates, or a file in one): the nearest existing ancestor must be a directory in which
    a file can really be created (a probe file, removed at once: ``os.access`` says yes to
    root under /proc and on read-only binds)."""
    target = os.path.abspath(path)
    if is_file and os.path.isdir(target):
        raise ConfigError(flag, f"{path} is a directory")
    if not is_file and os.path.exists(target) and not os.path.isdir(target):
        raise ConfigError(flag, f"{path} exists and is not a directory")
    probe = os.path.dirname(target) if is_file else target
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(flag, f"{path} cannot be written ({probe} is not a directory)")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise ConfigError(flag, f"{path} cannot be written (creating a file in {probe} "
                                f"fails: {exc.strerror or exc})") from None


def check_run_inputs(cfg: RunConfig, tokenizers, checkpoints) -> RunConfig:
    """The trainer's files, for a ``cfg`` that passed :meth:`RunConfig.validate`: the
    dataset, the tokenizer against it (sets ``cfg.data.vocab_file`` when unset and
    ``cfg.data.tokenizer_vocab_size``), the output paths, the compressibility of the ranks
    in force (shapes predicted from the config and the tokenizer) and ``--load``.

    ``tokenizers`` and ``checkpoints`` are the trainer's ``training.tokenizer`` and
    ``training.checkpoint_files`` modules, handed in by ``config.parse_config`` (config/
    imports nothing of training/: docs/layout.md).
    """
    d = cfg.data
    for ext in (".bin", ".idx"):
        if not os.path.isfile(d.data_path + ext):
            raise ConfigError("--data-path", f"{d.data_path + ext} does not exist "
                                             f"(make it with scripts/prepare_data.py)")
    n_docs, token_dtype = _check_indexed_dataset(d.data_path)
    split_docs = _split_document_counts(d.split_weights, n_docs)
    if split_docs[0] < 1 or split_docs[1] < 1:
        raise ConfigError("--split", f"{d.split!r} over {n_docs} documents leaves "
                                     f"{split_docs[0]} for training and {split_docs[1]} for "
                                     f"validation; each needs at least one")
    if d.vocab_file is None and d.tokenizer_type == "GPT2BPETokenizer":
        d.vocab_file = tokenizers.default_gpt2_vocab_file()
    if d.vocab_file is None:  # prepare_data.py writes it beside the data
        stem = d.data_path[: -len("_text_document")] \
            if d.data_path.endswith("_text_document") else d.data_path
        d.vocab_file = stem + ".tokenizer.json"
    if not os.path.isfile(d.vocab_file):
        raise ConfigError("--vocab-file", f"{d.vocab_file} does not exist")
    try:
        tokenizer = tokenizers.build_tokenizer(d.tokenizer_type, d.vocab_file)
    except (ValueError, OSError) as exc:
        raise ConfigError("--vocab-file", f"{exc}") from None
    d.tokenizer_vocab_size = tokenizer.vocab_size
    if int(numpy.iinfo(token_dtype).max) + 1 < tokenizer.vocab_size:
        raise ConfigError("--vocab-file", f"the tokenizer has {tokenizer.vocab_size} ids, "
                                          f"more than {d.data_path}.bin can store: the "
                                          f"data was made with another tokenizer")
    # The opposite mismatch: ids the tokenizer doesn't have (an embedding lookup out of
    # range later, in every rank). The first 64 MiB of tokens are a cheap, telling sample.
    sample = numpy.memmap(d.data_path + ".bin", dtype=token_dtype, mode="r")
    sample = sample[: (64 << 20) // numpy.dtype(token_dtype).itemsize]
    top = int(sample.max()) if sample.size else 0
    if top >= tokenizer.vocab_size:
        raise ConfigError("--vocab-file", f"{d.data_path}.bin holds token id {top}, beyond "
                                          f"this tokenizer's {tokenizer.vocab_size} ids: the "
                                          f"data was made with another tokenizer")
    check_writable("--data-cache-path", d.data_cache_path)

    log, ck = cfg.logging, cfg.checkpoint
    if log.metrics_file is not None:
        check_writable("--metrics-file", log.metrics_file, is_file=True)
    if log.tensorboard_dir is not None:
        check_writable("--tensorboard-dir", log.tensorboard_dir)
    if ck.save is not None:
        check_writable("--save", ck.save)
    if ck.load is not None and not os.path.isdir(ck.load) and not ck.auto_resume:
        raise ConfigError("--load", f"{ck.load} is not a directory")

    from megatron_edgc.model_shapes import stage_param_shapes

    stages = stage_param_shapes(cfg.model, cfg.parallel, d.tokenizer_vocab_size)
    validate_edgc(cfg, shapes=[s for stage in stages for s in stage])
    if ck.load is not None:
        p = cfg.parallel
        problem = checkpoints.preflight(ck.load, p.tensor_model_parallel_size,
                                        p.pipeline_model_parallel_size, ck.auto_resume)
        if problem:
            raise ConfigError("--load", problem)
    return cfg


#: megatron.core.datasets.indexed_dataset's dtype codes.
_DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
                7: "float32", 8: "uint16"}


def _split_document_counts(weights: list, n_docs: int) -> list:
    """Documents per split, rounded as megatron-core's dataset builder rounds them."""
    total = sum(weights)
    cum = [sum(weights[:i]) / total for i in range(len(weights) + 1)]
    return [int(round(b * n_docs)) - int(round(a * n_docs)) for a, b in zip(cum, cum[1:])]


def _check_indexed_dataset(prefix: str):
    """Header checks of a Megatron .idx/.bin pair, cheap enough for start-up.

    Returns the number of documents and the token dtype.
    """
    # megatron.core.datasets.indexed_dataset's format: magic, version, dtype code, counts.
    codes = {k: numpy.dtype(v) for k, v in _DTYPE_CODES.items()}
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    try:
        with open(idx, "rb") as fh:
            header = fh.read(9)
            if header != b"MMIDIDX\x00\x00":
                raise ValueError("bad magic header")
            version = numpy.frombuffer(fh.read(8), dtype=numpy.int64)[0]
            dtype = codes[int(numpy.frombuffer(fh.read(1), dtype=numpy.uint8)[0])]
            n_seq = int(numpy.frombuffer(fh.read(8), dtype=numpy.int64)[0])
            n_doc = int(numpy.frombuffer(fh.read(8), dtype=numpy.int64)[0])
            lengths = numpy.frombuffer(fh.read(4 * n_seq), dtype=numpy.int32)
            if version != 1 or len(lengths) != n_seq or n_doc < 2:
                raise ValueError("truncated or unknown version")
    except Exception as exc:
        raise ConfigError("--data-path", f"{idx} is not a valid Megatron index ({exc})") from None
    expected = int(lengths.astype(numpy.int64).sum()) * numpy.dtype(dtype).itemsize
    actual = os.path.getsize(bin_)
    if actual != expected:
        raise ConfigError("--data-path", f"{bin_} has {actual} bytes, its index says {expected} "
                                         f"(truncated or from another dataset)")
    return n_doc - 1, dtype


# ---------------------------------------------------------------------- cli


#: The tiny CPU default, shipped in the package (``configs/`` at the top of the source
#: tree links here).
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                              "configs", "tiny-cpu.yaml")


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="GPT-2 pretraining on megatron-core with EDGC gradient compression.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="YAML config; flags below override its values")
    parser.add_argument("--allow-untested-megatron", action="store_true",
                        help="run on a megatron-core version the patches were not tested with")
    for section_name, section in RunConfig().sections():
        add_knob_arguments(parser, type(section), title=section_name,
                           dest=lambda f, s=section_name: f"{s}.{f.name}",
                           default=lambda f: argparse.SUPPRESS)
    return parser


def add_knob_arguments(parser, section_cls, *, title: str, dest: Callable,
                       default: Callable) -> dict:
    """Every knob of ``section_cls`` as a flag, in one argument group named ``title``; a
    section with ``GROUPS`` (EDGC) gets one group per entry, in that order, each field in
    the group its ``group`` tag names. ``dest(field)`` and ``default(field)`` give each
    flag's destination and default. Returns the groups by key (``None``: the one group)."""
    spec = getattr(section_cls, "GROUPS", None)
    groups = {key: parser.add_argument_group(name, about)
              for key, (name, about) in spec.items()} if spec else \
        {None: parser.add_argument_group(title)}
    for f in dataclasses.fields(section_cls):
        group = groups[f.metadata["group"]] if spec else groups[None]
        add_knob_argument(group, flag_of(f.name, section_cls), f, dest=dest(f),
                          default=default(f))
    return groups


def add_knob_argument(group, flag: str, f, *, dest: str, default) -> None:
    """One flag for the :func:`knob` field ``f``: its type, help and default shown."""
    base, meta = base_type(f.type), f.metadata
    kwargs = dict(dest=dest, default=default, help=f"{meta['help']} (default {f.default})")
    if base is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
    else:
        # Choices are checked by the validator, so every bad value gets the same
        # one-line "--flag: must be one of ..." error.
        metavar = "{" + ",".join(map(str, meta["choices"])) + "}" if meta.get("choices") \
            else base.__name__.upper()
        group.add_argument(flag, type=base, metavar=metavar, **kwargs)


def _apply_yaml(cfg: RunConfig, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError("--config", f"{path} does not exist")
    try:
        with open(path) as fh:
            doc = yaml.safe_load(fh) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("--config", f"{path} is not valid YAML: {str(exc).splitlines()[0]}")
    if not isinstance(doc, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of sections")
    sections = dict(cfg.sections())
    for section_name, values in doc.items():
        if section_name not in sections:
            raise ConfigError("--config", f"{path}: unknown section {section_name!r} "
                                          f"(known: {', '.join(sections)})")
        section = sections[section_name]
        names = {f.name for f in dataclasses.fields(section)}
        for key, value in (values or {}).items():
            if key not in names:
                raise ConfigError("--config", f"{path}: unknown key {section_name}.{key}")
            setattr(section, key, value)


def parse_values(argv=None, world_size: Optional[int] = None) -> RunConfig:
    """YAML (``--config``) + flag overrides → a :class:`RunConfig` whose values are
    validated (:meth:`RunConfig.validate`); no file but the YAML is read."""
    args = build_arg_parser().parse_args(argv)
    cfg = RunConfig(config_file=args.config, allow_untested_megatron=args.allow_untested_megatron)
    _apply_yaml(cfg, args.config)
    sections = dict(cfg.sections())
    for dest, value in vars(args).items():
        if "." in dest:
            section_name, name = dest.split(".", 1)
            setattr(sections[section_name], name, value)
    return cfg.validate(world_size)


def parse_config(argv=None, world_size: Optional[int] = None) -> RunConfig:
    """YAML (``--config``) + flag overrides → a validated :class:`RunConfig` whose files were
    checked: :func:`parse_values`, then :func:`check_run_inputs` (the run's start)."""
    # The trainer's tokenizer and checkpoint formats, the one reach of config/ into
    # training/ (docs/layout.md: inside this function only).
    from megatron_edgc.training import checkpoint_files, tokenizer

    return check_run_inputs(parse_values(argv, world_size), tokenizer, checkpoint_files)
