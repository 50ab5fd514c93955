"""The run's sections other than EDGC's, as data: model, parallel layout, training, data,
evaluation, logging, checkpoints. Each ``resolve()`` fills its derived defaults and checks
the rules among its own fields; none reads or probes a file (that is
:mod:`megatron_edgc.config.run_inputs`, at run start)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Optional

from megatron_edgc.config.knobs import ConfigError, knob


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
    use_megatron_fsdp: bool = knob(
        False, "Megatron-FSDP (megatron-core's distributed/fsdp) in place of DDP, as "
               "Megatron-LM's --use-megatron-fsdp; here as HSDP only: DP split into "
               "--num-distributed-optimizer-instances (>= 2) instances, sharded inside one "
               "by --data-parallel-sharding-strategy, the gradients all-reduced across them "
               "(--outer-dp-sharding-strategy no_shard: the outer hop, the one EDGC "
               "compresses); fp32, TP1 PP1, --overlap-grad-reduce, no checkpoints yet "
               "(docs/megatron-fsdp-cpu.md)")
    data_parallel_sharding_strategy: str = knob(
        "no_shard", "Megatron-FSDP: what is sharded inside an instance, as Megatron-LM's flag: "
                    "no_shard (DDP-like: gradients all-reduced), optim_grads_params "
                    "(ZeRO-3: parameters, gradients and optimizer state); optim and "
                    "optim_grads are refused (not yet tested)",
        choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))
    outer_dp_sharding_strategy: str = knob(
        "no_shard", "Megatron-FSDP HSDP: what is sharded across instances: no_shard (the "
                    "outer hop an all-reduce of each rank's gradient buffer); optim is "
                    "refused (not yet)", choices=("no_shard", "optim"))
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
    bf16: Optional[bool] = knob(None, "bf16 mixed precision (default: on with CUDA; on a CPU "
                                      "only where it has bf16 instructions, AVX512-BF16 or "
                                      "AMX-BF16: without them bf16 runs many times slower)")
    grad_reduce_in_bf16: bool = knob(
        False, "keep and reduce the gradients in bf16, as Megatron-LM's --grad-reduce-in-bf16 "
               "(megatron-core grad_reduce_in_fp32=False): half the dense bytes; needs --bf16. "
               "EDGC compresses the bf16 buffers with fp32 math")
    fp16: bool = knob(False, "fp16 mixed precision with megatron-core's loss scaler, as "
                             "Megatron-LM's --fp16 (the V100's precision: no bf16 there); "
                             "excludes --bf16. The gradients are reduced in fp16 unless "
                             "--accumulate-allreduce-grads-in-fp32")
    loss_scale: Optional[float] = knob(
        None, "fp16: a static loss scale (unset: the dynamic scaler below)", min=0.0,
        min_exclusive=True)
    initial_loss_scale: float = knob(2.0 ** 32, "fp16: the dynamic scaler's first scale",
                                     min=1.0)
    min_loss_scale: float = knob(1.0, "fp16: the dynamic scaler's floor", min=0.0,
                                 min_exclusive=True)
    loss_scale_window: int = knob(1000, "fp16: iterations without an overflow before the "
                                        "dynamic scale doubles", min=1)
    hysteresis: int = knob(2, "fp16: overflows the dynamic scaler tolerates before it halves",
                           min=1)
    accumulate_allreduce_grads_in_fp32: Optional[bool] = knob(
        None, "fp16: keep and reduce the gradients in fp32 (megatron-core "
              "grad_reduce_in_fp32), as Megatron-LM's flag of that name (default: on where "
              "--edgc-mode compresses, off otherwise: a compressed result written into fp16 "
              "buffers overflows where the dense sum does not, docs/method.md)")

    def resolve(self) -> None:
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16", "and --bf16 exclude each other: one mixed precision")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError("--min-loss-scale", f"must be <= --initial-loss-scale "
                                                  f"({self.initial_loss_scale:g}), got "
                                                  f"{self.min_loss_scale:g}")
        if self.accumulate_allreduce_grads_in_fp32 and not self.fp16:
            raise ConfigError("--accumulate-allreduce-grads-in-fp32",
                              "applies to --fp16 (bf16 reduces in fp32 already, unless "
                              "--grad-reduce-in-bf16; fp32 is fp32)")
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
    #: :func:`~megatron_edgc.config.run_inputs.check_run_inputs` (the shape check's).
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
