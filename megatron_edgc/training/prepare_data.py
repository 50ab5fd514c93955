"""Corpus → JSONL → Megatron indexed dataset (.bin/.idx), like Megatron's preprocess_data.py
(``edgc-prepare-data``, or ``python scripts/prepare_data.py`` in the source tree).

    edgc-prepare-data                      # Shakespeare, GPT-2 BPE → data/
    edgc-prepare-data --tokenizer-type CorpusBPETokenizer --vocab-size 8192 \
        --output-prefix data/shakespeare-bpe8k          # + a small BPE trained on the corpus
    edgc-prepare-data --input my.jsonl --output-prefix data/mine

Writes ``<output-prefix>_text_document.bin/.idx`` (the ``--data-path`` to train on), for
the built-in corpus ``<output-prefix>.jsonl``, and for CorpusBPETokenizer the trained
tokenizer ``<output-prefix>.tokenizer.json`` (the ``--vocab-file`` to train with).
"""

import argparse
import os
import sys
import time

from megatron_edgc.training import data
from megatron_edgc.training.tokenizer import (TOKENIZER_TYPES, CorpusBPETokenizer,
                                              build_tokenizer)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", default=data.CORPUS_NAME,
                   help=f"a JSONL file, or '{data.CORPUS_NAME}' for the built-in corpus")
    p.add_argument("--output-prefix", default="data/shakespeare-gpt2")
    p.add_argument("--json-keys", default="text", help="the JSONL key holding the text")
    p.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--vocab-file", default=None,
                   help="GPT2BPETokenizer: ranks file (default: openai-whisper's copy); "
                        "CorpusBPETokenizer: where to write the trained tokenizer JSON "
                        "(default <output-prefix>.tokenizer.json)")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="CorpusBPETokenizer: vocabulary size to train")
    p.add_argument("--chars-per-document", type=int, default=4000,
                   help="built-in corpus: cut texts into documents of about this size")
    p.add_argument("--max-documents", type=int, default=None,
                   help="keep only the first N documents (small test sets)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-append-eod", action="store_true")
    args = p.parse_args(argv)
    if args.chars_per_document < 1:
        p.error("--chars-per-document: must be >= 1")

    t0 = time.time()
    jsonl = args.input
    if args.input == data.CORPUS_NAME:
        docs = data.corpus_documents(args.chars_per_document, args.seed)
        if args.max_documents:
            docs = docs[: args.max_documents]
        jsonl = args.output_prefix + ".jsonl"
        data.write_jsonl(docs, jsonl)
    elif not os.path.isfile(args.input):
        p.error(f"--input: {args.input} does not exist")
    if args.tokenizer_type == "CorpusBPETokenizer":
        if args.vocab_size < 300:
            p.error("--vocab-size: must be >= 300 (256 bytes + merges)")
        vocab_file = args.vocab_file or args.output_prefix + ".tokenizer.json"
        tokenizer = CorpusBPETokenizer.train(data.read_jsonl_texts(jsonl, args.json_keys),
                                             args.vocab_size, vocab_file)
        print(f"trained a {tokenizer.vocab_size}-entry byte-level BPE → {vocab_file}")
    else:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file)
    out = args.output_prefix + f"_{args.json_keys}_document"
    stats = data.build_indexed_dataset(jsonl, out, tokenizer, args.json_keys,
                                       append_eod=not args.no_append_eod)
    print(f"wrote {out}.bin/.idx: {stats['documents']} documents, {stats['tokens']} tokens "
          f"({stats['dtype']}) from {jsonl} in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
