"""Shared fixtures: a small real dataset (the Shakespeare corpus) and a small GPT-2."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def corpus_data(tmp_path_factory):
    """400 corpus documents, a 2048-id corpus BPE, a Megatron .bin/.idx."""
    from megatron_edgc.training import data
    from megatron_edgc.training.tokenizer import CorpusBPETokenizer

    root = tmp_path_factory.mktemp("corpus")
    jsonl = str(root / "small.jsonl")
    data.write_jsonl(data.corpus_documents(chars_per_document=4000)[:400], jsonl)
    vocab_file = str(root / "bpe2k.tokenizer.json")
    tokenizer = CorpusBPETokenizer.train(data.read_jsonl_texts(jsonl), 2048, vocab_file)
    prefix = str(root / "small_text_document")
    stats = data.build_indexed_dataset(jsonl, prefix, tokenizer)
    return {"jsonl": jsonl, "prefix": prefix, "vocab_file": vocab_file, "stats": stats,
            "root": str(root)}


@pytest.fixture(scope="session")
def small_model_argv(corpus_data):
    """Flags for a 4-layer, hidden-64 GPT-2 that trains in ~0.1 s per iteration."""
    return [
        "--config", os.path.join(ROOT, "configs", "tiny-cpu.yaml"),
        "--data-path", corpus_data["prefix"], "--vocab-file", corpus_data["vocab_file"],
        "--tokenizer-type", "CorpusBPETokenizer",
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "20", "--lr", "5e-3", "--min-lr", "5e-4", "--lr-warmup-iters", "2",
        "--eval-interval", "10", "--eval-iters", "2", "--log-interval", "1",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        # Byte-exact assertions: no timing-dependent bypass unless a test asks for it, and
        # every dense sync megatron-core's own in the buffers' dtype (the default bf16
        # dense wire has its tests, which pass --edgc-dense-wire themselves).
        "--edgc-bypass", "off", "--edgc-dense-wire", "grad",
        # fp32 on every CPU: an unset --bf16 follows the CPU's bf16 instructions (issue 80),
        # and the assertions of these runs are fp32's; a test of bf16 passes --bf16 after
        "--no-bf16",
    ]
