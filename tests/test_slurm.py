"""The Slurm scripts and the sweep against a real single-node Slurm (Debian's slurm-wlm and
munge; slurmctld and slurmd on this machine, started here, stopped after). Skips, saying
why, where Slurm cannot be installed or started (not root, no apt)."""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import sweep  # noqa: E402


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensure_installed():
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and cannot be (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm",
                 "munge"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            return f"apt-get could not install slurm-wlm/munge: {proc.stderr.strip()[-200:]}"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node cluster on localhost; yields the environment for its client commands."""
    why = _ensure_installed()
    if why:
        pytest.skip(why)
    if os.geteuid() != 0:
        pytest.skip("starting slurmd needs root")
    base = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    conf = base / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=edgctest", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"StateSaveLocation={base}/state",
        f"SlurmdSpoolDir={base}/spool", f"SlurmctldPidFile={base}/slurmctld.pid",
        f"SlurmdPidFile={base}/slurmd.pid", f"SlurmctldLogFile={base}/slurmctld.log",
        f"SlurmdLogFile={base}/slurmd.log", f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/builtin",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=edgc Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""]))
    (base / "state").mkdir()
    (base / "spool").mkdir()
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started = []
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode != 0:
        if not os.path.exists("/etc/munge/munge.key"):
            pytest.skip("munge has no key (/etc/munge/munge.key)")
        os.makedirs("/run/munge", exist_ok=True)
        subprocess.run(["munged", "--force"], capture_output=True, timeout=30)
        started.append("/run/munge/munged.pid")
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode:
            pytest.skip("munged did not start (no credentials for Slurm)")
    for daemon in ("slurmctld", "slurmd"):
        proc = subprocess.run([daemon, "-f", str(conf)], capture_output=True, text=True,
                              env=env, timeout=60)
        if proc.returncode != 0:
            pytest.skip(f"{daemon} did not start: {proc.stderr.strip()[-200:]}")
        started.append(base / f"{daemon}.pid")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                 env=env).stdout
            if "idle" in out:
                break
            time.sleep(0.5)
        else:
            pytest.skip(f"the node never became idle: {(base / 'slurmd.log').read_text()[-300:]}")
        yield env
    finally:
        subprocess.run(["scancel", "--user", "root"], env=env, capture_output=True)
        for pid_file in started:  # only what this fixture started
            try:
                with open(pid_file) as fh:
                    os.kill(int(fh.read().strip()), 15)
            except (OSError, ValueError):
                pass


def test_sweep_runs_on_slurm_and_collects(slurm, tmp_path, monkeypatch, corpus_data):
    """Two points of a sweep (dense, static r4) as two sbatch jobs of scripts/slurm/edgc.sbatch
    on the tiny config, then the collector's table from their metrics."""
    out = tmp_path / "sweep"
    spec = tmp_path / "sweep.yaml"
    spec.write_text(f"""
base_config: configs/tiny-cpu.yaml
sbatch_script: scripts/slurm/edgc.sbatch
sbatch_args: ["--nodes", "1", "--exclusive"]
env: {{NPROC_PER_NODE: "4"}}
out: {out}
flags: ["--data-path", "{corpus_data['prefix']}", "--vocab-file", "{corpus_data['vocab_file']}",
        "--tokenizer-type", "CorpusBPETokenizer", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "6", "--lr-warmup-iters", "1",
        "--eval-interval", "6", "--eval-iters", "1", "--edgc-bypass", "off"]
ranks: [4]
modes: ["off", "static"]
""")
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    jobs = sweep.submit(str(spec), dry_run=False)
    assert [name for name, _ in jobs] == ["dense", "static-r4"]
    deadline = time.monotonic() + 420
    ids = [job for _, job in jobs]
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i"],
                                capture_output=True, text=True, env=slurm).stdout.split()
        if not queued:
            break
        time.sleep(1)
    else:
        pytest.fail("sweep jobs still queued after 7 minutes")
    logs = {name: (out / f"{name}.out").read_text() for name, _ in jobs}
    rows = sweep.collect(str(out))
    assert [r["point"] for r in rows] == ["dense", "static-r4"], logs
    for r in rows:
        assert r["iterations"] == 6 and r["grad_sync_ms"] > 0 and r["ms_per_iter"] > 0
        assert 0 < r["val_loss"] < 20
    dense, static = rows
    assert static["dp_mib_per_iter"] < dense["dp_mib_per_iter"] / 3
    assert "edgc: 1 node(s) x 4 process(es)" in logs["dense"]
