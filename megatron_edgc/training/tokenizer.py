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


class _DocumentTokenizer:
    """What both tokenizers share: ``<|endoftext|>`` ends a document (``eod`` = ``eos``)."""

    _eod: int

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def inv_vocab(self):
        return {i: tok for tok, i in self.vocab.items()}


class GPT2BPETokenizer(_DocumentTokenizer):
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
    def vocab_size(self) -> int:
        return self._enc.n_vocab


class CorpusBPETokenizer(_DocumentTokenizer):
    """A small byte-level BPE trained on the corpus (HuggingFace ``tokenizers``).

    Same algorithm as GPT-2's BPE with a smaller vocabulary (default 8192): the tiny CPU
    config uses it because the 50k-entry output layer dominates a tiny model's step time
    (docs/running.md: measured 3.7x faster per iteration). ``<|endoftext|>`` ends documents.
    """

    def __init__(self, tokenizer_file: str):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(tokenizer_file)
        except Exception as exc:
            raise ValueError(f"{tokenizer_file}: not a tokenizers JSON file ({exc})") from None
        eod = self._tok.token_to_id(GPT2_EOD)
        if eod is None:
            raise ValueError(f"{tokenizer_file}: has no {GPT2_EOD} token")
        self._eod = eod
        self.unique_identifiers = {"class": type(self).__name__,
                                   "tokenizer_path": [os.path.basename(tokenizer_file)],
                                   "vocab_size": self._tok.get_vocab_size()}

    @staticmethod
    def train(texts, vocab_size: int, path: str) -> "CorpusBPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[GPT2_EOD],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tok.save(path)
        return CorpusBPETokenizer(path)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def detokenize(self, ids) -> str:
        return self._tok.decode(list(numpy.asarray(ids).tolist()), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def vocab(self):
        return self._tok.get_vocab()



TOKENIZER_TYPES = ("GPT2BPETokenizer", "CorpusBPETokenizer")


def build_tokenizer(tokenizer_type: str, vocab_file: str | None):
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file)
    if tokenizer_type == "CorpusBPETokenizer":
        if not vocab_file:
            raise ValueError("--vocab-file: CorpusBPETokenizer needs the tokenizer JSON "
                             "written by scripts/prepare_data.py")
        return CorpusBPETokenizer(vocab_file)
    raise ValueError(f"--tokenizer-type: unknown tokenizer {tokenizer_type!r}")
