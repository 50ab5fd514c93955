"""The plug-in in Megatron-LM's own ``pretrain_gpt.py`` (the core_v0.16.1 snapshot in
``../shared/vendor``), two lines added, 4 gloo processes (TP1·PP2·DP2), mock data.

Set ``EDGC_MEGATRON_LM`` to a Megatron-LM checkout (or a tarball of one) to run these
tests against it instead; without either they skip, saying so.
"""

import difflib
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

from megatron_edgc.compression.powersgd import is_compressible, matrix_shape
from megatron_edgc.config import ModelConfig, ParallelConfig
from megatron_edgc.model_shapes import stage_param_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOT = os.path.join(ROOT, "..", "shared", "vendor", "megatron-lm-core_v0.16.1.tar.gz")

#: The two lines a user adds to their pretrain_gpt.py (README, "EDGC in your Megatron-LM job").
ENABLE_LINE = "    import megatron_edgc.megatron_lm as edgc; edgc.enable()\n"
PROVIDER = "extra_args_provider=edgc.add_args,"

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "1000",
         "--make-vocab-size-divisible-by", "128"]
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
EDGC = ["--edgc-mode", "edgc", "--edgc-window", "2", "--edgc-warmup-max-iters", "2",
        "--edgc-rank-max", "8", "--edgc-rank-min", "2", "--edgc-rank-step", "2",
        "--edgc-iter-sample-rate", "1.0", "--edgc-bypass", "off", "--edgc-dac", "off",
        "--edgc-pp-compression", "edgc", "--edgc-pp-rank-max", "16"]


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    """(directory of Megatron-LM, the unmodified pretrain_gpt.py, the two-line copy)."""
    source = os.environ.get("EDGC_MEGATRON_LM") or SNAPSHOT
    if not os.path.exists(source):
        pytest.skip(f"no Megatron-LM here: {SNAPSHOT} is absent and EDGC_MEGATRON_LM is unset")
    if os.path.isdir(source):
        where = source
    else:
        where = str(tmp_path_factory.mktemp("megatron-lm"))
        with tarfile.open(source) as tar:
            tar.extractall(where, filter="data")
    original = os.path.join(where, "pretrain_gpt.py")
    with open(original) as fh:
        text = fh.read()
    marker = "    pretrain(\n"
    assert text.count(marker) == 1 and text.count("extra_args_provider=") == 1
    patched = text.replace(marker, ENABLE_LINE + marker)
    patched = re.sub(r"extra_args_provider=[^\n]*,", PROVIDER, patched)
    diff = list(difflib.ndiff(text.splitlines(), patched.splitlines()))
    added, removed = [d for d in diff if d[:2] == "+ "], [d for d in diff if d[:2] == "- "]
    assert len(added) == 2 and len(removed) == 1, (added, removed)  # two lines, one replaced
    copy = os.path.join(where, "pretrain_gpt_edgc.py")
    with open(copy, "w") as fh:
        fh.write(patched)
    return where, original, copy


def run_megatron_lm(megatron_lm, script: str, extra: list, tmp_path, name: str,
                    expect_ok: bool = True, nproc: int = 4):
    """One 4-process torchrun of ``script``; returns (output, Megatron's per-iteration lm
    losses, the EDGC metrics records)."""
    where = megatron_lm[0]
    metrics = str(tmp_path / f"{name}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "megatron_edgc.megatron_lm_cpu", script, *ARGS, *extra]
    if script != megatron_lm[1]:
        cmd += ["--edgc-metrics-file", metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([where, ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    if expect_ok:
        assert proc.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)]
    records = []
    if os.path.exists(metrics):
        with open(metrics) as fh:
            records = [json.loads(line) for line in fh]
    return out, losses, records


def stage_bytes(rank) -> list:
    """DP bytes one replica of each stage sends at ``rank`` (None: dense), from the shapes:
    (n+m) r per compressed matrix, the rest dense, one flag per bucket (one bucket)."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                        max_position_embeddings=64, make_vocab_size_divisible_by=128)
    model.resolve()
    parallel = ParallelConfig(pipeline_model_parallel_size=2, data_parallel_size=2)
    out = []
    for shapes in stage_param_shapes(model, parallel, vocab_size=1001):  # NullTokenizer + EOD
        if rank is None:
            out.append(4 * sum(n * m for n, m in map(matrix_shape, shapes)))
            continue
        elements = 1
        for shape in shapes:
            n, m = matrix_shape(shape)
            compressed = n > 1 and is_compressible(n, m, rank, 2.0)
            elements += (n + m) * rank if compressed else n * m
        out.append(4 * elements)
    return out


@pytest.fixture(scope="module")
def edgc_run(megatron_lm, tmp_path_factory):
    """One uninterrupted EDGC run of 8 iterations (DP and PP compression, TensorBoard)."""
    tmp = tmp_path_factory.mktemp("edgc")
    out, losses, records = run_megatron_lm(
        megatron_lm, megatron_lm[2], EDGC + ["--tensorboard-dir", str(tmp / "tb")], tmp, "edgc")
    return out, losses, records, str(tmp / "tb")


def test_mode_off_is_megatron_lm_and_edgc_trains_with_bytes_from_shapes(megatron_lm, edgc_run,
                                                                         tmp_path):
    _, unmodified, _ = run_megatron_lm(megatron_lm, megatron_lm[1], [], tmp_path, "plain")
    _, off, off_records = run_megatron_lm(megatron_lm, megatron_lm[2], [], tmp_path, "off")
    assert len(unmodified) == 8 and off == unmodified          # bitwise, as printed
    assert off_records == []                                   # nothing built, nothing logged
    out, losses, records, tb = edgc_run
    assert "DP compression (edgc): r_max: at rank 8 22 of 22 weight matrices compress" in out
    # Megatron-LM's line for iteration 2 prints the mean of iterations 1-2 (its loss
    # accumulator is first reset at iteration 2's log); every other line one iteration's.
    ours = [r["loss"] for r in records]
    assert len(losses) == 8 and ours[:1] + ours[2:] == pytest.approx(losses[:1] + losses[2:],
                                                                      rel=1e-6)
    assert (ours[0] + ours[1]) / 2 == pytest.approx(losses[1], rel=1e-6)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    assert losses[:2] == unmodified[:2]                        # dense warm-up
    dense = sum(stage_bytes(None)) * 2
    compressed = 0
    for rec in records:
        ranks = rec["rank_dp"]
        if rec["iteration"] <= 2:
            assert ranks == [None, None]
            assert rec["dp_bytes_sent_job"] == rec["dp_bytes_dense_job"] >= dense
            continue
        compressed += 1
        assert all(2 <= r <= 8 for r in ranks), ranks
        want = 2 * sum(stage_bytes(r)[s] for s, r in enumerate(ranks))
        assert rec["dp_bytes_sent_job"] == want, (rec["iteration"], ranks)
        assert rec["dp_bytes_sent_job"] < rec["dp_bytes_dense_job"] / 5
        assert 4 <= rec["rank_pp"] <= 16 and rec["pp_bytes_sent_job"] < rec["pp_bytes_dense_job"]
    assert compressed == 6
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "edgc/dp_bytes_sent_job" in tags and "edgc/rank_dp/stage1" in tags
    assert "lm loss" in tags                                   # Megatron-LM's own, same file
    sent = [e.value for e in events.Scalars("edgc/dp_bytes_sent_job")]
    assert sent == [float(r["dp_bytes_sent_job"]) for r in records]


def test_resume_from_megatron_lm_checkpoint_is_exact(megatron_lm, edgc_run, tmp_path):
    """Save at 4 (exit), resume to 8: the same losses, ranks and bytes as one run of 8."""
    ckpt = str(tmp_path / "ckpt")
    whole = edgc_run[2]
    save = EDGC + ["--save", ckpt, "--save-interval", "4"]
    run_megatron_lm(megatron_lm, megatron_lm[2], save + ["--exit-interval", "4"], tmp_path,
                    "resumed")
    sidecars = sorted(os.listdir(os.path.join(ckpt, "iter_0000004", "edgc")))
    assert sidecars == [f"tp00_pp{p:03d}_dp{d:05d}.pt" for p in (0, 1) for d in (0, 1)]
    out, _, resumed = run_megatron_lm(megatron_lm, megatron_lm[2], save + ["--load", ckpt],
                                      tmp_path, "resumed")
    assert "no compressor state" not in out
    keys = ("iteration", "loss", "rank_dp", "rank_pp", "dp_bytes_sent_job", "pp_bytes_sent_job")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole]
    assert any(r["rank_dp"] != [8, 8] for r in whole[2:])      # the controller moved


def test_bad_edgc_flag_fails_before_any_process_group(megatron_lm, tmp_path):
    out, losses, _ = run_megatron_lm(megatron_lm, megatron_lm[2],
                                     ["--edgc-mode", "static", "--edgc-rank", "0",
                                      "--pipeline-model-parallel-size", "1"], tmp_path,
                                     "bad", expect_ok=False, nproc=1)
    assert "error: --edgc-rank: must be in [1, inf] (got 0)" in out
    assert "initializing torch distributed" not in out and losses == []
