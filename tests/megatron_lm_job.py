"""Megatron-LM's own ``pretrain_gpt.py`` with the plug-in's two lines, run under torchrun:
shared by ``tests/test_megatron_lm.py`` and ``scripts/gpu_check.py`` (standard library only).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tarfile

#: The two lines a user adds to their pretrain_gpt.py (README, "EDGC in your Megatron-LM job"):
#: the first at the top of its ``if __name__ == "__main__":`` block, the second replacing the
#: ``extra_args_provider=`` of ``pretrain`` (core_v0.16.1) or ``parse_and_validate_args``
#: (core_v0.19.0).
MAIN = 'if __name__ == "__main__":\n'
ENABLE_LINE = "    import megatron_edgc.megatron_lm as edgc; edgc.enable()\n"
PROVIDER = "extra_args_provider=edgc.add_args,"

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "1000",
         "--make-vocab-size-divisible-by", "128"]
#: A small job on 4 gloo processes (TP1·PP2·DP2), mock data; later flags override these.
ARGS = MODEL + [
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
    "--distributed-backend", "gloo", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", "8", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--seed", "1234",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--num-workers", "0",
    "--split", "949,50,1", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--rerun-mode", "disabled",
    "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--ckpt-format", "torch"]
#: EDGC on DP and PP, windows of 2 iterations (an 8-iteration job decides 3 times); the
#: warm-up megatron-core's own sync (its losses equal unmodified Megatron-LM's, bitwise).
EDGC = ["--edgc-mode", "edgc", "--edgc-window", "2", "--edgc-warmup-max-iters", "2",
        "--edgc-rank-max", "8", "--edgc-rank-min", "2", "--edgc-rank-step", "2",
        "--edgc-iter-sample-rate", "1.0", "--edgc-bypass", "off", "--edgc-dac", "off",
        "--edgc-dense-wire", "grad", "--edgc-pp-compression", "edgc",
        "--edgc-pp-rank-max", "16"]
#: EDGC on the DP sync only (no pipeline to compress on a PP 1 layout).
EDGC_DP = EDGC[:EDGC.index("--edgc-pp-compression")]
#: Megatron-LM's default format as large jobs run it: distributed optimizer, bf16, async.
TORCH_DIST = ["--ckpt-format", "torch_dist", "--use-distributed-optimizer", "--bf16",
              "--async-save"]
#: How the tests run the script: with the CPU shims (only the import stubs under CUDA).
CPU_RUNNER = ["-m", "megatron_edgc.megatron_lm_cpu"]


def unpack(source: str, where: str) -> str:
    """The Megatron-LM directory of ``source``: itself if a directory, else the tarball
    unpacked into ``where``."""
    if os.path.isdir(source):
        return source
    with tarfile.open(source) as tar:
        tar.extractall(where, filter="data")
    return where


def add_two_lines(where: str) -> tuple[str, str]:
    """(the unmodified ``pretrain_gpt.py``, ``pretrain_gpt_edgc.py``: a copy with the two
    lines, written beside it); fails unless exactly two lines differ, one replaced."""
    original = os.path.join(where, "pretrain_gpt.py")
    with open(original) as fh:
        text = fh.read()
    assert text.count(MAIN) == 1 and text.count("extra_args_provider=") == 1, original
    patched = re.sub(r"extra_args_provider=[^\n]*,", PROVIDER,
                     text.replace(MAIN, MAIN + ENABLE_LINE))
    diff = list(difflib.ndiff(text.splitlines(), patched.splitlines()))
    added, removed = [d for d in diff if d[:2] == "+ "], [d for d in diff if d[:2] == "- "]
    assert len(added) == 2 and len(removed) == 1, (added, removed)  # two lines, one replaced
    copy = os.path.join(where, "pretrain_gpt_edgc.py")
    with open(copy, "w") as fh:
        fh.write(patched)
    return original, copy


def torchrun_command(python: str, script: str, args: list, nproc: int,
                     port: int | None = None, runner: list = CPU_RUNNER) -> list:
    """One local torchrun of ``script`` through ``runner``: ``--standalone``, or a static
    rendezvous on ``port`` (a port the caller reserved: no race between concurrent jobs)."""
    rendezvous = (["--standalone"] if port is None else
                  ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)])
    return [python, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node",
            str(nproc), *runner, script, *args]


def lm_losses(out: str) -> dict:
    """Megatron-LM's printed ``lm loss`` of each logged iteration."""
    return {int(it): float(loss) for it, loss in
            re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|", out)}


def read_records(path: str) -> list:
    """The ``--edgc-metrics-file`` records ([] if none)."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
