#!/usr/bin/env python
"""When EDGC's stability rule ends the dense warm-up on a run of a real length.

    .venv/bin/python bench/warmup_length.py [--iters 5000] [--seeds 1234]

The race's model (``configs/tiny-cpu.yaml``, TP1·PP1·DP4 on local gloo processes),
``--edgc-mode edgc --edgc-bypass off --edgc-warmup-max-fraction 1`` (the paper's rule alone,
no bound) and ``--train-iters ITERS``, under two settings of the rule (EDGC §5: the warm-up
ends once the window-mean gradient entropy moved less than ε_H for K windows in a row):

* the flags' own defaults (:class:`~megatron_edgc.config.edgc.EdgcConfig`: window 1000,
  α 0.1, β 0.25, ε_H 0.01, K 2), read from the config class, not restated here;
* ``configs/tiny-cpu.yaml``'s (window 20, α 0.25, ε_H 0.05, K 2).

Each run is stopped at the first iteration whose metrics carry ``warmup_end_iter`` (the
rule fired; the rest of the run is compressed and tells nothing more about the warm-up),
or runs to its end (the rule never fired). Writes the ``warmup_length`` section of
BENCHMARKS.md: per setting and seed the iteration the warm-up ended at, as a share of the
run, and the dense bytes it cost against the whole run dense.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.report import write_section  # noqa: E402
from megatron_edgc.config.edgc import EdgcConfig  # noqa: E402

CONFIG = "configs/tiny-cpu.yaml"
OUT = os.path.join(ROOT, "bench", "results", "warmup_length")
RULE = ("window", "iter_sample_rate", "grad_sample_rate", "warmup_eps", "warmup_windows")


def flag(name: str) -> str:
    return "--edgc-" + name.replace("_", "-")


def settings() -> dict:
    """name -> the rule's flags (empty: the config's own)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EdgcConfig) if f.name in RULE}
    pinned = [x for name in RULE for x in (flag(name), str(defaults[name]))]
    label = ", ".join(f"{name} {defaults[name]}" for name in RULE)
    return {f"flags' defaults ({label})": pinned, "tiny-cpu.yaml (window 20, α 0.25, "
            "β 0.25, ε_H 0.05, K 2)": []}


def run_until_warmup_ends(name: str, flags: list, iters: int, seed: int) -> dict:
    """One run, stopped once the warm-up has ended; its outcome (reused when recorded)."""
    os.makedirs(OUT, exist_ok=True)
    outcome = os.path.join(OUT, f"{name}.json")
    if os.path.exists(outcome):
        with open(outcome) as fh:
            return json.load(fh)
    metrics = os.path.join(OUT, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"), "--config",
           os.path.join(ROOT, CONFIG), "--train-iters", str(iters), "--seed", str(seed),
           "--metrics-file", metrics, "--log-interval", "100", "--eval-interval",
           str(iters), "--eval-iters", "1", "--edgc-mode", "edgc", "--edgc-bypass", "off",
           "--edgc-warmup-max-fraction", "1", *flags]
    print("===", name, " ".join(flags), flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    ended, last = None, 0
    seen = 0
    while proc.poll() is None or seen < _lines(metrics):
        for record in _records(metrics, seen):
            seen += 1
            last = record["iteration"]
            if record.get("warmup_end_iter") is not None and ended is None:
                ended = record["warmup_end_iter"]
        if ended is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            break
        time.sleep(2)
    if ended is None and proc.returncode not in (0, None):
        raise RuntimeError(f"{name}: the run failed ({proc.returncode})")
    os.remove(metrics)   # the outcome is the record kept (a 5000-line log is 5 MB)
    result = {"name": name, "flags": flags, "iters": iters, "seed": seed,
              "warmup_end_iter": ended, "last_iteration": last,
              "wall_s": round(time.time() - t0, 1)}
    with open(outcome, "w") as fh:
        json.dump(result, fh)
    return result


def _lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as fh:
        return sum(1 for line in fh if line.endswith("\n"))


def _records(path: str, skip: int) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        lines = [line for line in fh if line.endswith("\n")]
    return [json.loads(line) for line in lines[skip:]]


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text.split(" (")[0]).strip("_")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234])
    p.add_argument("--only", choices=["defaults", "config"], default=None)
    args = p.parse_args()
    rows = ["| rule's setting | seed | run length | warm-up ended at | share of the run |",
            "|---|---|---|---|---|"]
    for label, flags in settings().items():
        if args.only and not label.startswith({"defaults": "flags'", "config": "tiny"}[
                args.only]):
            continue
        for seed in args.seeds:
            r = run_until_warmup_ends(f"{slug(label)}_{args.iters}_seed{seed}", flags,
                                      args.iters, seed)
            end = r["warmup_end_iter"]
            at = str(end) if end is not None else f"not by {r['last_iteration']}"
            share = f"{end / args.iters:.1%}" if end is not None else "—"
            rows.append(f"| {label} | {seed} | {args.iters} | {at} | {share} |")
            print(rows[-1], flush=True)
    body = ("`--edgc-mode edgc --edgc-bypass off --edgc-warmup-max-fraction 1` (the stability "
            "rule alone) on tiny-cpu, TP1·PP1·DP4, each run stopped once the warm-up ended.\n\n"
            + "\n".join(rows) + "\n\n<!-- notes -->")
    write_section("warmup_length", "The warm-up at a real run's length",
                  ".venv/bin/python bench/warmup_length.py", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
