#!/usr/bin/env python
"""The GPU validation checklist in one command: install the carried wheels, run every
check, write ``gpu_report.json`` and ``gpu_report.md``.

    python scripts/gpu_check.py [--out DIR] [--wheels .whl] [--target /tmp/edgc-site]
    python scripts/gpu_check.py --device cpu --out /tmp/gpu-dry-run     # the CPU dry run

On a bare GPU machine (Python 3.12 and torch there, no internet) run ``make gpu-wheels``
beforehand where the registry is reachable and carry ``.whl/``. The checks, each in its
own process with a time limit, each failing on its own (the report says which and why):

1. ``install``: the wheels into ``--target`` (skipped when megatron-core imports already);
2. ``unit``: ``tests/test_cuda.py`` on the device (``EDGC_TEST_DEVICE``);
3. ``e2e``: one rank, NCCL (gloo on CPU), bf16 on CUDA, ``--edgc-mode off / static / edgc``
   on ``tiny-cpu`` and ``gpt2-small-cpu``: the loss falls, DP bytes against the rank's
   formula, a checkpoint at the midpoint resumed to the end against the uninterrupted run;
4. ``gloo4``: the 4-process TP1·PP2·DP2 layouts with gloo on CUDA tensors (static DP
   compression, EDGC with pipeline compression); on CPU the project's usual path;
5. ``kernels``: ``bench/gpu_kernels.py`` (compress/decompress kernels of the paper
   configs' TP-sharded shapes, ranks 16/32/64, fp32 and bf16 factors, entropy sampler
   cost, error-feedback memory); on CPU shapes scaled by 1/16 at rank 16;
6. ``sync``: one compressed training step (overlapped DP reduce) under
   ``torch.cuda.set_sync_debug_mode("warn")``, each reported sync with the project frame
   it came from (on CPU there are none to report: the check says so).

Budget on one H100: under 10 minutes (the report has each check's seconds).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_edgc.training.checkpoint_files import LATEST  # noqa: E402  (no torch import)
CONFIGS = ("tiny-cpu", "gpt2-small-cpu")
MODES = ("off", "static", "edgc")
# Short runs: EDGC's windows scaled so that warm-up ends at iteration 10 and the
# controller decides twice more; the static/edgc DP compression is forced (no bypass).
E2E_ITERS = 40
E2E_FLAGS = ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "1",
             "--train-iters", str(E2E_ITERS), "--eval-interval", str(E2E_ITERS),
             "--eval-iters", "2", "--log-interval", "10", "--lr-warmup-iters", "5",
             "--edgc-bypass", "off", "--edgc-window", "5", "--edgc-warmup-max-iters", "10",
             # one device: DP 1 is compressed only when asked (nothing is sent)
             "--edgc-compress-single-replica"]
MODE_FLAGS = {"off": ["--edgc-mode", "off"], "static": ["--edgc-mode", "static"],
              "edgc": ["--edgc-mode", "edgc"]}
GLOO4 = {"static-dp": ["--edgc-mode", "static"],
         "edgc-pp": ["--edgc-mode", "edgc", "--edgc-pp-compression", "edgc",
                     "--edgc-window", "5", "--edgc-warmup-max-iters", "10"]}


def run(cmd: list, env: dict, timeout: float, log_path: str) -> tuple[int, str, float]:
    """Run ``cmd``; its output goes to ``log_path``; returns (rc, output tail, seconds)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    with open(log_path, errors="replace") as fh:
        tail = fh.read()[-3000:]
    return rc, tail, time.perf_counter() - t0


def read_jsonl(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


class Checklist:
    def __init__(self, args):
        self.args = args
        self.cuda = args.device == "cuda"
        self.bf16 = self.cuda or args.bf16  # the CUDA runs' precision; --bf16 tries it on CPU
        self.out = os.path.abspath(args.out)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="edgc-gpu-check-")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        paths = [ROOT] + ([args.target] if args.target else [])
        self.env["PYTHONPATH"] = os.pathsep.join(
            paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if not self.cuda:
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.checks: list = []
        self.env_info = self.environment()

    def record(self, name: str, ok, seconds: float, **details) -> dict:
        entry = {"check": name, "ok": ok, "seconds": round(seconds, 1), **details}
        self.checks.append(entry)
        self.write()  # after every check: a run cut off at its time limit still reports
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        print(f"[{status}] {name} ({seconds:.0f} s) "
              f"{details.get('summary', '')}", flush=True)
        return entry

    def python(self, *args) -> list:
        return [sys.executable, *args]

    # ------------------------------------------------------------------ checks

    def check_install(self):
        t0 = time.perf_counter()
        probe = subprocess.run(self.python("-c", "import megatron.core, sys; "
                                           "print(megatron.core.__version__)"),
                               env=self.env, capture_output=True, text=True)
        if probe.returncode == 0:
            return self.record("install", None, time.perf_counter() - t0,
                               summary=f"megatron-core {probe.stdout.strip()} already imports",
                               megatron_core=probe.stdout.strip())
        wheels = sorted(glob.glob(os.path.join(self.args.wheels, "*.whl")))
        if not wheels or not self.args.target:
            return self.record("install", False, time.perf_counter() - t0,
                               summary=f"megatron-core does not import and no wheels in "
                                       f"{self.args.wheels} (run `make gpu-wheels`)")
        rc, tail, _ = run(self.python("-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                      "--no-compile", "--no-cache-dir", "--upgrade",
                                      "--target", self.args.target, *wheels),
                          self.env, 300, os.path.join(self.logs, "install.log"))
        probe = subprocess.run(self.python("-c", "import megatron.core; "
                                           "print(megatron.core.__version__)"),
                               env=self.env, capture_output=True, text=True)
        ok = rc == 0 and probe.returncode == 0
        self.env_info = self.environment()
        return self.record("install", ok, time.perf_counter() - t0,
                           summary=f"{len(wheels)} wheels into {self.args.target}",
                           wheels=[os.path.basename(w) for w in wheels],
                           megatron_core=probe.stdout.strip(), tail=None if ok else tail)

    def check_data(self):
        t0 = time.perf_counter()
        need = {"data/shakespeare-bpe8k": ["--tokenizer-type", "CorpusBPETokenizer",
                                           "--vocab-size", "8192"],
                "data/shakespeare-gpt2": []}
        made = []
        for prefix, flags in need.items():
            if os.path.exists(os.path.join(ROOT, prefix + "_text_document.bin")):
                continue
            rc, tail, _ = run(self.python("scripts/prepare_data.py", "--output-prefix", prefix,
                                          *flags), self.env, 300,
                              os.path.join(self.logs, f"data-{os.path.basename(prefix)}.log"))
            if rc:
                return self.record("data", False, time.perf_counter() - t0, tail=tail,
                                   summary=f"scripts/prepare_data.py {prefix} failed")
            made.append(prefix)
        return self.record("data", True, time.perf_counter() - t0,
                           summary=f"prepared {made}" if made else "present")

    def check_unit(self):
        rc, tail, secs = run(self.python("-m", "pytest", "-q", "-p", "no:cacheprovider",
                                         "tests/test_cuda.py"),
                             dict(self.env, EDGC_TEST_DEVICE=self.args.device), 600,
                             os.path.join(self.logs, "unit.log"))
        line = ([ln for ln in tail.splitlines() if re.search(r"passed|failed|error", ln)]
                or [""])[-1]
        return self.record("unit", rc == 0, secs, summary=line.strip(),
                           tail=None if rc == 0 else tail)

    def _train(self, name: str, flags: list, timeout: float) -> dict:
        metrics = os.path.join(self.work, name + ".jsonl")
        rc, tail, secs = run(self.python("pretrain_gpt2_edgc.py", *flags,
                                         "--metrics-file", metrics),
                             self.env, timeout, os.path.join(self.logs, name + ".log"))
        return {"rc": rc, "tail": tail, "seconds": secs, "records": read_jsonl(metrics)}

    def check_e2e(self, config: str, mode: str):
        name = f"e2e-{config}-{mode}"
        ck = os.path.join(self.work, name + "-ckpt")
        base = ["--config", f"configs/{config}.yaml", *E2E_FLAGS, *MODE_FLAGS[mode],
                *(["--bf16"] if self.bf16 else []),
                *(["--distributed-backend", "nccl"] if self.cuda else [])]
        half = E2E_ITERS // 2
        full = self._train(name, base + ["--save", ck, "--save-interval", str(half)],
                           self.args.run_timeout)
        if full["rc"] == 0:  # resume the midpoint's checkpoint, as a user would: point the
            with open(os.path.join(ck, LATEST), "w") as fh:  # tracker file at it
                fh.write(str(half))
            resumed = self._train(name + "-resume", base + ["--load", ck],
                                  self.args.run_timeout)
        else:
            resumed = {"rc": None, "records": [], "seconds": 0.0, "tail": ""}
        secs = full["seconds"] + resumed["seconds"]
        recs = full["records"]
        if full["rc"] != 0 or len(recs) < E2E_ITERS:
            return self.record(name, False, secs, summary=f"training failed (rc {full['rc']})",
                               tail=full["tail"])
        first, last = recs[0]["loss"], sum(r["loss"] for r in recs[-5:]) / 5
        by_iter = {r["iteration"]: r["loss"] for r in recs}
        resumed_losses = {r["iteration"]: r["loss"] for r in resumed["records"]}
        diffs = [abs(resumed_losses[i] - by_iter[i]) for i in resumed_losses if i in by_iter]
        max_diff = max(diffs) if diffs else None
        # bf16 on CUDA: not bit-exact (atomics in backward), but a resumed run must track
        # the uninterrupted one far inside the loss's own step-to-step change.
        resume_ok = resumed["rc"] == 0 and len(diffs) == E2E_ITERS // 2 and \
            max_diff <= (0.02 if self.cuda else 0.0)
        compressed = [r for r in recs if r.get("dp_bytes_sent_job", 0) <
                      r.get("dp_bytes_dense_job", 0)]
        ms = [r["iter_ms"] for r in recs[5:]]
        details = {
            "first_loss": first, "last5_loss": last, "loss_falls": last < first - 0.5,
            "resume_max_abs_loss_diff": max_diff, "resume_ok": resume_ok,
            "compressed_iterations": len(compressed),
            "dp_bytes_last": recs[-1].get("dp_bytes_sent_job"),
            "dp_bytes_dense": recs[-1].get("dp_bytes_dense_job"),
            "rank_last": recs[-1].get("rank_dp", recs[-1].get("rank")),
            "ms_per_iter": sum(ms) / len(ms) if ms else None,
            "grad_sync_ms": recs[-1].get("grad_sync_ms"),
            "timing_source": "CUDA events" if self.cuda else "host clock"}
        expect_compressed = mode != "off"
        ok = details["loss_falls"] and resume_ok and \
            (bool(compressed) == expect_compressed)
        summary = (f"loss {first:.3f} -> {last:.3f}, resume max |Δloss| "
                   f"{max_diff if max_diff is None else format(max_diff, '.2e')}, "
                   f"{len(compressed)}/{len(recs)} compressed iterations, "
                   f"DP bytes {details['dp_bytes_last']} of {details['dp_bytes_dense']}")
        return self.record(name, ok, secs, summary=summary, **details,
                           tail=None if ok else (resumed.get("tail") or full["tail"]))

    def check_gloo4(self, name: str, flags: list):
        cfg = ["--config", "configs/tiny-cpu.yaml", "--train-iters", "20", "--eval-interval",
               "20", "--eval-iters", "2", "--log-interval", "10", "--lr-warmup-iters", "5",
               "--distributed-backend", "gloo", *flags]
        if self.bf16:
            cfg += ["--bf16"]
        res = self._train(f"gloo4-{name}", cfg, self.args.run_timeout)
        recs = res["records"]
        ok = res["rc"] == 0 and len(recs) == 20 and recs[-1]["loss"] < recs[0]["loss"]
        summary = (f"loss {recs[0]['loss']:.3f} -> {recs[-1]['loss']:.3f}, DP bytes "
                   f"{recs[-1].get('dp_bytes_sent_job')} of {recs[-1].get('dp_bytes_dense_job')}"
                   if ok else f"rc {res['rc']}: " + (res["tail"].strip().splitlines() or [""])[-1])
        return self.record(f"gloo4-{name}", ok, res["seconds"], summary=summary,
                           tail=None if ok else res["tail"])

    def check_kernels(self):
        out = os.path.join(self.out, "kernels.json")
        flags = [] if self.cuda else ["--scale", "16", "--ranks", "16", "--repeats", "2",
                                      "--warmup", "1"]
        rc, tail, secs = run(self.python("bench/gpu_kernels.py", "--device", self.args.device,
                                         "--out", out, *flags),
                             self.env, 600, os.path.join(self.logs, "kernels.log"))
        lines = [ln for ln in tail.splitlines() if " r" in ln and "ms" in ln]
        return self.record("kernels", rc == 0, secs, summary=f"{len(lines)} rows -> kernels.json",
                           rows=lines, tail=None if rc == 0 else tail)

    def check_sync(self):
        out = os.path.join(self.work, "sync.json")
        rc, tail, secs = run(self.python(os.path.abspath(__file__), "--sync-probe", out,
                                         "--device", self.args.device),
                             self.env, self.args.run_timeout, os.path.join(self.logs, "sync.log"))
        if rc != 0 or not os.path.exists(out):
            return self.record("sync", False, secs, summary=f"probe failed (rc {rc})", tail=tail)
        with open(out) as fh:
            probe = json.load(fh)
        summary = probe.pop("summary")
        return self.record("sync", True, secs, summary=summary, **probe)

    # ------------------------------------------------------------------ report

    def environment(self) -> dict:
        code = ("import json, sys, torch\n"
                "d = {'python': sys.version.split()[0], 'torch': torch.__version__,"
                " 'cuda': torch.version.cuda, 'device': torch.cuda.get_device_name()"
                " if torch.cuda.is_available() else 'cpu'}\n"
                "try:\n import megatron.core as m; d['megatron_core'] = m.__version__\n"
                "except Exception as e: d['megatron_core'] = repr(e)\n"
                "try: d['nccl'] = '.'.join(map(str, torch.cuda.nccl.version()))\n"
                "except Exception: pass\n"
                "print(json.dumps(d))")
        res = subprocess.run(self.python("-c", code), env=self.env, capture_output=True,
                             text=True)
        try:
            env = json.loads(res.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            env = {"error": res.stderr[-500:]}
        env.update(machine=platform.node(), date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                 time.gmtime()))
        return env

    def write(self) -> dict:
        env = self.env_info
        report = {"device_arg": self.args.device, "environment": env, "checks": self.checks,
                  "passed": all(c["ok"] is not False for c in self.checks)}
        with open(os.path.join(self.out, "gpu_report.json"), "w") as fh:
            json.dump(report, fh, indent=1)
        lines = [f"# GPU check on {env.get('device')} ({env.get('date')})", "",
                 f"python {env.get('python')}, torch {env.get('torch')}, CUDA {env.get('cuda')},"
                 f" NCCL {env.get('nccl')}, megatron-core {env.get('megatron_core')}", "",
                 "| check | result | s | summary |", "|---|---|---|---|"]
        for c in self.checks:
            res = {True: "pass", False: "**FAIL**", None: "skip"}[c["ok"]]
            lines.append(f"| {c['check']} | {res} | {c['seconds']:.0f} | "
                         f"{str(c.get('summary', '')).replace('|', '/')} |")
        with open(os.path.join(self.out, "gpu_report.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
        return report


def sync_probe(path: str, device: str) -> int:
    """One rank, one compressed step under the CUDA sync debug mode; writes ``path``."""
    import warnings

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from megatron_edgc.training.launch import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    import torch

    from megatron_edgc.config import parse_config
    from megatron_edgc.training.loop import Trainer, init_worker, shutdown_worker

    cfg = parse_config(["--config", "configs/tiny-cpu.yaml", "--pipeline-model-parallel-size",
                        "1", "--data-parallel-size", "1", "--edgc-mode", "static",
                        "--edgc-bypass", "off", "--edgc-compress-single-replica",
                        "--overlap-grad-reduce", "--bucket-size",
                        "500000", "--train-iters", "10", "--lr-warmup-iters", "2"], world_size=1)
    init_worker(cfg, 0, 1, 0)
    syncs = []
    try:
        trainer = Trainer(cfg)
        for _ in range(3):
            trainer.train_step()
            trainer.iteration += 1
        if device == "cuda":
            torch.cuda.synchronize()

        def where() -> list:
            frames = [f for f in traceback.extract_stack()[:-2]
                      if ROOT in f.filename and "gpu_check" not in f.filename]
            return [f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}"
                    for f in frames[-3:]]

        original = warnings.showwarning

        def capture(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                syncs.append({"message": str(message).splitlines()[0][:120],
                              "stack": where()})
            else:
                original(message, category, filename, lineno, file, line)

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = capture
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step()
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = original
    finally:
        shutdown_worker()
    by_site: dict = {}
    for s in syncs:
        key = s["stack"][-1] if s["stack"] else "(outside the project)"
        by_site.setdefault(key, {"count": 0, "stack": s["stack"], "message": s["message"]})
        by_site[key]["count"] += 1
    summary = (f"{len(syncs)} syncs in one compressed step at {len(by_site)} sites"
               if device == "cuda" else "CPU: no device syncs to report (dry run)")
    with open(path, "w") as fh:
        json.dump({"summary": summary, "syncs": len(syncs), "sites": by_site}, fh, indent=1)
    return 0


def failure_cause(check: dict) -> str:
    """The last error line of a failed check's output tail."""
    lines = [ln.strip() for ln in (check.get("tail") or "").splitlines()
             if re.search(r"(Error|error)\b.*:", ln)]
    return lines[-1].removeprefix("[rank0]: ")[:160] if lines else str(check.get("summary"))


def write_benchmarks(reports: list) -> None:
    """The BENCHMARKS.md section "GPU validation" from the ``gpu_report.json`` of each run
    on a lent device (committed under ``bench/results/gpu/``), oldest first."""
    sys.path.insert(0, ROOT)
    from bench.report import write_section

    parts, stamps = [], []
    for path in reports:
        with open(path) as fh:
            rep = json.load(fh)
        env = rep["environment"]
        stamps.append(f"{env.get('device')} {env.get('date')}")
        rows = ["| check | result | s | summary or cause |", "|---|---|---|---|"]
        for c in rep["checks"]:
            res = {True: "pass", False: "**FAIL**", None: "skip"}[c["ok"]]
            text = c.get("summary", "") if c["ok"] is not False else failure_cause(c)
            rows.append(f"| {c['check']} | {res} | {c['seconds']:.0f} | "
                        f"{str(text).replace('|', '/')} |")
        parts.append(f"**{os.path.relpath(path, ROOT)}**: {env.get('device')}, "
                     f"{env.get('date')}; Python {env.get('python')}, torch {env.get('torch')}, "
                     f"CUDA {env.get('cuda')}, NCCL {env.get('nccl')}, megatron-core "
                     f"{env.get('megatron_core')}\n\n" + "\n".join(rows))
    write_section("gpu_check", "GPU validation: the checklist on a lent device",
                  "python scripts/gpu_check.py --out DIR  (then --report DIR/gpu_report.json "
                  "here)", "\n\n".join(parts) + "\n\n<!-- notes -->\n",
                  stamp="runs of " + "; ".join(stamps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default="gpu_report")
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".whl"))
    ap.add_argument("--target", default=None,
                    help="install the wheels here (default: a folder under the system temp)")
    ap.add_argument("--only", nargs="+", default=None,
                    help="run only these checks (install, data, unit, e2e, gloo4, kernels, sync)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--bf16", action="store_true",
                    help="train in bf16 on CPU too (on CUDA it always does)")
    ap.add_argument("--run-timeout", type=float, default=300.0)
    ap.add_argument("--report", nargs="+", metavar="JSON", default=None,
                    help="only write BENCHMARKS.md's GPU section from these gpu_report.json")
    ap.add_argument("--sync-probe", metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.report:
        write_benchmarks(args.report)
        return 0
    if args.sync_probe:
        return sync_probe(args.sync_probe, args.device)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("error: --device cuda: no CUDA device here (use --device cpu for a dry run)",
                  file=sys.stderr)
            return 2
    if args.target is None:
        args.target = os.path.join(tempfile.gettempdir(), "edgc-site")
    checks = Checklist(args)
    wanted = set(args.only or ["install", "data", "unit", "e2e", "gloo4", "kernels", "sync"])
    t0 = time.perf_counter()
    if "install" in wanted:
        checks.check_install()
    if "data" in wanted:
        checks.check_data()
    if "unit" in wanted:
        checks.check_unit()
    if "e2e" in wanted:
        for config in args.configs:
            for mode in MODES:
                checks.check_e2e(config, mode)
    if "gloo4" in wanted:
        for name, flags in GLOO4.items():
            checks.check_gloo4(name, flags)
    if "kernels" in wanted:
        checks.check_kernels()
    if "sync" in wanted:
        checks.check_sync()
    report = checks.write()
    shutil.rmtree(checks.work, ignore_errors=True)
    print(f"{'all checks passed' if report['passed'] else 'SOME CHECKS FAILED'} in "
          f"{time.perf_counter() - t0:.0f} s: {os.path.join(checks.out, 'gpu_report.md')}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
