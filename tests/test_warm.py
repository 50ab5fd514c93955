"""The warm job starter (``tests/warm.py``) against a cold start of the same commands: the
same exit codes, output, ``argv``, directory and environment; a timeout ends the job and
its workers; a failed torchrun worker stops its peers; a torchrun job runs what torchrun
gives it (issue 81)."""

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
    assert failed.returncode == 1 and time.monotonic() - start < 30   # torchrun's code
    assert "Root Cause (first observed failure):\n  rank: 1" in failed.stderr


def test_a_warm_job_past_its_timeout_is_ended(script, tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, script], env=dict(os.environ, EDGC_WARM_SLEEP="60"),
                 cwd=str(tmp_path), timeout=2)
    assert time.monotonic() - start < 20
    again = warm.run([sys.executable, script], cwd=str(tmp_path), timeout=60)
    assert again.returncode == 0   # the server goes on


PRODUCTION = """
import json, os, random, signal, sys, threading
import torch, torch.distributed as dist
dist.init_process_group("gloo")
from megatron_edgc.runtime import lost_ranks
watching = lost_ranks.watch()
handler = signal.getsignal(signal.SIGTERM)
print(json.dumps({"rank": os.environ["RANK"], "watching": watching,
                  "threads": sorted(t.name for t in threading.enumerate()
                                    if t.name.startswith("edgc")),
                  "sigterm": getattr(handler, "__name__", str(handler)),
                  "omp": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
                  "error_file": bool(os.environ.get("TORCHELASTIC_ERROR_FILE")),
                  "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}), flush=True)
print(random.random(), file=sys.stderr)
dist.barrier()
if os.environ.get("EDGC_WARM_FAIL") == os.environ["RANK"]:
    raise SystemExit(3)
dist.destroy_process_group()
"""


def test_a_warm_torchrun_job_runs_what_a_cold_one_runs(tmp_path):
    """Issue 81: under the warm torchrun the production code finds what torchrun gives it:
    the agent's store (the lost-rank watcher's thread and SIGTERM handler run), an error
    file per worker, ``OMP_NUM_THREADS=1`` where unset; a failing rank gives torchrun's
    exit code 1 both ways; each job its own RNG state; the warnings its imports give, on
    its own stderr, as a cold run's."""
    import json

    script = tmp_path / "production.py"
    script.write_text(PRODUCTION)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script)]
    seen = {}
    for how, run in (("cold", subprocess.run), ("warm", warm.run)):
        for fail in ("", "1"):
            kwargs = dict(capture_output=True, text=True) if how == "cold" else {}
            proc = run(cmd, env=dict(env, EDGC_WARM_FAIL=fail), cwd=str(tmp_path),
                       timeout=240, **kwargs)
            lines = sorted((json.loads(line) for line in proc.stdout.splitlines()
                            if line.startswith("{")), key=lambda r: r["rank"])
            seen[how, fail] = (proc.returncode, lines, proc.stderr)
    for fail, code in (("", 0), ("1", 1)):
        cold, hot = seen["cold", fail], seen["warm", fail]
        assert cold[0] == hot[0] == code, (cold[2][-2000:], hot[2][-2000:])
        assert cold[1] == hot[1] and len(hot[1]) == 2, (cold[1], hot[1])
    first = hot[1][0]
    assert first["watching"] and first["threads"] == ["edgc-lost-ranks"]
    assert first["sigterm"] == "_on_sigterm" and first["agent_store"] == "True"
    assert first["omp"] == "1" and first["torch_threads"] == 1 and first["error_file"]
    draws = [set(line for line in seen["warm", f][2].splitlines() if line.startswith("0."))
             for f in ("", "1")]
    assert len(draws[0]) == 2 and not draws[0] & draws[1]   # fresh per worker and job


def test_a_warm_job_prints_the_warnings_of_its_own_imports(tmp_path):
    """A warm job's stderr has the import-time warnings a cold run of it prints (the
    server imported those modules already), and a job that imports none of them none."""
    heavy, light = tmp_path / "heavy.py", tmp_path / "light.py"
    heavy.write_text("import megatron.core.models.gpt\nprint('ok')\n")
    light.write_text("import json\nprint('ok')\n")
    for script, warns in ((heavy, True), (light, False)):
        cmd = [sys.executable, str(script)]
        cold = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path))
        hot = warm.run(cmd, cwd=str(tmp_path), timeout=120)
        assert hot.stderr == cold.stderr and ("UserWarning" in hot.stderr) == warns
