"""``scripts/gpu_check.py --device cpu``: the GPU checklist's dry run passes on CPU, with the
figures each check reports, and a lent device's report renders into BENCHMARKS.md."""

import argparse
import concurrent.futures
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ports_are_distinct_free_and_outside_the_ephemeral_range():
    """16 threads taking 8 ports each: 128 distinct ports, each bindable, below the
    kernel's ephemeral range (no other job's bind(0) or connect() can take one)."""
    gpu_check = load_gpu_check()
    ports = gpu_check.Ports()
    low = gpu_check.ephemeral_range()[0]
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as ex:
        taken = [p for batch in ex.map(lambda _: [ports.take() for _ in range(8)], range(16))
                 for p in batch]
    assert len(taken) == 128 and len(set(taken)) == 128
    assert all(1024 <= p < low for p in taken)
    with socket.socket() as busy:          # a port in use is passed over
        busy.bind(("127.0.0.1", ports.next))
        held = busy.getsockname()[1]
        assert ports.take() == held + 1


def test_modes_configs_and_variants_parse_as_comma_lists():
    gpu_check = load_gpu_check()
    modes = gpu_check.csv_list(gpu_check.MODES)
    assert modes("off,edgc") == ["off", "edgc"] and modes(" static ") == ["static"]
    for bad in ("dense", "off,dense", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            modes(bad)
    assert gpu_check.csv_list(gpu_check.E2E_VARIANTS, allow_empty=True)("") == []
    assert gpu_check.E2E_VARIANTS["e2e-gpt2-small-cpu-edgc-bf16grads"] == (
        "gpt2-small-cpu", "edgc", ["--edgc-rank-max", "64", "--grad-reduce-in-bf16"])


def test_the_plan_follows_modes_configs_and_the_gpu_count(tmp_path):
    """--modes static,edgc on one config: 2 e2e runs, the bf16-gradient variant only where
    its config is chosen, the plug-in's 2 modes x 2 gradient dtypes; the 4-process layouts
    on NCCL with 4 GPUs, else on CPU tensors and named so."""
    gpu_check = load_gpu_check()
    assert gpu_check.four_process_layout("cuda", 8)["backend"] == "nccl"
    one = gpu_check.four_process_layout("cuda", 1)
    assert (one["backend"], one["env"], one["suffix"]) == ("gloo", {"CUDA_VISIBLE_DEVICES": ""},
                                                           "-cpu-tensors")
    assert "1 GPU(s) < 4" in one["note"]
    assert gpu_check.four_process_layout("cpu", 0)["env"] == {}

    def plan(gpus, configs):
        args = argparse.Namespace(device="cuda", bf16=False, out=str(tmp_path), target=None,
                                  only=None, configs=configs, modes=["static", "edgc"],
                                  variants=list(gpu_check.E2E_VARIANTS), gpus=gpus, jobs=8)
        checks = gpu_check.Checklist.__new__(gpu_check.Checklist)
        checks.args, checks.cuda = args, True
        first, pool, last = checks.plan()
        return [n for n, _ in first], [n for n, _ in pool], [n for n, _ in last]

    first, pool, last = plan(1, ["gpt2-small-cpu"])
    assert first == ["install", "data"] and last == ["kernels"]
    assert pool == ["unit", "e2e-gpt2-small-cpu-static", "e2e-gpt2-small-cpu-edgc",
                    "e2e-gpt2-small-cpu-edgc-bf16grads", "e2e-gpt2-small-cpu-edgc-bf16dense",
                    "e2e-gpt2-small-cpu-edgc-timebudget", "gloo4-static-dp-cpu-tensors",
                    "gloo4-edgc-pp-cpu-tensors", "plugin-static", "plugin-static-bf16grads",
                    "plugin-edgc", "plugin-edgc-bf16grads", "sync"]
    _, pool, _ = plan(4, ["tiny-cpu"])
    assert "e2e-gpt2-small-cpu-edgc-bf16grads" not in pool
    assert {"nccl4-static-dp", "nccl4-edgc-pp"} <= set(pool)


def test_dry_run_passes_every_check(tmp_path):
    """Every check but the plug-in's (below, extended), 2 at a time."""
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--bf16", "--configs",
                           "tiny-cpu", "--jobs", "2", "--out", str(out), "--only", "install",
                           "data", "unit", "e2e", "gloo4", "sync", "kernels"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_report.json").read_text())
    checks = {c["check"]: c for c in report["checks"]}
    assert report["passed"]
    assert {"install", "data", "unit", "e2e-tiny-cpu-off", "e2e-tiny-cpu-static",
            "e2e-tiny-cpu-edgc", "gloo4-static-dp", "gloo4-edgc-pp", "kernels",
            "sync"} <= checks.keys()
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                                "tests/test_cuda.py"], cwd=ROOT, capture_output=True,
                               text=True, env={**os.environ, "EDGC_TEST_DEVICE": "cpu"})
    count = sum(1 for line in collected.stdout.splitlines() if "::" in line)
    assert count >= 10 and f"{count} passed" in checks["unit"]["summary"]
    off, static, edgc = (checks[f"e2e-tiny-cpu-{m}"] for m in ("off", "static", "edgc"))
    for c in (off, static, edgc):
        assert c["ok"] and c["loss_falls"]
        assert c["resume_max_abs_loss_diff"] == 0.0  # CPU: the resumed run is exact
    assert off["compressed_iterations"] == 0 and off["dp_bytes_last"] == off["dp_bytes_dense"]
    assert static["compressed_iterations"] == 40
    assert static["dp_bytes_last"] < static["dp_bytes_dense"] / 10
    # EDGC: dense through its warm-up (10 iterations), compressed after it
    assert edgc["compressed_iterations"] == 30
    kernels = json.loads((out / "kernels.json").read_text())
    assert set(kernels["configs"]) == {"gpt2-2.5b-v100x32", "gpt2-12.1b-h100x64"}
    assert all(r["total"] > 0 for e in kernels["configs"].values() for r in e["runs"])


@pytest.mark.extended   # about 3 min on 2 cores
def test_dry_run_of_the_plug_in_check(tmp_path):
    """Megatron-LM's own pretrain_gpt.py with the two lines, torch_dist saved at the
    midpoint and resumed: the same losses; modes static and edgc, bf16 gradients or not."""
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--only", "plugin",
                           "--jobs", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["check"]: c for c in json.loads((out / "gpu_report.json").read_text())["checks"]}
    assert set(checks) == {"plugin-static", "plugin-static-bf16grads", "plugin-edgc",
                           "plugin-edgc-bf16grads"}
    for c in checks.values():
        assert c["ok"] and c["resume_max_abs_loss_diff"] == 0.0 and not c["nonfinite_iterations"]
    assert checks["plugin-static"]["compressed_iterations"] == 12
    assert checks["plugin-edgc"]["compressed_iterations"] == 10   # dense through warm-up (2)


def test_a_device_report_renders_with_its_failure_causes(tmp_path, monkeypatch):
    sys.path.insert(0, ROOT)
    import bench.report

    gpu_check = load_gpu_check()
    target = tmp_path / "BENCHMARKS.md"
    monkeypatch.setattr(bench.report, "BENCHMARKS", str(target))
    gpu_check.write_benchmarks([os.path.join(ROOT, "bench", "results", "gpu",
                                             "h100-2026-11-24-run1.json")])
    text = target.read_text()
    assert "NVIDIA H100 80GB HBM3" in text and "2026-11-24 19:19 UTC" in text
    assert "| unit | pass |" in text
    assert "Cannot re-initialize CUDA in forked subprocess" in text
