"""Data: the .bin holds exactly the tokenizer's ids; GPTDataset samples; batch addressing."""

import os
import subprocess
import sys

import numpy
import torch

from megatron_edgc.training import data
from megatron_edgc.training.tokenizer import CorpusBPETokenizer, GPT2BPETokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def indexed(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(prefix, multimodal=False, mmap=True)


def test_gpt2_bpe_is_the_real_one():
    tok = GPT2BPETokenizer()
    assert tok.tokenize("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eod == 50256
    text = "To be, or not to be, that is the question:\n"
    assert tok.detokenize(tok.tokenize(text)) == text


def test_prepare_data_gpt2_round_trip(tmp_path):
    jsonl = tmp_path / "in.jsonl"
    docs = data.corpus_documents()[:30]
    data.write_jsonl(docs + [{"text": "Hello world"}], str(jsonl))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_data.py"),
                           "--input", str(jsonl), "--output-prefix", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ds = indexed(str(tmp_path / "out_text_document"))
    tok = GPT2BPETokenizer()
    assert len(ds) == 31
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == tok.tokenize(doc["text"]) + [50256]
    assert ds[30].tolist() == [15496, 995, 50256]
    assert ds[0].dtype == numpy.uint16


def test_corpus_bpe_round_trip(corpus_data):
    tok = CorpusBPETokenizer(corpus_data["vocab_file"])
    assert tok.vocab_size == 2048
    ds = indexed(corpus_data["prefix"])
    texts = list(data.read_jsonl_texts(corpus_data["jsonl"]))
    assert len(ds) == len(texts) == 400
    for i in (0, 17, 399):
        ids = ds[i].tolist()
        assert ids == tok.tokenize(texts[i]) + [tok.eod]
        assert tok.detokenize(ids[:-1]) == texts[i]
    assert corpus_data["stats"]["tokens"] == sum(len(ds[i]) for i in range(len(ds)))


def test_corpus_is_real_shakespeare():
    docs = data.corpus_documents()
    assert len(docs) > 1000
    text = " ".join(d["text"] for d in docs)
    assert "To be, or not to be" in text
    assert len(text) > 4_500_000


def test_gpt_dataset_samples_and_micro_batch_addressing(small_model_argv):
    from megatron_edgc.config import parse_config
    from megatron_edgc.training.tokenizer import build_tokenizer

    cfg = parse_config(small_model_argv)
    tok = build_tokenizer(cfg.data.tokenizer_type, cfg.data.vocab_file)
    train, valid, _ = data.build_gpt_datasets(cfg, tok, (160, 32))
    assert len(train) >= 160 and len(valid) >= 32
    s = train[0]
    assert len(s["tokens"]) == 64
    assert torch.equal(torch.as_tensor(s["labels"][:-1]), torch.as_tensor(s["tokens"][1:]))
    # DP ranks take disjoint micro-batches that tile the global batch of an iteration.
    seen = []
    for dp in range(2):
        stream = data.MicroBatchStream(train, 2, 2, dp, 2)
        for mb in stream.micro_batches(3):
            assert mb["tokens"].shape == (2, 64)
            seen += [tuple(row.tolist()) for row in mb["tokens"]]
    expected = [tuple(torch.as_tensor(train[i]["tokens"]).tolist()) for i in range(24, 32)]
    assert sorted(seen) == sorted(expected)
