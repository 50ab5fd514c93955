"""The real GPT-2 byte-level BPE, offline.

The ranks file ``gpt2.tiktoken`` shipped by ``openai-whisper`` is byte-identical to
tiktoken's ``r50k_base`` (GPT-2); we load it with tiktoken and expose Megatron's
tokenizer interface (``tokenize``, ``detokenize``, ``eod``, ``vocab_size``).
"""

from __future__ import annotations

import base64
import importlib.util
import os

import numpy

# GPT-2's pre-tokenization pattern (tiktoken r50k_base).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOD = "<|endoftext|>"
GPT2_NUM_RANKS = 50256  # mergeable ranks; <|endoftext|> is id 50256, vocab size 50257


def default_gpt2_vocab_file() -> str:
    spec = importlib.util.find_spec("whisper")
    if spec is None or not spec.submodule_search_locations:
        return "<openai-whisper is not installed: pip install --no-deps openai-whisper>"
    return os.path.join(list(spec.submodule_search_locations)[0], "assets", "gpt2.tiktoken")


def load_gpt2_ranks(path: str) -> dict:
    """Parse a .tiktoken file (base64 token, rank per line); clear error on a wrong file."""
    ranks = {}
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
            except Exception:
                raise ValueError(f"{path}:{lineno}: not a GPT-2 .tiktoken ranks file")
    if len(ranks) != GPT2_NUM_RANKS or sorted(ranks.values()) != list(range(GPT2_NUM_RANKS)):
        raise ValueError(f"{path}: has {len(ranks)} ranks, GPT-2 has {GPT2_NUM_RANKS}")
    return ranks


class GPT2BPETokenizer:
    """GPT-2 BPE (50257 ids, ``<|endoftext|>`` = 50256 marks document ends).

    Duck-types what megatron-core's ``GPTDataset`` reads of a tokenizer (``eod``,
    ``vocab_size``, ``unique_identifiers``), without the deprecated legacy base class.
    """

    def __init__(self, vocab_file: str | None = None):
        import tiktoken

        vocab_file = vocab_file or default_gpt2_vocab_file()
        self.unique_identifiers = {"class": type(self).__name__,
                                   "tokenizer_path": [os.path.basename(vocab_file)]}
        ranks = load_gpt2_ranks(vocab_file)
        self._enc = tiktoken.Encoding(name="gpt2-offline", pat_str=GPT2_PATTERN,
                                      mergeable_ranks=ranks,
                                      special_tokens={GPT2_EOD: GPT2_NUM_RANKS})
        self._eod = GPT2_NUM_RANKS

    def tokenize(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def detokenize(self, ids) -> str:
        return self._enc.decode(list(numpy.asarray(ids).tolist()))

    @property
    def vocab(self):
        return {self._enc.decode_single_token_bytes(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self):
        return {i: tok for tok, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod


def build_tokenizer(tokenizer_type: str, vocab_file: str | None) -> GPT2BPETokenizer:
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file)
    raise ValueError(f"--tokenizer-type: unknown tokenizer {tokenizer_type!r}")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round up to a multiple of ``divisible_by * TP``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple
