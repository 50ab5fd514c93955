"""Bad checkpoints and paths given to --load: one line naming the flag, a non-zero exit,
no hang (every subprocess has a timeout), and the checkpoint directory left as it was."""

import hashlib
import os
import sys

import pytest

import warm
from megatron_edgc.config import ConfigError, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PP2 = ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2"]


def fail(argv, fragment):
    with pytest.raises(ConfigError) as info:
        parse_config(argv)
    message = str(info.value)
    assert message.startswith("--load:") and fragment in message and "\n" not in message, \
        message
    return message


def fake_checkpoint(root, iteration=5, files=("model_optim_tp00_pp000.pt",
                                               "model_optim_tp00_pp001.pt")):
    it = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(it)
    for f in files:
        with open(os.path.join(it, f), "wb") as fh:
            fh.write(b"x")
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))
    return it


def test_load_preflight_names_the_problem(small_model_argv, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    fail(small_model_argv + PP2 + ["--load", str(empty)], "holds no checkpoint")
    # --load = --save on an empty directory is a restartable job's first start: fine
    parse_config(small_model_argv + PP2 + ["--load", str(empty), "--save", str(empty)])
    ck = tmp_path / "ck"
    fake_checkpoint(str(ck))
    parse_config(small_model_argv + PP2 + ["--load", str(ck)])            # TP1 x PP2: ok
    parse_config(small_model_argv + ["--pipeline-model-parallel-size", "2",
                                     "--data-parallel-size", "1", "--global-batch-size", "4",
                                     "--load", str(ck)])                   # DP may change
    fail(small_model_argv + ["--pipeline-model-parallel-size", "1", "--data-parallel-size",
                             "4", "--load", str(ck)], "saved with another layout (TP 1 x PP 2")
    fail(small_model_argv + ["--tensor-model-parallel-size", "2", "--data-parallel-size", "1",
                             "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                             "--load", str(ck)], "this run: TP 2 x PP 2")
    (ck / "latest_checkpointed_iteration.txt").write_text("five")
    fail(small_model_argv + PP2 + ["--load", str(ck)], "does not hold an iteration number")
    (ck / "latest_checkpointed_iteration.txt").write_text("7")
    fail(small_model_argv + PP2 + ["--load", str(ck)], "iter_0000007 is missing")
    (ck / "latest_checkpointed_iteration.txt").write_text("5")
    open(ck / "iter_0000005" / "model_optim_tp00_pp001.pt", "wb").close()
    fail(small_model_argv + PP2 + ["--load", str(ck)], "is empty (a corrupted checkpoint)")


def digest(root):
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            h.update(f.encode())
            h.update(open(os.path.join(dirpath, f), "rb").read())
    return h.hexdigest()


def test_corrupted_checkpoint_fails_cleanly_and_is_not_overwritten(small_model_argv,
                                                                   tmp_path):
    ck = str(tmp_path / "ck")
    run = [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"), *small_model_argv,
           *PP2, "--train-iters", "2", "--eval-interval", "2", "--lr-warmup-iters", "1"]
    warm.run(run + ["--save", ck], check=True, timeout=300, cwd=ROOT)
    target = os.path.join(ck, "iter_0000002", "model_optim_tp00_pp001.pt")
    data = open(target, "rb").read()
    open(target, "wb").write(data[: len(data) // 3])                     # truncated
    before = digest(ck)
    proc = warm.run(run + ["--train-iters", "4", "--load", ck, "--save", ck],
                    timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    errors = {l for l in proc.stderr.splitlines() if l.startswith("error:")}
    assert len(errors) == 1, proc.stderr[-3000:]                          # one distinct line
    (line,) = errors
    assert line.startswith("error: --load:") and "model_optim_tp00_pp001.pt cannot be read" \
        in line, line
    assert digest(ck) == before                                           # nothing written
