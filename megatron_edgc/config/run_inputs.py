"""The run-start checks of the files a run reads and writes: the dataset and its tokenizer,
the output paths, ``--load``. I/O, kept apart from validation (which checks values only);
both run before any process group exists, each error naming its flag."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

import numpy

from megatron_edgc.config.knobs import ConfigError
from megatron_edgc.config.rules import validate_edgc

if TYPE_CHECKING:
    from megatron_edgc.config.run import RunConfig


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


def check_run_inputs(cfg: "RunConfig", tokenizers, checkpoints) -> "RunConfig":
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
