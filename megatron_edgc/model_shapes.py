"""The gradient shapes of this project's GPT-2 per pipeline stage, from the config alone.

Pure arithmetic (no torch, no process group): the start-up check runs it before anything is
launched, to tell the user how much of the gradient compresses at the configured rank and
to refuse a rank at which nothing would (a run that trains dense while the user believes
compression is on). ``tests/test_model_shapes.py`` holds it against the parameters of the
megatron-core model that ``training/model.py`` really builds, for TP and PP layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_edgc.compression.matrices import is_compressible, matrix_shape


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round up to a multiple of ``divisible_by * TP``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def stage_param_shapes(model, parallel, vocab_size: int) -> list:
    """Per pipeline stage, the shapes of the parameters one TP rank of it holds.

    GPT-2 as ``training/model.py`` builds it: LayerNorm (weight, bias), biased linears,
    learned positions, embeddings tied to the output layer (the last stage holds its own
    copy of the word embeddings when PP > 1). ``vocab_size`` is the tokenizer's. With
    ``--num-experts`` the MLP is megatron-core's MoE layer: a router (weight and bias, fp32)
    and, on each rank, its ``E / EP`` local experts (fc1, fc2 with biases).
    """
    h, tp, pp = model.hidden_size, parallel.tensor_model_parallel_size, \
        parallel.pipeline_model_parallel_size
    f = model.ffn_hidden_size or 4 * h
    vocab = padded_vocab_size(vocab_size, model.make_vocab_size_divisible_by, tp)
    layer = [(h,), (h,),                                  # input LayerNorm
             (3 * h // tp, h), (3 * h // tp,),            # QKV (column parallel)
             (h, h // tp), (h,),                          # attention projection (row parallel)
             (h,), (h,)]                                  # pre-MLP LayerNorm
    mlp = [(f // tp, h), (f // tp,),                      # fc1 (column parallel)
           (h, f // tp), (h,)]                            # fc2 (row parallel)
    experts = getattr(model, "num_experts", None)
    if experts:  # router, then the local experts (expert TP = 1)
        ep = getattr(parallel, "expert_model_parallel_size", 1)
        mlp = [(experts, h), (experts,)] + (experts // ep) * [(f, h), (f,), (h, f), (h,)]
    layer = layer + mlp
    stages = []
    for s in range(pp):
        shapes = layer * (model.num_layers // pp)
        if s == 0:
            shapes = [(vocab // tp, h), (model.max_position_embeddings or model.seq_length, h)] \
                + shapes
        if s == pp - 1:
            shapes = shapes + [(h,), (h,)]                # final LayerNorm
            if pp > 1:
                shapes.append((vocab // tp, h))           # the output layer's embedding copy
        stages.append(shapes)
    return stages


@dataclass
class Compressibility:
    """How much of one stage's gradient PowerSGD compresses at a rank (EDGC §1's rule)."""

    matrices: int          # weight matrices (min side > 1)
    compressible: int      # of those, the ones compressed at the rank
    numel: int             # gradient elements of the stage
    compressible_numel: int

    @property
    def byte_share(self) -> float:
        return self.compressible_numel / self.numel if self.numel else 0.0


def compressibility(shapes, rank: int, min_compression_rate: float) -> Compressibility:
    matrices = compressible = numel = comp_numel = 0
    for shape in shapes:
        n, m = matrix_shape(shape)
        numel += n * m
        if min(n, m) > 1:
            matrices += 1
            if is_compressible(n, m, rank, min_compression_rate):
                compressible += 1
                comp_numel += n * m
    return Compressibility(matrices, compressible, numel, comp_numel)


def largest_compressing_rank(shapes, min_compression_rate: float) -> int:
    """The largest rank at which at least one matrix compresses (0 if none ever does)."""
    best = 0
    for shape in shapes:
        n, m = matrix_shape(shape)
        r = min(n, m) - 1
        while r > best and not is_compressible(n, m, r, min_compression_rate):
            r -= 1
        best = max(best, r)
    return best


def activation_grad_max_rank(model, micro_batch_size: int) -> int:
    """The largest PP rank whose compressed backward send ``(n + m) r`` is smaller than the
    dense activation gradient ``n m`` (n = sequence x micro-batch, m = hidden)."""
    n, m = model.seq_length * micro_batch_size, model.hidden_size
    return max(0, (n * m - 1) // (n + m))
