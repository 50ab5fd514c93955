#!/usr/bin/env python
"""Does a run reproduce itself? Issue 91's job run N times, compared bit for bit (issue 91
item 7).

    .venv/bin/python bench/repro.py [--runs 20] [--jobs 1] [--dac on|off] [--iters 60]

The job: ``configs/tiny-cpu.yaml`` (TP1·PP2·DP2, gloo), ``--no-bf16 --edgc-mode edgc
--edgc-pp-compression edgc --edgc-window 5 --edgc-warmup-max-iters 10``, 60 iterations, a
checkpoint every 10. Run ``i`` sets ``PYTHONHASHSEED=i`` (the one input Python varies per
interpreter: the iteration order of sets and of dicts built from them); the rest varies as
it does between two runs anyway (the machine's load, thread scheduling, addresses). Each
run's losses, grad norms, validation losses, the ranks in force (``rank_dp``, ``rank_pp``)
and its final parameters and optimizer state (from the last checkpoint) are compared with
the first run's, bit for bit.

The one source a run may not reproduce is named: DAC (EDGC §6) sets each later pipeline
stage's DP rank from the wall-clock times it measures, so two runs may install different
tables (a stage at rank 31 in one, 32 in the other). Every comparison is bounded by it: a
run whose tables equal the first run's must agree with it in every figure and parameter,
bit for bit; a run whose tables differ must agree up to the first iteration a table
differs at (its loss included: the rank acts on that iteration's sync). Anything else is
*unexplained* and the exit code is 1. ``--dac off`` runs the same job with DAC off: every
run must then be alike.

Writes the runs under ``runs/bench/repro/``, a JSON per CPU and DAC setting under
``bench/results/repro/`` and the ``repro`` section of BENCHMARKS.md (a row per JSON).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.report import machine, write_section  # noqa: E402

CONFIG = "configs/tiny-cpu.yaml"
RUNS = os.path.join(ROOT, "runs", "bench", "repro")
RESULTS = os.path.join(ROOT, "bench", "results", "repro")


def job_flags(iters: int, dac: str) -> list:
    """The job of issue 91 (module docstring), ``iters`` iterations."""
    return ["--config", CONFIG, "--no-bf16", "--edgc-mode", "edgc",
            "--edgc-pp-compression", "edgc", "--edgc-window", "5",
            "--edgc-warmup-max-iters", "10", "--edgc-dac", dac, "--train-iters", str(iters),
            "--save-interval", "10"] + \
        (["--lr-warmup-iters", str(iters // 4)] if iters <= 20 else [])  # a shorter check


# ------------------------------------------------------------------ one run


def _tensors(obj, prefix: str = ""):
    """``(name, tensor)`` of every tensor in nested dicts and lists, in a fixed order."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}/{i}")


def final_state(ckpt: str) -> tuple:
    """``(model parameters {name: tensor}, sha256 of the optimizer state)`` of the last
    checkpoint under ``ckpt`` (every pipeline stage's file)."""
    import torch

    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as fh:
        it = int(fh.read().strip())
    params, opt = {}, hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(ckpt, f"iter_{it:07d}", "model_optim_*.pt"))):
        state = torch.load(path, map_location="cpu", weights_only=False)
        stem = os.path.basename(path)[:-3]
        for name, t in _tensors(state["model"], stem):
            params[name] = t.detach().clone()
        for name, t in _tensors(state["optimizer"], stem):
            opt.update(name.encode())
            opt.update(_bits(t.cpu()))
    return params, opt.hexdigest()


def run_one(i: int, out: str, flags: list, reuse: bool) -> dict:
    """Run ``i`` (``PYTHONHASHSEED=i``): its metrics, and its final parameters kept as
    ``i.params.pt`` (the checkpoints removed)."""
    import torch

    metrics = os.path.join(out, f"{i}.jsonl")
    saved = os.path.join(out, f"{i}.params.pt")
    iters = int(flags[flags.index("--train-iters") + 1])
    if not (reuse and os.path.exists(saved) and os.path.exists(metrics)
            and sum(1 for _ in open(metrics)) >= iters):
        ckpt = os.path.join(out, f"ck{i}")
        for stale in (metrics, ckpt):
            if os.path.isdir(stale):
                shutil.rmtree(stale)
            elif os.path.exists(stale):
                os.remove(stale)
        env = dict(os.environ, PYTHONHASHSEED=str(i))
        t0 = time.time()
        with open(os.path.join(out, f"{i}.log"), "w") as log:
            code = subprocess.run([sys.executable, "pretrain_gpt2_edgc.py", *flags,
                                   "--save", ckpt, "--metrics-file", metrics],
                                  cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT).returncode
        if code:
            raise RuntimeError(f"run {i} failed (exit {code}): see {out}/{i}.log")
        params, opt = final_state(ckpt)
        torch.save({"params": params, "optimizer_sha256": opt}, saved)
        shutil.rmtree(ckpt)
        print(f"run {i}: {time.time() - t0:.0f} s", flush=True)
    state = torch.load(saved, weights_only=False)
    with open(metrics) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return {"run": i, "records": records, "params": state["params"],
            "optimizer_sha256": state["optimizer_sha256"]}


# ------------------------------------------------------------------ the comparison

#: an iteration's figures in the order they are made: before its sync (the loss, and the
#: ranks the controllers decided from earlier figures: the CQM's per stage, the pipeline's),
#: the DP ranks in force for its sync (DAC's table: the CQM's, later stages raised by the
#: measured times), then what the sync gave (the grad norm, the entropies its gradients
#: measured, a validation loss)
_BEFORE, _TABLE, _AFTER = 0, 1, 2
_FIGURES = ((_BEFORE, "loss"), (_BEFORE, "rank_cqm"), (_BEFORE, "rank_pp"),
            (_TABLE, "rank_dp"), (_AFTER, "grad_norm"), (_AFTER, "entropy"),
            (_AFTER, "entropy_pp"), (_AFTER, "val_loss"))


def events(records: list) -> dict:
    """``{(iteration, slot, what): value}`` of a run's metrics (``slot``: where in the
    iteration it is made)."""
    return {(r["iteration"], slot, what): r[what] for r in records
            for slot, what in _FIGURES if what in r}


def _same(a, b) -> bool:
    """Bit for bit, NaN equal to NaN (JSON floats: their repr is exact)."""
    return json.dumps(a) == json.dumps(b)


def compare(ref: dict, run: dict) -> dict:
    """``run`` against ``ref`` (each :func:`run_one`'s), bounded by DAC's tables:
    ``verdict`` ``alike`` (every figure, parameter and optimizer state bit for bit),
    ``dac`` (the DP ranks in force differ, and nothing did before, the CQM's ranks
    included: DAC raised a stage differently) or ``unexplained``; where each first
    differs and by how much."""
    a, b = events(ref["records"]), events(run["records"])
    keys = sorted(set(a) | set(b))
    table = next((k for k in keys if k[1] == _TABLE and not _same(a.get(k), b.get(k))), None)
    number = next((k for k in keys if k[1] != _TABLE and not _same(a.get(k), b.get(k))), None)
    params_alike, max_param = params_diff(ref["params"], run["params"])
    optimizer_alike = ref["optimizer_sha256"] == run["optimizer_sha256"]
    alike = table is None and number is None and params_alike and optimizer_alike
    if alike:
        verdict = "alike"
    elif table is not None and (number is None or number > table):
        verdict = "dac"
    else:
        verdict = "unexplained"

    def last(records, key):
        values = [r[key] for r in records if r.get(key) is not None]
        return values[-1] if values else None

    row = {"run": run["run"], "verdict": verdict, "params_alike": params_alike,
           "optimizer_alike": optimizer_alike, "max_param_diff": max_param,
           "table_differs_at": table[0] if table else None,
           "numbers_differ_at": list(number[::2]) if number else None}
    if table is not None:
        row["tables"] = [a.get(table), b.get(table)]
    for key in ("loss", "val_loss"):
        x, y = last(ref["records"], key), last(run["records"], key)
        row[f"final_{key}"] = y
        row[f"final_{key}_diff"] = None if x is None or y is None else abs(x - y)
    return row


def _bits(t) -> bytes:
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def params_diff(a: dict, b: dict) -> tuple:
    """``(bit for bit equal, largest absolute difference)`` of two parameter dicts."""
    if set(a) != set(b) or any(a[n].shape != b[n].shape for n in a):
        return False, float("inf")
    alike = all(_bits(a[n]) == _bits(b[n]) for n in a)
    diff = max(((a[n].double() - b[n].double()).abs().max().item() for n in a
                if a[n].numel()), default=0.0)
    return alike, diff


def tables_of(run: dict) -> str:
    """A digest of the DP ranks in force at every iteration (DAC's tables)."""
    return hashlib.sha256(json.dumps([r.get("rank_dp") for r in run["records"]])
                          .encode()).hexdigest()[:12]


def analyse(runs: list) -> dict:
    """Every run against the first; runs grouped by their tables, and every run checked
    against the first run of its group (equal tables: alike, bit for bit)."""
    rows = [compare(runs[0], run) for run in runs[1:]]
    groups: dict = {}
    for run in runs:
        groups.setdefault(tables_of(run), []).append(run)
    within = [compare(group[0], run) for group in groups.values() for run in group[1:]]
    unexplained = [r["run"] for r in rows + within if r["verdict"] == "unexplained"]
    return {"runs": len(runs), "alike": 1 + sum(r["verdict"] == "alike" for r in rows),
            "dac": sum(r["verdict"] == "dac" for r in rows),
            "unexplained": sorted(set(unexplained)),
            "tables": {k: [run["run"] for run in g] for k, g in groups.items()},
            "groups_alike": all(r["verdict"] == "alike" for r in within),
            "rows": rows}


# ------------------------------------------------------------------ report


def cpu_model() -> str:
    """The CPU's model name with its family and model (a virtual machine may name only the
    vendor: ``AMD EPYC (family 25, model 17)`` is a Zen 4)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name", "?")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def commit() -> str:
    """The commit, ``+modified`` where the tracked tree differs from it (the benchmarks'
    own outputs, BENCHMARKS.md and bench/results/, aside)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":!BENCHMARKS.md", ":!bench/results"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+modified" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def row_of(result: dict) -> str:
    a = result["analysis"]
    differ = [r for r in a["rows"] if r["verdict"] != "alike"]
    where = ", ".join(
        f"run {r['run']}: {r['tables'][0]} → {r['tables'][1]} at {r['table_differs_at']}"
        if r["verdict"] == "dac" else f"run {r['run']}: unexplained at {r['numbers_differ_at']}"
        for r in differ[:4]) + (", …" if len(differ) > 4 else "")
    bound = max((r["final_loss_diff"] or 0.0 for r in differ), default=0.0)
    val = max((r["final_val_loss_diff"] or 0.0 for r in differ), default=0.0)
    param = max((r["max_param_diff"] for r in differ), default=0.0)
    return (f"| {result['cpu']} | {result['date'][:10]} | `{result['commit']}` | "
            f"{result['dac']} | {a['runs']} | {a['alike']} | {len(a['tables'])} | "
            f"{'yes' if a['groups_alike'] else '**no**'} | {a['dac']} | "
            f"{len(a['unexplained'])} | "
            + (f"{bound:.2g} / {val:.2g} / {param:.2g}" if differ else "–")
            + f" | {where or '–'} |")


def report() -> None:
    results = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path) as fh:
            results.append(json.load(fh))
    lines = ["| CPU | date | commit | DAC | runs | alike with run 0 | distinct tables | "
             "equal tables → alike | differ after DAC's table | unexplained | "
             "largest Δ final loss / val loss / parameter | where the tables differ |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [row_of(r) for r in results]
    rule = ("Run *i* sets `PYTHONHASHSEED=i`; each run is compared with run 0 bit for bit "
            "(every iteration's loss, grad norm, ranks in force, validation losses, the final "
            "parameters and optimizer state). The named source of difference is DAC: it "
            "sets the later stage's DP rank from measured wall-clock times (docs/method.md "
            "§6). A run whose rank tables equal run 0's must be alike; one whose tables "
            "differ must agree up to the first iteration they differ at; anything else is "
            "unexplained (the script exits 1). Runs with equal tables are also checked "
            "against each other (\"equal tables → alike\").")
    write_section("repro", "A run that reproduces itself (issue 91)",
                  "bench/repro.py --runs 20 [--dac off]",
                  "\n".join(lines) + f"\n\n{rule}\n\n<!-- notes -->")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--dac", choices=("on", "off"), default="on")
    ap.add_argument("--reuse", action="store_true",
                    help="take the complete runs already under runs/bench/repro/")
    ap.add_argument("--no-write", action="store_true",
                    help="print; leave bench/results and BENCHMARKS.md alone")
    ap.add_argument("--report-only", action="store_true",
                    help="only rewrite the BENCHMARKS.md section from bench/results/repro/")
    args = ap.parse_args()
    if args.report_only:
        report()
        return 0
    tag = f"dac-{args.dac}" + ("" if args.iters == 60 else f"-{args.iters}")
    out = os.path.join(RUNS, tag)
    os.makedirs(out, exist_ok=True)
    flags = job_flags(args.iters, args.dac)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda i: run_one(i, out, flags, args.reuse), range(args.runs)))
    analysis = analyse(runs)
    for r in analysis["rows"]:
        print(f"run {r['run']}: {r['verdict']}" + (
            f" (tables differ at {r['table_differs_at']}: {r['tables']}; "
            f"numbers from {r['numbers_differ_at']}; final loss Δ {r['final_loss_diff']:.3g}, "
            f"max parameter Δ {r['max_param_diff']:.3g})" if r["verdict"] != "alike" else ""))
    print(f"{analysis['alike']} of {analysis['runs']} alike with run 0; {analysis['dac']} "
          f"differ after DAC's table did; unexplained: {analysis['unexplained'] or 'none'}; "
          f"{len(analysis['tables'])} distinct tables, equal tables alike: "
          f"{analysis['groups_alike']}")
    if not args.no_write:
        result = {"command": " ".join(["bench/repro.py", *sys.argv[1:]]),
                  "job": flags, "cpu": cpu_model(), "machine": machine(),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  "commit": commit(), "dac": args.dac, "iters": args.iters,
                  "analysis": analysis}
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, f"{slug(result['cpu'])}-{tag}.json"), "w") as fh:
            json.dump(result, fh, indent=1)
        report()
    return 1 if analysis["unexplained"] else 0


if __name__ == "__main__":
    sys.exit(main())
