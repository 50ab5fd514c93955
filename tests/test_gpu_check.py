"""``scripts/gpu_check.py --device cpu``: the GPU checklist's dry run passes on CPU, with the
figures each check reports, and a lent device's report renders into BENCHMARKS.md."""

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def test_dry_run_passes_every_check(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--bf16", "--configs",
                           "tiny-cpu", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
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


def test_a_device_report_renders_with_its_failure_causes(tmp_path, monkeypatch):
    sys.path.insert(0, ROOT)
    import bench.report

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    target = tmp_path / "BENCHMARKS.md"
    monkeypatch.setattr(bench.report, "BENCHMARKS", str(target))
    gpu_check.write_benchmarks([os.path.join(ROOT, "bench", "results", "gpu",
                                             "h100-2026-11-24-run1.json")])
    text = target.read_text()
    assert "NVIDIA H100 80GB HBM3" in text and "2026-11-24 19:19 UTC" in text
    assert "| unit | pass |" in text
    assert "Cannot re-initialize CUDA in forked subprocess" in text
