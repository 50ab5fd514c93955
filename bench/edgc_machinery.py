#!/usr/bin/env python
"""EDGC's machinery against static PowerSGD at the same rank (issue 93, item 1).

    python bench/edgc_machinery.py [--pairs 7] [--iters 60] [--rank 32]

Runs EDGC (its controller running: GDS sampling, windows, the bypass on a declared
link) with its rank range pinned to one rank, and static PowerSGD at that rank, with
the same data, seed, bypass flags and layout (TP1 x PP1 x DP2 on configs/tiny-cpu.yaml,
gloo on loopback), alternating, the first mode of each pair rotating. Per run, the median
``iter_ms`` over the iterations where EDGC ran at the rank and neither run explored the
bypass (the same iteration numbers in both); per pair, EDGC over static. Reports the
median and range of the pairs. ``iter_ms`` holds the controller's work after the
optimizer step (runtime/frontend.py). Writes bench/results/edgc_machinery/ and the
``edgc_machinery`` section of BENCHMARKS.md.
"""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.report import code_stamp, run_pretrain, stamp_text, write_section  # noqa: E402

OUT = os.path.join(ROOT, "bench", "results", "edgc_machinery")


def flags(mode: str, rank: int, iters: int) -> list:
    common = ["--config", os.path.join(ROOT, "configs", "tiny-cpu.yaml"),
              "--data-parallel-size", "2", "--pipeline-model-parallel-size", "1",
              "--tensor-model-parallel-size", "1", "--eval-interval", str(10 * iters),
              "--eval-iters", "1", "--no-bf16",
              # the product's bypass, on a declared 100 Mbit link: compressing pays
              "--edgc-bypass", "auto", "--edgc-link-gbps", "0.1"]
    if mode == "edgc":
        return [*common, "--edgc-mode", "edgc", "--edgc-rank-max", str(rank),
                "--edgc-rank-min", str(rank), "--edgc-warmup-max-iters", "10"]
    return [*common, "--edgc-mode", "static", "--edgc-rank", str(rank)]


def at_rank(records: list, rank: int) -> set:
    """Iterations where every stage ran at ``rank``, the bypass not exploring."""
    return {r["iteration"] for r in records
            if r.get("rank_dp") and all(x == rank for x in r["rank_dp"])
            and not r.get("dp_bypass_explored")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--pairs", type=int, default=7)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--reuse", action="store_true", help="take runs already in the results")
    args = p.parse_args()
    if args.pairs < 1:
        p.error("--pairs must be >= 1")
    os.makedirs(OUT, exist_ok=True)
    stamp = code_stamp()
    pairs = []
    for i in range(args.pairs):
        order = ("edgc", "static") if i % 2 == 0 else ("static", "edgc")
        runs = {}
        for mode in order:
            runs[mode], _ = run_pretrain(f"{mode}-{i}", flags(mode, args.rank, args.iters),
                                         OUT, args.iters, reuse=args.reuse)
        common = sorted(at_rank(runs["edgc"], args.rank) & at_rank(runs["static"], args.rank))
        common = [it for it in common if it > 2]   # the first iterations warm the caches
        med = {m: statistics.median(r["iter_ms"] for r in runs[m] if r["iteration"] in common)
               for m in runs}
        pairs.append({"pair": i, "first": order[0], "iterations": len(common),
                      "edgc_ms": med["edgc"], "static_ms": med["static"],
                      "ratio": med["edgc"] / med["static"]})
        print(f"pair {i}: EDGC {med['edgc']:.1f} ms, static {med['static']:.1f} ms, "
              f"{pairs[-1]['ratio']:.3f}x over {len(common)} iterations", flush=True)
    ratios = [q["ratio"] for q in pairs]
    summary = {"rank": args.rank, "iters": args.iters, "pairs": pairs,
               "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
               "max_ratio": max(ratios), "code": stamp}
    with open(os.path.join(OUT, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    rows = "\n".join(f"| {q['pair']} | {q['first']} | {q['iterations']} | "
                     f"{q['edgc_ms']:.1f} | {q['static_ms']:.1f} | {q['ratio']:.3f} |"
                     for q in pairs)
    body = f"""EDGC with its controller running (GDS sampling, windows; rank range pinned to
r{args.rank}) against static PowerSGD r{args.rank}, TP1 x PP1 x DP2 on configs/tiny-cpu.yaml
(fp32, gloo on loopback, the bypass `auto` on a declared 100 Mbit link), {args.iters}
iterations a run, alternating, the first mode rotating. Per run the median `iter_ms` (the
controller's work after the optimizer step included) over the iterations where EDGC ran
at r{args.rank} and neither run explored; per pair EDGC over static. Code:
{stamp_text(stamp)}.

**EDGC over static at r{args.rank}, per iteration: {summary['median_ratio']:.3f}
(range {summary['min_ratio']:.3f}-{summary['max_ratio']:.3f}, {len(pairs)} pairs).**

| pair | first | iterations | EDGC ms | static ms | EDGC / static |
|---:|---|---:|---:|---:|---:|
{rows}

<!-- notes -->
"""
    write_section("edgc_machinery", "EDGC's machinery against static at the same rank",
                  "python bench/edgc_machinery.py", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
