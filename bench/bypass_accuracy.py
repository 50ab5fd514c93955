#!/usr/bin/env python
"""The bypass's prices of both choices against what each choice took, on the race's links
(issue 80).

    sudo python bench/bypass_accuracy.py [--links 100mbit 300mbit 1gbit] [--repeats 2]

The race's layout (``configs/tiny-cpu.yaml`` at TP1·PP1·DP4, the real corpus and its BPE;
fp32 training, 4 layers, hidden 128) on 4 ranks in shaped network namespaces
(bench/netns.py), the product's defaults but one: ``--edgc-link-explore 1`` (every
window's first iteration sends each bucket the other way, so that one run measures both
choices; the default explores every 4th window), and ``--edgc-link-window 5`` so that a
40-iteration run holds 7 refits. Modes: static at the race's r_max (32) and EDGC.

Per link and mode, over the iterations after the first window: the median DP sync of the
iterations sent dense and of those sent compressed (``dp_sync_ms``: the sync's own time,
with the wait for the slowest replica), the bypass's prices of both (``dp_predicted_*``:
the link and the local work, without that wait), the difference each way (what decides),
and the decision in force. Right: the decision in force is the choice with the shorter
measured sync, or the two are within 10 % of the longer (a tie: either is right).
Spread: min–max of the medians over the repetitions."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.netns import NetnsUnavailable, ShapedNetwork  # noqa: E402
from bench.report import write_section  # noqa: E402

WINDOW = 5
LAYOUT = ["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4"]
MODES = {"static r32": ["--edgc-mode", "static", "--edgc-rank", "32"],
         "EDGC": ["--edgc-mode", "edgc", "--edgc-window", "5", "--edgc-warmup-max-iters", "5"]}
TIE = 0.10


def run_one(net, out: str, name: str, flags: list, iters: int, port: int, reuse: bool) -> list:
    metrics = os.path.join(out, f"{name}.jsonl")
    if not (reuse and os.path.exists(metrics)):
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"),
               "--config", os.path.join(ROOT, "configs", "tiny-cpu.yaml"), *LAYOUT,
               "--no-bf16", "--train-iters", str(iters), "--eval-interval", "1000",
               "--eval-iters", "1", "--log-interval", "1", "--metrics-file", metrics,
               "--edgc-bypass", "auto", "--edgc-link-window", str(WINDOW),
               "--edgc-link-explore", "1", *flags]
        with open(os.path.join(out, f"{name}.log"), "w") as fh:
            codes = net.run(cmd, port=port, env={"OMP_NUM_THREADS": "1"}, timeout=900,
                            stdout=fh, cwd=ROOT)
        if any(codes):
            raise RuntimeError(f"{name}: exit codes {codes} (log {fh.name})")
    return [json.loads(line) for line in open(metrics)]


def summarize(records: list) -> dict:
    """Medians over the compressing iterations after the first window (EDGC's dense
    warm-up has no bypass decision and is left out)."""
    recs = [r for r in records if r["iteration"] > WINDOW and "dp_predicted_dense_ms" in r
            and r.get("rank_dp") is not None]
    sent_dense = [r["dp_bypassed_buckets"] > 0 for r in recs]
    in_force = [d != r["dp_bypass_explored"] for d, r in zip(sent_dense, recs)]
    sync = lambda want: [max(x for x in r["dp_sync_ms"] if x == x)   # noqa: E731
                         for r, d in zip(recs, sent_dense) if d == want]
    med = lambda v: statistics.median(v) if v else float("nan")    # noqa: E731
    return {"dense_ms": med(sync(True)), "compressed_ms": med(sync(False)),
            "pred_dense_ms": med([r["dp_predicted_dense_ms"] for r in recs]),
            "pred_compressed_ms": med([r["dp_predicted_compressed_ms"] for r in recs]),
            "dense_share": sum(in_force) / len(in_force) if in_force else float("nan"),
            "samples": [len(sync(True)), len(sync(False))]}


def verdict(s: dict) -> str:
    """Whether the decision in force (its majority) is the choice with the shorter
    measured sync."""
    d, c = s["dense_ms"], s["compressed_ms"]
    if abs(d - c) <= TIE * max(d, c):
        return "tie: either is right"
    chose_dense = s["dense_share"] > 0.5
    return "right" if chose_dense == (d < c) else "**wrong**"


def spread(values, fmt="{:.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–" \
           f"{fmt.format(max(values))})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--links", nargs="+", default=["100mbit", "300mbit", "1gbit"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "bypass_accuracy"))
    p.add_argument("--reuse", action="store_true", help="take runs already in --out")
    p.add_argument("--no-write", action="store_true", help="print, leave BENCHMARKS.md alone")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results: dict = {}
    try:
        for rep in range(args.repeats):           # repetitions outermost: drift spreads
            for link in args.links:
                with ShapedNetwork(4, link) as net:
                    for k, mode in enumerate(args.modes):
                        name = f"{mode.replace(' ', '_')}_{link}_rep{rep}"
                        recs = run_one(net, args.out, name, MODES[mode], args.iters,
                                       29800 + k, args.reuse)
                        s = summarize(recs)
                        results.setdefault((link, mode), []).append(s)
                        print(link, mode, rep, json.dumps(s), flush=True)
    except NetnsUnavailable as exc:
        print(f"error: shaped links need root and ip/tc: {exc}", file=sys.stderr)
        return 2
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump([{"link": k[0], "mode": k[1], "runs": v} for k, v in results.items()],
                  fh, indent=1)
    rows = []
    for (link, mode), runs in results.items():
        get = lambda key: [r[key] for r in runs]   # noqa: E731
        saving = [r["dense_ms"] - r["compressed_ms"] for r in runs]
        predicted = [r["pred_dense_ms"] - r["pred_compressed_ms"] for r in runs]
        rows.append(f"| {link} | {mode} | {spread(get('dense_ms'))} | "
                    f"{spread(get('pred_dense_ms'))} | {spread(get('compressed_ms'))} | "
                    f"{spread(get('pred_compressed_ms'))} | {spread(saving)} | "
                    f"{spread(predicted)} | {spread(get('dense_share'), '{:.2f}')} | "
                    f"{', '.join(verdict(r) for r in runs)} |")
    from bench.peers import code_version

    body = "\n".join([
        f"Code {code_version()}. "
        f"The race's layout (`configs/tiny-cpu.yaml`, TP1·PP1·DP4, fp32) on shaped network "
        f"namespaces, {args.iters} iterations, {args.repeats} repetitions; the product's "
        f"defaults but `--edgc-link-explore 1` (every window's first iteration sends each "
        f"bucket the other way, so one run measures both choices) and `--edgc-link-window "
        f"{WINDOW}`. Medians over the iterations after the first window, median (min–max) "
        f"over the repetitions. Measured: the DP sync of the iterations sent each way "
        f"(with the wait for the slowest replica, which no price holds); predicted: the "
        f"bypass's price of each (link and local work). The saving (dense − compressed) "
        f"decides; right where the decision in force (dense share > 0.5: dense) is the "
        f"choice with the shorter measured sync, a tie where the two are within {TIE:.0%} of "
        f"the longer.",
        "",
        "| link | mode | dense ms | priced | compressed ms | priced | saving ms | priced "
        "| dense share | decision per repetition |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", "<!-- notes -->"])
    print(body)
    if not args.no_write:
        write_section("bypass_accuracy", "The bypass's prices against both choices measured "
                      "(issue 80)", "sudo .venv/bin/python bench/bypass_accuracy.py", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
