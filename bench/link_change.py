#!/usr/bin/env python
"""A link that changes under the running job (issue 44): the bypass following it, against
the same job fixed at dense and fixed at compressed, ms/iter per phase.

    sudo python bench/link_change.py            # ~15 min on 2 cores; writes BENCHMARKS.md

The tiny CPU default GPT-2 (``configs/tiny-cpu.yaml``, the real corpus and its BPE) on 4
ranks, static rank 32, in two layouts on shaped network namespaces (bench/netns.py):
``flat`` (DP 4, every rank's link shaped) and ``two-level`` (2 distributed-optimizer
instances of 2 ranks, only the slow hop shaped). The links run at ``--fast``, change to
``--slow`` after iteration P and back after 2P (``RateSchedule``: the change lands as the
progress line of that iteration appears). Three modes, run back to back in each
repetition:

* ``bypass``: ``--edgc-bypass auto --edgc-link-window W`` (the link model follows the link),
* ``dense``: every bucket dense through the same pipeline (a declared 1000 Gbit/s link),
* ``compressed``: ``--edgc-bypass off`` (always PowerSGD).

Per phase: mean ms/iter over its iterations (the first iteration of the run left out),
mean and spread (min..max) over the repetitions; the bypass's phase includes the window
it takes to follow the change. The goal: the better of the fixed modes in every phase,
within the spread."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.netns import NetnsUnavailable, RateSchedule, ShapedNetwork  # noqa: E402
from bench.report import write_section  # noqa: E402

LAYOUTS = {
    "flat": (1, ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4"]),
    "two-level": (2, ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
                      "--use-distributed-optimizer",
                      "--num-distributed-optimizer-instances", "2"]),
}


def modes(window: int) -> dict:
    return {"bypass": ["--edgc-bypass", "auto", "--edgc-link-window", str(window)],
            "dense": ["--edgc-bypass", "auto", "--edgc-link-gbps", "1000"],
            "compressed": ["--edgc-bypass", "off"]}


def run_one(net, out: str, name: str, flags: list, iters: int, changes: list,
            port: int, reuse: bool) -> tuple:
    """One run: (records, [(iteration seen, rate, s)] of the applied changes)."""
    metrics, log = os.path.join(out, f"{name}.jsonl"), os.path.join(out, f"{name}.log")
    applied_file = os.path.join(out, f"{name}.changes.json")
    if not (reuse and os.path.exists(applied_file)):
        net.set_rate(changes[-1][1])                  # the fast rate to start with
        rates = RateSchedule(changes[:-1], log)
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"),
               "--config", os.path.join(ROOT, "configs", "tiny-cpu.yaml"), *flags,
               "--train-iters", str(iters), "--lr-warmup-iters", "4", "--eval-interval",
               str(10 * iters), "--eval-iters", "1", "--log-interval", "1",
               "--metrics-file", metrics, "--edgc-mode", "static", "--edgc-rank", "32"]
        print(f"=== {name}", flush=True)
        with open(log, "w") as fh:
            codes = net.run(cmd, port=port, env={"OMP_NUM_THREADS": "1"}, timeout=1800,
                            stdout=fh, rates=rates, cwd=ROOT)
        if any(codes):
            raise RuntimeError(f"{name} failed ({codes}); see {log}")
        with open(applied_file, "w") as fh:
            json.dump(rates.applied, fh)
    with open(metrics) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    with open(applied_file) as fh:
        return records, json.load(fh)


def phase_ms(records: list, phases: list, settle: int = 0) -> list:
    """Mean ms/iter of each phase ``(first, last)`` (1-based, inclusive; iteration 1 out),
    from its ``settle``-th iteration on in the phases after a change."""
    by_it = {r["iteration"]: r["iter_ms"] for r in records}
    return [statistics.mean(by_it[i] for i in range(max(2, a + (settle if k else 0)), b + 1))
            for k, (a, b) in enumerate(phases)]


def follow_windows(records: list, applied: list, window: int) -> list:
    """For each applied change, the windows from the change to the bypass's next flip."""
    dense = {r["iteration"]: r.get("dp_bypassed_buckets", 0) > 0 for r in records}
    out = []
    for seen, _, _ in applied:
        flips = [i for i in sorted(dense) if i > seen and dense[i] != dense[i - 1]]
        out.append((flips[0] - seen) / window if flips else float("nan"))
    return out


def cell(values: list) -> str:
    if len(values) == 1:
        return f"{values[0]:.0f}"
    return f"{statistics.mean(values):.0f} ({min(values):.0f}..{max(values):.0f})"


def verdict(bypass: list, dense: list, comp: list) -> str:
    """Bypass against the better fixed mode of the phase: inside the spread (the ranges
    overlap) is not resolved."""
    best_name, best = min((("dense", dense), ("compressed", comp)),
                          key=lambda nv: statistics.mean(nv[1]))
    if min(bypass) <= max(best):
        return f"= {best_name} (within the spread)"
    return f"{statistics.mean(bypass) / statistics.mean(best):.2f}x {best_name}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--phase-iters", type=int, default=16, help="P: iterations per phase")
    p.add_argument("--window", type=int, default=4, help="--edgc-link-window of the bypass")
    p.add_argument("--fast", default="2gbit")
    p.add_argument("--slow", default="100mbit")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "link_change"))
    p.add_argument("--reuse", action="store_true", help="take finished runs' files")
    p.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    args = p.parse_args()
    P, iters = args.phase_iters, 3 * args.phase_iters
    changes = [(P, args.slow), (2 * P, args.fast), (0, args.fast)]   # last: the start rate
    phases = [(1, P), (P + 1, 2 * P), (2 * P + 1, iters)]
    names = [f"{args.fast} 1..{P}", f"{args.slow} {P + 1}..{2 * P}",
             f"{args.fast} {2 * P + 1}..{iters}"]
    results: dict = {}
    port = 29700
    for layout in args.layouts:
        per_ns, flags = LAYOUTS[layout]
        out = os.path.join(args.out, layout)
        os.makedirs(out, exist_ok=True)
        try:
            with ShapedNetwork(4, args.fast, per_ns) as net:
                for rep in range(args.reps):
                    for mode, mflags in modes(args.window).items():
                        port += 1
                        records, applied = run_one(net, out, f"{mode}_rep{rep}",
                                                   flags + mflags, iters, changes, port,
                                                   args.reuse)
                        r = results.setdefault((layout, mode),
                                               {"ms": [], "settled": [], "follow": []})
                        r["ms"].append(phase_ms(records, phases))
                        r["settled"].append(phase_ms(records, phases, 2 * args.window))
                        if mode == "bypass":
                            r["follow"].append(follow_windows(records, applied, args.window))
        except NetnsUnavailable as exc:
            print(f"namespaces unavailable ({exc}): this benchmark needs root")
            return 1
    lines = []
    for key, what in (("ms", "the whole phase, the bypass's following included"),
                      ("settled", f"each changed phase from its {2 * args.window + 1}th "
                                  f"iteration on (two windows: the bypass has followed)")):
        lines += ["", f"Mean ms/iter over {what}:", "",
                  "| layout | phase | bypass | dense | compressed | "
                  "bypass against the better fixed mode |", "|---|---|---|---|---|---|"]
        for layout in args.layouts:
            for k, name in enumerate(names):
                cols = [[ms[k] for ms in results[(layout, m)][key]]
                        for m in ("bypass", "dense", "compressed")]
                lines.append(f"| {layout} | {name} | {cell(cols[0])} | {cell(cols[1])} | "
                             f"{cell(cols[2])} | {verdict(*cols)} |")
    follow = ["", "Windows from each change to the bypass's flip (per repetition; the change "
              "lands during a window, so 1 to 2 is \"after one whole window at the new "
              "rate\"):", ""]
    for layout in args.layouts:
        for k, (seen, rate) in enumerate(changes[:-1]):
            got = [f[k] for f in results[(layout, "bypass")]["follow"]]
            follow.append(f"* {layout}, to {rate} after iteration {seen}: "
                          + ", ".join(f"{w:.2f}" for w in got))
    body = "\n".join([
        f"{args.reps} repetitions, each running the three modes back to back; mean "
        f"(min..max) of the phase's mean ms/iter. Tiny CPU GPT-2, 4 ranks, static rank 32, "
        f"link window {args.window}; links {args.fast} -> {args.slow} after iteration {P} "
        f"-> {args.fast} after {2 * P}. CPU times: indicative only.", "",
        *lines, *follow, "", "<!-- notes -->"])
    print(body)
    if not args.no_write:
        write_section("link_change", "A link that changes under the job: the bypass follows "
                      "it (issue 44)", "sudo python bench/link_change.py", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
