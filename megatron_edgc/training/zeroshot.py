"""Zero-shot last-word prediction (LAMBADA-style) on held-out passages of the corpus.

An example is a sentence-final word of a held-out document and the text before it: the
model reads the context and has to produce the word. It counts as correct when every
token of the word is the argmax of the logits at the position before it, with the word's
earlier tokens fed in (teacher forcing) -- exactly what greedy decoding of the word gives,
in one forward pass.

Everything here is pure (tokenizer + tensors); the Trainer runs the packed micro-batches
through megatron-core's forward-only schedule and reduces the counts.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Iterator, NamedTuple, Optional

import torch

#: Words whose tokenization is longer than this are skipped.
MAX_TARGET_TOKENS = 8
#: Examples with fewer context tokens than this are skipped.
MIN_CONTEXT_TOKENS = 16

# An alphabetic word that follows a single space after a non-space character and is
# followed by sentence punctuation or the end of a line. The single-space rule makes
# "context" + " word" tokenize as the context alone followed by the word alone (GPT-2
# BPE attaches the space to the word), so context and target can be tokenized apart.
_SENTENCE_FINAL = re.compile(r"(?<=\S )([A-Za-z]+)(?=[.!?;]|\n|$)")
# A cut before " " between two non-space characters is a pre-tokenization boundary of
# GPT-2's regex (and of the byte-level BPE trained with it): text after it tokenizes
# the same alone as inside the whole text.
_WORD_BOUNDARY = re.compile(r"(?<=\S) (?=\S)")


def _context_tokens(tokenizer, prefix: str, budget: int) -> list[int]:
    """The last ``budget`` tokens of ``tokenizer.tokenize(prefix)``.

    Tokenizing a long document's whole prefix for every word is quadratic, so a window of
    the prefix that starts at a pre-tokenization boundary is tried first; its tail is the
    whole prefix's tail. If the window holds too few tokens, the whole prefix is used.
    """
    window = 16 * budget
    if len(prefix) > window:
        cut = _WORD_BOUNDARY.search(prefix, len(prefix) - window)
        if cut is not None:
            ids = tokenizer.tokenize(prefix[cut.start():])
            if len(ids) >= budget:
                return ids[len(ids) - budget:]
    ids = tokenizer.tokenize(prefix)
    return ids[max(0, len(ids) - budget):]


def _examples_in(tokenizer, text: str, seq_length: int,
                 min_word_chars: int) -> Iterator[tuple[list[int], list[int]]]:
    """The examples of one text, in text order."""
    for m in _SENTENCE_FINAL.finditer(text):
        word = m.group(1)
        # All-capital words are speaker names and headings ("KING HENRY.", "SCENE II.").
        if len(word) < min_word_chars or word.isupper():
            continue
        target = tokenizer.tokenize(" " + word)
        if not target or len(target) > MAX_TARGET_TOKENS:
            continue
        context = _context_tokens(tokenizer, text[: m.start() - 1], seq_length - len(target))
        if len(context) < MIN_CONTEXT_TOKENS:
            continue
        yield context, target


def build_last_word_examples(tokenizer, texts: list[str], n_examples: int, seq_length: int,
                             min_word_chars: int = 3) -> list[tuple[list[int], list[int]]]:
    """Up to ``n_examples`` (context_ids, target_ids) pairs from held-out texts.

    A target is a sentence-final alphabetic word of at least ``min_word_chars`` letters
    (not all capitals), tokenized with its leading space (``" " + word``, at most
    ``MAX_TARGET_TOKENS`` tokens); its context is the last ``seq_length - len(target)``
    tokens of the text before it (at least ``MIN_CONTEXT_TOKENS``), tokenized apart.
    Deterministic: texts are visited round-robin (first word of every text, then the
    second, ...) so that the examples spread over the passages.
    """
    if seq_length < MIN_CONTEXT_TOKENS + 1:
        raise ValueError(f"seq_length {seq_length} leaves no room for a {MIN_CONTEXT_TOKENS}"
                         f"-token context")
    streams = [_examples_in(tokenizer, text, seq_length, min_word_chars) for text in texts]
    examples: list[tuple[list[int], list[int]]] = []
    while streams and len(examples) < n_examples:
        alive = []
        for stream in streams:
            if len(examples) >= n_examples:
                break
            example = next(stream, None)
            if example is not None:
                examples.append(example)
                alive.append(stream)
        streams = alive
    return examples


def pack(examples: list, seq_length: int, pad_id: int) -> dict:
    """One micro-batch: each example (or ``None``, an empty slot) as a row of
    ``context + target`` padded on the right to ``seq_length``.

    ``target_pos[i, j]`` is the position whose logits predict ``target_ids[i, j]`` (the
    token before it); unused target slots hold ``-1`` in ``target_ids``.
    """
    b = len(examples)
    tokens = torch.full((b, seq_length), pad_id, dtype=torch.long)
    target_pos = torch.zeros((b, MAX_TARGET_TOKENS), dtype=torch.long)
    target_ids = torch.full((b, MAX_TARGET_TOKENS), -1, dtype=torch.long)
    for i, example in enumerate(examples):
        if example is None:
            continue
        context, target = example
        ids = list(context) + list(target)
        if not context or not 0 < len(target) <= MAX_TARGET_TOKENS or len(ids) > seq_length:
            raise ValueError(f"example {i}: context {len(context)} + target {len(target)} "
                             f"tokens do not fit a {seq_length}-token row")
        tokens[i, : len(ids)] = torch.tensor(ids)
        n = len(target)
        target_pos[i, :n] = torch.arange(len(context) - 1, len(context) - 1 + n)
        target_ids[i, :n] = torch.tensor(target)
    position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand(b, -1)
    return {"tokens": tokens, "position_ids": position_ids.contiguous(),
            "target_pos": target_pos, "target_ids": target_ids}


class LastWordScores(NamedTuple):
    correct: torch.Tensor  # [b] bool: every target token is the argmax (greedy = the word)
    nll: torch.Tensor      # [b] float: -log p(word | context), nats; 0 for empty rows
    valid: torch.Tensor    # [b] bool: the row holds an example


def score(logits: torch.Tensor, target_pos: torch.Tensor, target_ids: torch.Tensor,
          vocab_size: Optional[int] = None,
          gather: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> LastWordScores:
    """Exact match and word log-likelihood of each row under teacher forcing.

    ``logits`` is ``[b, s, v]``. With tensor parallelism it holds this rank's vocabulary
    shard, and ``gather`` (an all-gather over the TP group along the last dimension)
    assembles the full rows -- of the target positions only. ``vocab_size`` drops the
    padded vocabulary entries (ids no tokenizer emits) before the argmax and softmax.
    """
    b = logits.shape[0]
    target_pos, target_ids = target_pos.to(logits.device), target_ids.to(logits.device)
    rows = logits[torch.arange(b, device=logits.device).unsqueeze(1), target_pos]  # [b, T, v]
    if gather is not None:
        rows = gather(rows.contiguous())
    if vocab_size is not None:
        rows = rows[..., :vocab_size]
    rows = rows.float()
    used = target_ids >= 0
    ids = target_ids.clamp(min=0)
    hit = (rows.argmax(dim=-1) == ids) | ~used
    logp = torch.log_softmax(rows, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    valid = used.any(dim=-1)
    return LastWordScores(correct=hit.all(dim=-1) & valid,
                          nll=-(logp * used).sum(dim=-1), valid=valid)


class LastWordStream:
    """The examples as micro-batches for one DP rank, addressed by call like
    :class:`~megatron_edgc.training.data.MicroBatchStream`: call ``c`` covers examples
    ``[c*G, (c+1)*G)``, ``G`` = micro-batch x micro-batches x DP, and DP rank ``d`` takes
    micro-batch ``k`` as examples ``c*G + (k*D + d)*m ... + m``. Slots past the last
    example are empty rows (they count for nothing).
    """

    def __init__(self, examples: list, seq_length: int, pad_id: int, micro_batch_size: int,
                 num_microbatches: int, dp_rank: int, dp_size: int):
        self.examples, self.seq_length, self.pad_id = examples, seq_length, pad_id
        self.m, self.k, self.d, self.D = micro_batch_size, num_microbatches, dp_rank, dp_size
        self.per_call = micro_batch_size * num_microbatches * dp_size
        self.num_calls = math.ceil(len(examples) / self.per_call)

    def micro_batches(self, call: int) -> Iterator[dict]:
        n = len(self.examples)
        for k in range(self.k):
            start = call * self.per_call + (k * self.D + self.d) * self.m
            rows = [self.examples[i] if i < n else None for i in range(start, start + self.m)]
            yield pack(rows, self.seq_length, self.pad_id)
