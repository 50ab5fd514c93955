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


def test_two_checklists_take_ports_from_blocks_of_their_own():
    """Each checklist (here two allocators, each with its own lock on its block, as two
    processes have) starts in a block the other does not hold: 2 x 100 ports, no overlap."""
    gpu_check = load_gpu_check()
    first, second = gpu_check.Ports(), gpu_check.Ports()
    a = {first.take() for _ in range(100)}
    b = {second.take() for _ in range(100)}
    assert len(a) == len(b) == 100 and not a & b
    assert abs(min(b) - min(a)) >= gpu_check.Ports.BLOCK


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
                                  e2e_iters=40,
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
                    "e2e-gpt2-small-cpu-edgc-timebudget", "e2e-gpt2-small-cpu-static-fp16",
                    "e2e-gpt2-small-cpu-edgc-fp16", "gloo4-static-dp-cpu-tensors",
                    "gloo4-edgc-pp-cpu-tensors", "plugin-static", "plugin-static-bf16grads",
                    "plugin-edgc", "plugin-edgc-bf16grads", "sync"]
    _, pool, _ = plan(4, ["tiny-cpu"])
    assert "e2e-gpt2-small-cpu-edgc-bf16grads" not in pool
    assert {"nccl4-static-dp", "nccl4-edgc-pp"} <= set(pool)


def dry_run(tmp_path, only: list, modes: str) -> tuple[dict, object]:
    """The checklist on the CPU (``--only``, e2e ``--modes``), 2 checks at a time, the e2e
    runs at 20 iterations (the checklist's 40 on the device), in bf16 where the CPU has
    bf16 instructions (issue 80: an AMD EPYC of family 25 converts every bf16 operand);
    returns (checks by name, the report's folder)."""
    from megatron_edgc.config.host import cpu_bf16

    out = tmp_path / "report"
    bf16 = ["--bf16"] if cpu_bf16()[0] else []
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", *bf16, "--configs",
                           "tiny-cpu", "--e2e-iters", "20", "--jobs", "2", "--out", str(out),
                           "--modes", modes, "--only", *only], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_report.json").read_text())
    assert report["passed"]
    return {c["check"]: c for c in report["checks"]}, out


def test_dry_run_passes_every_check(tmp_path):
    """Every check but the plug-in's, the dense e2e run's and the kernels' (below,
    extended), the e2e runs of the compressing modes. Issue 81: the whole set took 719 s
    beside the plug-in's tests on an AMD EPYC of family 25 (its three e2e runs 221-288 s
    each, the kernels 178 s), close to its 900 s budget; the checks of megatron-core's own
    path and of the kernels' timings then moved to the extended run."""
    checks, _ = dry_run(tmp_path, ["install", "data", "unit", "e2e", "gloo4", "sync"],
                        "static,edgc")
    assert {"install", "data", "unit", "e2e-tiny-cpu-static", "e2e-tiny-cpu-edgc",
            "gloo4-static-dp", "gloo4-edgc-pp", "sync"} <= checks.keys()
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                                "-m", "not cuda_only", "tests/test_cuda.py"], cwd=ROOT,
                               capture_output=True, text=True, env={**os.environ, "EDGC_TEST_DEVICE": "cpu"})
    count = sum(1 for line in collected.stdout.splitlines() if "::" in line)
    assert count >= 10 and f"{count} passed" in checks["unit"]["summary"]
    static, edgc = (checks[f"e2e-tiny-cpu-{m}"] for m in ("static", "edgc"))
    for c in (static, edgc):
        assert c["ok"] and c["loss_falls"]
        assert c["resume_max_abs_loss_diff"] == 0.0  # CPU: the resumed run is exact
    assert static["compressed_iterations"] == 20
    assert static["dp_bytes_last"] < static["dp_bytes_dense"] / 10
    # EDGC: dense through its warm-up (10 iterations), compressed after it
    assert edgc["compressed_iterations"] == 10


@pytest.mark.extended   # about 5 min on 2 cores
def test_dry_run_of_the_dense_e2e_and_the_kernels(tmp_path):
    """The rest of the dry run: megatron-core's own path end to end (mode off) and the
    kernels' timings at the paper's shapes."""
    checks, out = dry_run(tmp_path, ["e2e", "kernels"], "off")
    off = checks["e2e-tiny-cpu-off"]
    assert off["ok"] and off["loss_falls"] and off["resume_max_abs_loss_diff"] == 0.0
    assert off["compressed_iterations"] == 0 and off["dp_bytes_last"] == off["dp_bytes_dense"]
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


# ---------------------------------------------------------------- measured configs (issue 56)

MEDIUM = ["e2e-gpt2-medium-off", "e2e-gpt2-medium-static", "e2e-gpt2-medium-edgc",
          "e2e-gpt2-medium-off-bf16grads", "e2e-gpt2-medium-static-bf16grads",
          "e2e-gpt2-medium-edgc-bf16grads"]


def measured_checklist(gpu_check, tmp_path, monkeypatch, device, runs):
    """A Checklist of the GPT-2 medium e2e checks on ``device`` whose training runs are
    ``runs(name, flags) -> (records, log)``; returns it and the list of (name, flags) run."""
    monkeypatch.setattr(gpu_check.Checklist, "environment", lambda self: {"device": device})
    args = argparse.Namespace(device=device, bf16=device == "cpu", out=str(tmp_path / "out"),
                              target=None, e2e_iters=40, only=["e2e"], configs=["gpt2-medium"],
                              modes=list(gpu_check.MODES), variants=list(gpu_check.E2E_VARIANTS),
                              gpus=1, jobs=2, run_timeout=60.0)
    checks = gpu_check.Checklist(args)
    calls = []

    def train(name, flags, timeout, env=None):
        calls.append((name, flags))
        records, log = runs(name, flags)
        return {"rc": 0, "tail": "", "seconds": 1.0, "records": records, "log": log}

    monkeypatch.setattr(checks, "_train", train)
    return checks, calls


def fake_records(flags, ms, dense_from=None, stood_in_at=None):
    """Records of a run with ``flags``: the loss falls, EDGC dense through its warm-up, a
    bucket sent dense (as the fallback does) from ``dense_from`` on, 3 matrices stood in
    at iteration ``stood_in_at``."""
    iters = int(flags[len(flags) - 1 - flags[::-1].index("--train-iters") + 1])
    mode = flags[flags.index("--edgc-mode") + 1]
    start = {"off": iters + 1, "static": 1, "edgc": 11}[mode]
    return [{"iteration": i, "loss": 10 - 5 * i / iters, "grad_norm": 1.0, "iter_ms": ms,
             "rank_dp": [8] if i >= start else [None], "dp_compress_ms": 2.0,
             "dp_bypassed_buckets": int(dense_from is not None and i >= dense_from),
             "dp_factors_stood_in": 3 * (i == stood_in_at),
             "dp_bytes_sent_job": 1, "dp_bytes_dense_job": 10} for i in range(1, iters + 1)]


def flag(flags, name):
    """The value of the last ``name`` in ``flags`` (None if absent)."""
    return next((flags[i + 1] for i in range(len(flags) - 2, -1, -1) if flags[i] == name), None)


def test_the_fp16_checks_train_in_fp16_and_report_the_scalers_work(tmp_path, monkeypatch):
    """The fp16 e2e checks (issue 63) pass ``--fp16`` and not the CUDA runs' ``--bf16``, and
    report the skips and scale changes their run saw."""
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check.Checklist, "environment", lambda self: {"device": "cuda"})
    args = argparse.Namespace(device="cuda", bf16=False, out=str(tmp_path / "out"),
                              target=None, e2e_iters=40, only=["e2e"], configs=["gpt2-small-cpu"],
                              modes=["static"], variants=["e2e-gpt2-small-cpu-static-fp16"],
                              gpus=1, jobs=1, run_timeout=60.0)
    checks = gpu_check.Checklist(args)
    seen = []

    def train(name, flags, timeout, env=None):
        seen.append(flags)
        if "--save" in flags:   # the midpoint's checkpoint directory, as the run makes it
            os.makedirs(flags[flags.index("--save") + 1], exist_ok=True)
        records = fake_records(flags, 10.0)
        for r in records:   # two skips, the scale halved then doubled
            r["skipped"] = r["iteration"] in (5, 6)
            r["loss_scale"] = 65536.0 / (2 if 6 < r["iteration"] <= 20 else 1)
        return {"rc": 0, "tail": "", "seconds": 1.0, "records": records, "log": ""}

    monkeypatch.setattr(checks, "_train", train)
    entry = checks.check_e2e("e2e-gpt2-small-cpu-static-fp16",
                             *gpu_check.E2E_VARIANTS["e2e-gpt2-small-cpu-static-fp16"])
    assert all("--fp16" in f and "--bf16" not in f for f in seen) and len(seen) == 2
    assert (entry["fp16_skipped"], entry["fp16_scale_changes"]) == (2, 2), entry
    assert entry["summary"].startswith("fp16: 2 skipped, 2 scale changes (last 65536)")


def test_the_measured_config_runs_last_one_at_a_time_off_first(tmp_path):
    """GPT-2 medium's 6 e2e runs are planned after the pool, before kernels, the fp32
    buffers' off/static/edgc then the bf16 ones'; other configs leave them out."""
    gpu_check = load_gpu_check()
    assert "gpt2-medium" in gpu_check.CONFIGS and "gpt2-medium" in gpu_check.MEASURED

    def plan(configs, modes=("off", "static", "edgc")):
        args = argparse.Namespace(device="cuda", bf16=False, out=str(tmp_path), target=None,
                                  e2e_iters=40,
                                  only=None, configs=configs, modes=list(modes),
                                  variants=list(gpu_check.E2E_VARIANTS), gpus=1, jobs=8)
        checks = gpu_check.Checklist.__new__(gpu_check.Checklist)
        checks.args, checks.cuda = args, True
        first, pool, last = checks.plan()
        return [n for n, _ in pool], [n for n, _ in last]

    pool, last = plan(["tiny-cpu", "gpt2-medium"])
    assert last == MEDIUM + ["kernels"]
    assert not set(MEDIUM) & set(pool) and "e2e-tiny-cpu-off" in pool
    assert plan(["tiny-cpu"])[1] == ["kernels"]
    assert plan(["gpt2-medium"], ["static"])[1] == [
        "e2e-gpt2-medium-static", "e2e-gpt2-medium-static-bf16grads", "kernels"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_measured_checks_size_and_timing(tmp_path, monkeypatch, device):
    """On CPU the reduced size (named in the report), on CUDA the full one; no resume, no
    debug dump while timed; ms/iter (median after the warm-up) beside the off run of the
    same gradient dtype, in the JSON and the markdown."""
    gpu_check = load_gpu_check()
    ms = {"off": 100.0, "static": 110.0, "edgc": 125.0}

    def runs(name, flags):
        mode = flag(flags, "--edgc-mode")
        return fake_records(flags, ms[mode] * (0.9 if "bf16grads" in name else 1.0)), ""

    checks, calls = measured_checklist(gpu_check, tmp_path, monkeypatch, device, runs)
    _, _, last = checks.plan()
    assert [n for n, _ in last] == MEDIUM
    for name, fn in last:
        fn()
    report = checks.write()
    by_name = {c["check"]: c for c in report["checks"]}
    assert report["passed"] and list(by_name) == MEDIUM
    flags = dict(calls)
    static, edgc = flags["e2e-gpt2-medium-static"], flags["e2e-gpt2-medium-edgc"]
    assert not any("--save" in f or "--load" in f or "--edgc-debug-dump" in f
                   for f in flags.values())
    assert all("--edgc-compress-single-replica" in f and "--bf16" in f for f in flags.values())
    assert "--grad-reduce-in-bf16" in flags["e2e-gpt2-medium-edgc-bf16grads"]
    if device == "cpu":
        assert flag(static, "--train-iters") == "30" and flag(static, "--hidden-size") == "128"
        assert (flag(static, "--num-layers"), flag(static, "--seq-length")) == ("4", "128")
        assert flag(static, "--edgc-rank") == "8" and flag(edgc, "--edgc-rank-max") == "16"
        assert flag(static, "--distributed-backend") is None
        assert by_name["e2e-gpt2-medium-edgc"]["compressed_iterations"] == 20
    else:
        assert flag(static, "--train-iters") == "100" and flag(static, "--hidden-size") is None
        assert flag(static, "--edgc-rank") == "64"
        assert (flag(edgc, "--edgc-rank-max"), flag(edgc, "--edgc-rank-min")) == ("128", "32")
        assert flag(static, "--distributed-backend") == "nccl"
        assert by_name["e2e-gpt2-medium-edgc"]["compressed_iterations"] == 90
    static_rec = by_name["e2e-gpt2-medium-static"]
    assert static_rec["size"].startswith("REDUCED" if device == "cpu" else "full size")
    assert static_rec["ms_per_iter_median"] == 110.0 and static_rec["vs_off"] == 1.1
    assert by_name["e2e-gpt2-medium-edgc-bf16grads"]["off_ms_per_iter_median"] == 90.0
    assert "vs off 100.0 (+10.0%)" in static_rec["summary"]
    md = (tmp_path / "out" / "gpu_report.md").read_text()
    assert "## Measured configs: ms/iter, median from iteration 11" in md
    assert ("REDUCED for the CPU dry run" in md) == (device == "cpu")
    assert "| e2e-gpt2-medium-static | fp32 | 110.0 | 100.0 | +10.0% | 2.0 | 0 |" in md


def test_a_stand_in_basis_or_a_dense_fallback_fails_a_measured_check(tmp_path, monkeypatch):
    """One event line of a stand-in basis fails the check even where every iteration
    compressed; the fallback's dense bucket (the rank still in force) counts as not
    compressed and fails it alone; a failing run is rerun with --edgc-debug-dump under
    the check's output to a few iterations past its first failure."""
    gpu_check = load_gpu_check()
    line = ("iteration {}: failed factorization from finite gradients in chunk0.group0."
            "bucket0: a fixed basis stood in, the error feedback keeps what it missed")
    fallback = ("iteration 30: chunk0.group0.bucket0: compression's factors failed from finite "
                "gradients 2 times by iteration 30: sent dense (an all-reduce of the bucket, "
                "as megatron-core's) from iteration 31 on")
    cases = {"e2e-gpt2-medium-static": (None, line.format(23)),            # stood in alone
             "e2e-gpt2-medium-edgc": (26, ""),                              # dense alone
             "e2e-gpt2-medium-static-bf16grads":
                 (31, "\n".join([line.format(23), line.format(25), fallback])),
             "e2e-gpt2-medium-edgc-bf16grads": (None, "")}   # the JSONL's count alone

    def runs(name, flags):
        dense_from, log = cases.get(name.removesuffix("-capture"), (None, ""))
        stood_in_at = 40 if name.startswith("e2e-gpt2-medium-edgc-bf16grads") else None
        return fake_records(flags, 100.0, dense_from, stood_in_at), log

    checks, calls = measured_checklist(gpu_check, tmp_path, monkeypatch, "cuda", runs)
    for name, fn in checks.plan()[2]:
        fn()
    by_name = {c["check"]: c for c in checks.checks}
    assert [n for n, c in by_name.items() if not c["ok"]] == list(cases)
    stood = by_name["e2e-gpt2-medium-static"]
    assert (stood["stood_in"], stood["first_failure"], stood["compressed_iterations"]) == \
        (1, 23, 100)
    assert stood["summary"].startswith("FACTORIZATIONS FAILED from iteration 23;")
    dense = by_name["e2e-gpt2-medium-edgc"]
    assert (dense["stood_in"], dense["compressed_iterations"],
            dense["dense_bucket_iterations"]) == (0, 15, 75)   # 11-25 of at least 90
    assert "capture" not in dense        # nothing failed to capture
    jsonl = by_name["e2e-gpt2-medium-edgc-bf16grads"]
    assert (jsonl["stood_in"], jsonl["factors_stood_in"], jsonl["first_failure"]) == (0, 3, 40)
    both = by_name["e2e-gpt2-medium-static-bf16grads"]
    assert (both["stood_in"], both["compressed_iterations"]) == (2, 30)
    assert both["fallback_dense"] == [fallback] and "the fallback sent a bucket dense" in \
        both["summary"]
    captures = {n: f for n, f in calls if n.endswith("-capture")}
    assert set(captures) == {"e2e-gpt2-medium-static-capture",
                             "e2e-gpt2-medium-static-bf16grads-capture",
                             "e2e-gpt2-medium-edgc-bf16grads-capture"}
    flags = captures["e2e-gpt2-medium-static-capture"]
    assert flag(flags, "--edgc-debug-dump") == str(tmp_path / "out" / "dumps" /
                                                   "e2e-gpt2-medium-static")
    assert flag(flags, "--exit-interval") == "28" and flag(flags, "--train-iters") == "100"
    assert stood["capture"]["replay"] == [
        "no capture written: the failure did not recur in the rerun"]


def test_a_capture_is_replayed_and_only_the_failing_factors_are_kept(tmp_path, monkeypatch):
    """A failing medium check's capture rerun writes the whole step (gigabytes at this
    width) and the factors that stood in: the replay's verdict and its factor lines go into
    the report, the whole step is removed, the ``*.factors.pt`` kept to travel back."""
    gpu_check = load_gpu_check()
    checks, _ = measured_checklist(gpu_check, tmp_path, monkeypatch, "cuda",
                                   lambda name, flags: ([], ""))
    dump = tmp_path / "out" / "dumps" / "e2e-gpt2-medium-static"

    def train(name, flags, timeout, env=None):
        dump.mkdir(parents=True)
        (dump / "iter23-rank0-chunk0.group0.bucket0.pt").write_bytes(b"x" * 1024)
        (dump / "iter23-rank0-chunk0.group0.bucket0.factors.pt").write_bytes(b"y")
        return {"rc": 0, "tail": "", "seconds": 1.0, "records": [], "log": ""}

    replayed = ["  ok          g: P summed (captured)",
                "every phase finite on cuda: the failure did not reproduce here",
                "  (3072, 1024) batched: 1 of 24 stood in (smallest eigenvalue of the "
                "unit-column Gram, fp64: -1.0e-07)"]
    monkeypatch.setattr(checks, "_train", train)
    monkeypatch.setattr(gpu_check, "run", lambda *a, **k: (0, "\n".join(replayed), 2.0))
    d = {"summary": "FACTORIZATIONS FAILED"}
    assert checks.capture("e2e-gpt2-medium-static", [], 23, 100, d) == 3.0
    assert d["capture"]["replay"] == [line.strip() for line in replayed[1:]]
    assert sorted(p.name for p in dump.iterdir()) == \
        ["iter23-rank0-chunk0.group0.bucket0.factors.pt"]


def test_the_event_texts_the_checks_count_are_the_dp_sync_s(tmp_path):
    """STOOD_IN and NONFINITE_FACTORS are the lines megatron_edgc/patches/dp_stats.py
    writes for a bucket's flags (factors failed from finite gradients; non-finite)."""
    import torch

    from megatron_edgc.patches.dp_stats import DPSyncStats

    gpu_check = load_gpu_check()
    stats = DPSyncStats()
    stats.add_nonfinite_flag("b0", torch.tensor([False, True]))
    stats.add_nonfinite_flag("b1", torch.tensor([True, True]))
    stats.resolve()
    log = "\n".join(f"iteration {i}: {e}" for i, e in enumerate(stats.events, start=7))
    assert gpu_check.factor_events(log) == {"stood_in": 1, "nonfinite_factors": 1,
                                            "fallback_dense": [], "first_failure": 7,
                                            "residual": None}
    # the residual --edgc-ef-dtype auto chose, from the runtime's start-up line
    start = ("EDGC: error-feedback state 7.5 MiB per rank at rank 32 (bf16 gradients, bf16 "
             "(auto: bf16's round trip 1.20 ms against fp32's 1.00) residual, bf16 factors)")
    assert gpu_check.factor_events(start + "\n" + log)["residual"] == \
        "bf16 (auto: bf16's round trip 1.20 ms against fp32's 1.00)"


def test_a_failed_factorization_in_training_shows_where_the_checks_look(small_model_argv,
                                                                         tmp_path):
    """A real run (one rank, --edgc-compress-single-replica, static r4) whose Cholesky
    factorizations fail at iterations 3 and 4 (1-based), as cuSOLVER's did on the H100:
    two stand-in lines in its output, the fallback from iteration 5 on, whose iterations
    count a bucket sent dense in the JSONL (``dp_bypassed_buckets``), so the checklist
    counts 4 of 8 compressed; --edgc-debug-dump captured the first stand-in step
    (iteration 3)."""
    from distributed import read_jsonl, run_job

    gpu_check = load_gpu_check()
    metrics, dump = tmp_path / "m.jsonl", tmp_path / "dump"
    run_job(["--fail-factorizations-at", "2,3", *small_model_argv,
             "--pipeline-model-parallel-size", "1", "--data-parallel-size", "1",
             "--edgc-compress-single-replica", "--train-iters", "8", "--eval-interval", "8",
             "--edgc-mode", "static", "--edgc-rank", "4", "--log-interval", "2",
             "--metrics-file", str(metrics), "--edgc-debug-dump", str(dump)],
            str(tmp_path / "out"))
    records = read_jsonl(metrics)
    events = gpu_check.factor_events((tmp_path / "out" / "stdout.txt").read_text())
    assert events["stood_in"] >= 2 and events["first_failure"] == 3
    assert events["nonfinite_factors"] == 0 and len(events["fallback_dense"]) >= 1
    assert [r["dp_bypassed_buckets"] > 0 for r in records] == [False] * 4 + [True] * 4
    checks = gpu_check.Checklist.__new__(gpu_check.Checklist)
    checks.cuda = False
    d = checks.assess({"rc": 0, "records": records, "tail": ""}, None, 8, True,
                      drop=-100.0, min_compressed=8)
    assert (d["compressed_iterations"], d["ok"]) == (4, False)
    files = sorted(p.name for p in dump.glob("*.pt"))
    assert files and all(f.startswith("iter3-rank0-") for f in files)
