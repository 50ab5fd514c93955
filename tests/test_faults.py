"""Faults: a rank killed mid-run is named by the launcher (under torchrun, by the first rank
to fail), the job comes back from the last checkpoint and the trajectory is the
uninterrupted one; metrics continue without duplicates. A failed save keeps the last
checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import warm
from distributed import read_jsonl
from megatron_edgc.runtime.telemetry import MetricsWriter
from megatron_edgc.training.launch import worker_name

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
    """The plain launcher's worker of ``rank`` under ``pid``, by the name it gives each
    (a forked worker's command line and /proc environment are the launcher's)."""
    found = []
    for child in _descendants(pid):
        try:
            with open(f"/proc/{child}/comm") as fh:
                if fh.read().rstrip("\n") == worker_name(rank):
                    found.append(child)
        except OSError:
            continue
    assert len(found) <= 1, found
    return found[0] if found else None


@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2"],
    # the slow hop: 2 distributed-optimizer instances of 2, bf16 gradient buffers
    ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
     "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2", "--bf16",
     "--grad-reduce-in-bf16"],
], ids=["pp2-dp2", "instances-2-bf16"])
def test_killed_rank_restarts_from_last_checkpoint(layout, small_model_argv, tmp_path):
    """Rank 2 SIGKILLed while training, past the checkpoint at 5 (the plain launcher, 4
    local processes): the launcher names it, alone; the same command again resumes from
    the last checkpoint, and the trajectory is the uninterrupted one, each iteration once."""
    base = small_model_argv + layout + ["--edgc-mode", "static", "--edgc-rank", "4",
                                        "--train-iters", "20", "--eval-interval", "10"]
    script = os.path.join(ROOT, "pretrain_gpt2_edgc.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = str(tmp_path / "full.jsonl")
    warm.run([sys.executable, script, *base, "--metrics-file", full], check=True,
             timeout=300, cwd=ROOT, env=env)
    metrics, ck = str(tmp_path / "m.jsonl"), str(tmp_path / "ck")
    # a restartable job: --load = --save (no checkpoint yet: it starts from 0)
    cmd = [sys.executable, script, *base, "--metrics-file", metrics, "--save", ck,
           "--load", ck, "--save-interval", "5"]
    with open(tmp_path / "out.log", "w") as out, open(tmp_path / "err.log", "w") as err:
        job = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env)
        killed_after, code = kill_rank_after(job, metrics, 8, 2, _worker_with_rank)
    stderr = (tmp_path / "err.log").read_text()
    assert killed_after is not None and killed_after < 20, "the run ended before the kill"
    assert code == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: rank 2 of 4 was killed by SIGKILL first (the other ranks were "
                      "stopped)"], stderr[-3000:]
    assert "Traceback" not in stderr and "gloo" not in stderr.lower(), stderr[-3000:]
    crashed = [r["iteration"] for r in read_jsonl_lenient(metrics)]
    last = int(open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read())
    assert last in (5, 10, 15) and last <= crashed[-1] < 20, (last, crashed)
    assert crashed == list(range(1, crashed[-1] + 1))

    again = warm.run(cmd, timeout=300, cwd=ROOT, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ck} at iteration {last}\n" in again.stdout, again.stdout[-3000:]
    got = read_jsonl(metrics)
    assert [r["iteration"] for r in got] == list(range(1, 21))   # each once, none lost
    want = read_jsonl(full)
    assert [r["loss"] for r in got] == [r["loss"] for r in want]  # bit-exact trajectory
    assert got[-1]["val_loss"] == want[-1]["val_loss"]
    assert open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read() == "20"


def read_jsonl_lenient(path) -> list:
    """The records written so far (none before the file exists; a line being written is
    left out)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def kill_rank_after(job, metrics: str, after: int, rank: int, find_worker) -> tuple:
    """SIGKILL ``rank``'s worker of the running ``job`` (``find_worker(job.pid, rank)``) once
    its metrics file has reached iteration ``after``; returns (the last iteration recorded
    at the kill or None when the job ended first, the job's exit code). The job is killed
    if it outlives the waits."""
    killed_after = None
    try:
        deadline = time.monotonic() + 240
        while killed_after is None and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.02)
            done = [r["iteration"] for r in read_jsonl_lenient(metrics)]
            if done and done[-1] >= after:
                victim = find_worker(job.pid, rank)
                assert victim is not None, f"rank {rank}'s worker not found"
                os.kill(victim, signal.SIGKILL)
                killed_after = done[-1]
        return killed_after, job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()


CRASHING_JOB = """
import os, signal, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from megatron_edgc.training.launch import spawn_local

def target(rank, world, local):
    dist.init_process_group("gloo")
    dist.barrier()
    if {unseen}:   # the launcher is stopped until its peers have failed too
        if rank == 1:
            os.kill(os.getppid(), signal.SIGSTOP)
        if rank == 2:
            time.sleep(2.0)
            os.kill(os.getppid(), signal.SIGCONT)
    if rank == 1 and {kill}:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        raise ValueError("the disk is on fire")
    dist.all_reduce(torch.ones(1))   # the peers wait for rank 1: closed connection
    return 0

sys.exit(spawn_local(target, 4))
"""


def run_crashing_job(tmp_path, kill: bool, unseen: bool = False):
    """The job above on 4 gloo ranks; returns (stderr, its ``error:`` lines). ``unseen``:
    the launcher sees rank 1's end only together with its peers' ends."""
    script = tmp_path / "job.py"
    script.write_text(CRASHING_JOB.format(root=ROOT, kill=kill, unseen=unseen))
    proc = warm.run([sys.executable, str(script)], timeout=120)
    assert proc.returncode == 1
    # The peers' consequences (gloo's closed connections) are never shown.
    assert "gloo" not in proc.stderr.lower() and "Connection closed" not in proc.stderr
    return proc.stderr, [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def test_the_failing_ranks_own_error_comes_first_and_once(tmp_path):
    stderr, errors = run_crashing_job(tmp_path, kill=False)
    assert errors == ["error: rank 1 of 4 failed first: ValueError: the disk is on fire"], stderr
    assert stderr.count("Traceback") == 1 and "raise ValueError" in stderr


@pytest.mark.parametrize("unseen", [False, True], ids=["seen", "seen-with-its-peers"])
def test_a_rank_killed_by_a_signal_is_named(tmp_path, unseen):
    """Also when a busy launcher wakes once for the killed rank and the peers it broke
    (their ends are reported in rank order, not in time order: rank 0 comes first)."""
    stderr, errors = run_crashing_job(tmp_path, kill=True, unseen=unseen)
    assert errors == ["error: rank 1 of 4 was killed by SIGKILL first (the other ranks were "
                      "stopped)"], stderr
    assert "Traceback" not in stderr


#: the slow hop: 2 distributed-optimizer instances of 2, bf16 training and gradient buffers
SLOW_HOP_BF16 = ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
                 "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                 "--bf16", "--grad-reduce-in-bf16"]


def test_failed_save_says_so_once_and_keeps_the_last_checkpoint(small_model_argv, tmp_path):
    """A multi-instance bf16 job that cannot save iteration 10: one error line, and
    iteration 5 stays complete, named by ``latest``, with every rank's EDGC state; a job
    resumed from it repeats iterations 6-7 of the failed run bit for bit. (The save path
    is the same on every layout; the resume of this layout from a good save:
    tests/test_checkpoint.py.)"""
    save = tmp_path / "ckpt"
    save.mkdir()
    # The save of iteration 10 cannot create its staging directory: a file is in the way.
    (save / "iter_0000010.tmp").write_text("in the way")
    script = os.path.join(ROOT, "pretrain_gpt2_edgc.py")
    base = small_model_argv + SLOW_HOP_BF16 + ["--train-iters", "10", "--edgc-mode", "static",
                                              "--edgc-rank", "4"]
    failed = str(tmp_path / "failed.jsonl")
    proc = warm.run([sys.executable, script, *base, "--save", str(save),
                     "--save-interval", "5", "--metrics-file", failed], timeout=300)
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
    assert sorted(os.listdir(save / "iter_0000005")) == [
        "model_optim_tp00_pp000.pt", "precision.txt",
        *(f"rank_state_{r:05d}.pt" for r in range(4))]
    assert (save / "iter_0000005" / "precision.txt").read_text() == "bf16\n"
    import torch

    for name in os.listdir(save / "iter_0000005"):
        if name == "precision.txt":
            continue
        state = torch.load(save / "iter_0000005" / name, weights_only=False)
        assert state["iteration"] == 5
        if not name.startswith("rank_state"):
            continue
        # this rank's distributed-optimizer shard and its compressor's state: a residual
        # and a warm start per matrix of its shard, at rank 4, from training
        assert state["distributed_optimizer"], name
        compressor = state["extensions"]["dp_compression"]
        assert compressor["rank"] == 4 and compressor["buckets"], name
        for bucket in compressor["buckets"].values():
            assert bucket["matrices"], name
            for matrix in bucket["matrices"].values():
                assert matrix["q"].shape[-1] == 4, name
                assert torch.isfinite(matrix["residual"]).all(), name
                assert matrix["residual"].abs().sum() > 0, name
    # Resumed from it: iterations 6 and 7 of the failed run, bit for bit (the residuals
    # enter the update of iteration 6, so the loss of 7).
    resumed = str(tmp_path / "resumed.jsonl")
    proc = warm.run([sys.executable, script, *base, "--load", str(save),
                     "--exit-interval", "7", "--metrics-file", resumed], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {save} at iteration 5\n" in proc.stdout, proc.stdout[-3000:]
    assert "compressor state" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    want = {r["iteration"]: r["loss"] for r in read_jsonl(failed)}
    assert [(r["iteration"], r["loss"]) for r in read_jsonl(resumed)] == \
        [(6, want[6]), (7, want[7])]


#: 4 gloo ranks under torchrun, the EDGC report in their failure path: rank 2 is SIGKILLed
#: while the others wait for it in an all-reduce ("killed"), or rank 1 raises an error of
#: its own there ("own-error").
TORCHRUN_JOB = """
import os, signal, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from megatron_edgc.runtime import lost_ranks

dist.init_process_group("gloo")
assert lost_ranks.watch()    # torchrun: its agent's store
rank = dist.get_rank()
try:
    dist.barrier()
    if rank == 2 and {case!r} == "killed":
        time.sleep(0.3)      # the others wait in the all-reduce
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1 and {case!r} == "own-error":
        raise ValueError("the disk is on fire")
    dist.all_reduce(torch.ones(1))
except BaseException as exc:
    lost_ranks.report(exc)
    raise
"""


@pytest.mark.parametrize("case", ["killed", "own-error"])
def test_torchrun_names_a_lost_rank_once(tmp_path, case):
    """Under torchrun, whose own root cause is not reliably the SIGKILLed rank (it goes by
    the earliest error file, and that rank writes none: docs/reliability.md), the first
    rank to fail names rank 2, once; a rank that fails with an error of its own is not
    called lost, and nothing is named."""
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_JOB.format(root=ROOT, case=case))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", str(script)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    lost = [line for line in proc.stderr.splitlines() if "was lost" in line]
    if case == "killed":
        assert lost == ["error: rank 2 of 4 was lost (no error of its own, no answer: killed, "
                        "crashed, or its host is gone); the other ranks' errors followed "
                        "from it"], proc.stderr[-4000:]
    else:
        assert lost == [] and "ValueError: the disk is on fire" in proc.stderr, \
            proc.stderr[-4000:]
