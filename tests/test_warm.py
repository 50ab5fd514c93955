"""The warm job starter (``tests/warm.py``) against a cold start of the same commands: the
same exit codes, output, ``argv``, directory and environment; a timeout ends the job and
its workers; a failed torchrun worker stops its peers."""

import os
import subprocess
import sys
import time

import pytest

import warm

SCRIPT = """
import json, os, sys, time
rank = os.environ.get("RANK")
if os.environ.get("EDGC_WARM_SLEEP"):
    time.sleep({None: float(os.environ["EDGC_WARM_SLEEP"]), "2": 60}.get(rank, 0))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "rank": rank,
                  "world": os.environ.get("WORLD_SIZE"), "main": __name__,
                  "flag": os.environ.get("EDGC_WARM_FLAG"), "path0": sys.path[0]}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("EDGC_WARM_EXIT", "0")) if rank in (None, "1") else 0)
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return str(path)


def test_a_warm_job_is_the_cold_one(script, tmp_path):
    env = dict(os.environ, EDGC_WARM_FLAG="x", EDGC_WARM_EXIT="3")
    cmd = [sys.executable, script, "--a", "1"]
    cold = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True)
    hot = warm.run(cmd, env=env, cwd=str(tmp_path), timeout=60)
    assert (hot.returncode, hot.stdout, hot.stderr) == \
        (cold.returncode, cold.stdout, cold.stderr) == (3, cold.stdout, "to stderr\n")
    assert '"flag": "x"' in hot.stdout and '"main": "__main__"' in hot.stdout


def test_a_warm_torchrun_gives_each_worker_its_rank_and_stops_them_at_a_failure(script,
                                                                                tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "3", script]
    ok = warm.run(cmd, cwd=str(tmp_path), timeout=60)
    assert ok.returncode == 0
    assert sorted(line.split('"rank": ')[1][:3] for line in ok.stdout.splitlines()) == \
        ['"0"', '"1"', '"2"']
    assert all('"world": "3"' in line for line in ok.stdout.splitlines())
    start = time.monotonic()   # rank 1 fails at once, rank 2 would sleep for a minute
    failed = warm.run(cmd, env=dict(os.environ, EDGC_WARM_EXIT="5", EDGC_WARM_SLEEP="0"),
                      cwd=str(tmp_path), timeout=60)
    assert failed.returncode == 5 and time.monotonic() - start < 30


def test_a_warm_job_past_its_timeout_is_ended(script, tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, script], env=dict(os.environ, EDGC_WARM_SLEEP="60"),
                 cwd=str(tmp_path), timeout=2)
    assert time.monotonic() - start < 20
    again = warm.run([sys.executable, script], cwd=str(tmp_path), timeout=60)
    assert again.returncode == 0   # the server goes on
