"""Faults: a rank killed mid-run under torchrun --max-restarts comes back from the last
checkpoint and the trajectory is the uninterrupted one; metrics continue without
duplicates."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from distributed import read_jsonl
from megatron_edgc.runtime.telemetry import MetricsWriter
from megatron_edgc.training.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_metrics_resume_drops_a_crashed_attempts_records(tmp_path):
    path = str(tmp_path / "m.jsonl")
    with open(path, "w") as fh:
        for it in range(1, 8):
            fh.write(json.dumps({"iteration": it, "loss": float(it)}) + "\n")
        fh.write('{"iteration": 8, "lo')                      # torn by the kill
    writer = MetricsWriter(path, None, True, resume_from=4)
    writer.write({"iteration": 5, "loss": 50.0})
    writer.close()
    assert [(r["iteration"], r["loss"]) for r in read_jsonl(path)] == \
        [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]
    MetricsWriter(path, None, True).close()                   # a fresh run starts empty
    assert read_jsonl(path) == []


def _descendants(pid: int) -> list:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    kids = [int(c) for c in fh.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def _worker_with_rank(pid: int, rank: int):
    for child in _descendants(pid):
        try:
            with open(f"/proc/{child}/environ", "rb") as fh:
                env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if b"pretrain_gpt2_edgc.py" in cmd and env.get(b"RANK") == str(rank).encode():
            return child
    return None


@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2"],
    # the slow hop: 2 distributed-optimizer instances of 2, bf16 gradient buffers
    ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
     "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2", "--bf16",
     "--grad-reduce-in-bf16"],
], ids=["pp2-dp2", "instances-2-bf16"])
def test_killed_rank_restarts_from_last_checkpoint(layout, small_model_argv, tmp_path):
    base = small_model_argv + layout + ["--edgc-mode", "static", "--edgc-rank", "4",
                                        "--train-iters", "20", "--eval-interval", "10"]
    full = str(tmp_path / "full.jsonl")
    subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"), *base,
                    "--metrics-file", full], check=True, capture_output=True, timeout=300,
                   cwd=ROOT)
    metrics, ck = str(tmp_path / "m.jsonl"), str(tmp_path / "ck")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--max-restarts", "1", "--monitor-interval", "0.5", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           os.path.join(ROOT, "pretrain_gpt2_edgc.py"), *base, "--metrics-file", metrics,
           "--save", ck, "--load", ck, "--save-interval", "5"]
    log = open(tmp_path / "torchrun.log", "w")
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    killed_at = None
    try:
        deadline = time.monotonic() + 240
        while killed_at is None and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
            if not os.path.exists(metrics):
                continue
            done = [r["iteration"] for r in read_jsonl_lenient(metrics)]
            if done and done[-1] >= 8:                   # past the checkpoint at 5
                victim = _worker_with_rank(job.pid, 2)
                assert victim is not None, "rank 2's process not found"
                os.kill(victim, signal.SIGKILL)
                killed_at = done[-1]
        assert killed_at is not None and killed_at < 20, "the run ended before the kill"
        assert job.wait(timeout=300) == 0, open(tmp_path / "torchrun.log").read()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    text = open(tmp_path / "torchrun.log").read()
    resumed = re.findall(r"resumed from \S+ at iteration (\d+)", text)
    assert resumed and int(resumed[0]) in (5, 10, 15) and int(resumed[0]) <= killed_at, \
        text[-3000:]
    got = read_jsonl(metrics)
    assert [r["iteration"] for r in got] == list(range(1, 21))   # each once, none lost
    want = read_jsonl(full)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bit-exact trajectory
    assert got[-1]["val_loss"] == want[-1]["val_loss"]
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read() == "20"


def read_jsonl_lenient(path):
    out = []
    with open(path) as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


CRASHING_JOB = """
import os, signal, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from megatron_edgc.training.launch import spawn_local

def target(rank, world, local):
    dist.init_process_group("gloo")
    dist.barrier()
    if rank == 1 and {kill}:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        raise ValueError("the disk is on fire")
    dist.all_reduce(torch.ones(1))   # the peers wait for rank 1: closed connection
    return 0

sys.exit(spawn_local(target, 4))
"""


def run_crashing_job(tmp_path, kill: bool):
    """The job above on 4 gloo ranks; returns (stderr, its ``error:`` lines)."""
    script = tmp_path / "job.py"
    script.write_text(CRASHING_JOB.format(root=ROOT, kill=kill))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    # The peers' consequences (gloo's closed connections) are never shown.
    assert "gloo" not in proc.stderr.lower() and "Connection closed" not in proc.stderr
    return proc.stderr, [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_the_failing_ranks_own_error_comes_first_and_once(tmp_path):
    stderr, errors = run_crashing_job(tmp_path, kill=False)
    assert errors == ["error: rank 1 of 4 failed first: ValueError: the disk is on fire"], stderr
    assert stderr.count("Traceback") == 1 and "raise ValueError" in stderr


def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    stderr, errors = run_crashing_job(tmp_path, kill=True)
    assert errors == ["error: rank 1 of 4 was killed by SIGKILL first (the other ranks were "
                      "stopped)"], stderr
    assert "Traceback" not in stderr


def test_failed_save_says_so_once_and_keeps_the_last_checkpoint(small_model_argv, tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    # The save of iteration 10 cannot create its staging directory: a file is in the way.
    (save / "iter_0000010.tmp").write_text("in the way")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"), *small_model_argv,
         "--train-iters", "10", "--save", str(save), "--save-interval", "5",
         "--edgc-mode", "static", "--edgc-rank", "4"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: --save: saving iteration 10 failed on rank 0: "
                                "FileExistsError: "), errors
    assert errors[0].endswith(f"; the last complete checkpoint is iteration 5 in {save}, "
                              f"intact"), errors
    assert "Traceback" not in proc.stderr and "gloo" not in proc.stderr.lower()
    # Iteration 5 is intact and loadable, the pointer still names it, nothing half-written.
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert sorted(os.listdir(save)) == ["iter_0000005", "iter_0000010.tmp",
                                        "latest_checkpointed_iteration.txt"]
    assert (save / "iter_0000010.tmp").read_text() == "in the way"
    import torch

    for name in os.listdir(save / "iter_0000005"):
        state = torch.load(save / "iter_0000005" / name, weights_only=False)
        assert state["iteration"] == 5
