#!/usr/bin/env python
"""EDGC on the slow hop against flat EDGC and Megatron's dense partial distributed
optimizer, on an emulated two-level cluster (issue 35).

    sudo .venv/bin/python bench/slow_hop.py            # 3 rates x 4 modes x 3 repetitions
    sudo .venv/bin/python bench/slow_hop.py --quick    # 1 repetition, 30 iterations

Two instances of two ranks (TP1·PP1·DP4 on these 2 cores): the ranks of an instance share
a network namespace (fast, unshaped), the namespaces are joined by tbf-shaped veth links
at 100 Mbit, 300 Mbit and 1 Gbit (bench/netns.py, ``ranks_per_namespace=2``). Modes, same
data, seed and iterations:

* ``dense flat``: megatron-core's DP all-reduce over all four ranks;
* ``dense partial``: Megatron's partial distributed optimizer, 2 instances (reduce-scatter
  inside, the shard all-reduced across);
* ``EDGC flat``: EDGC's PowerSGD all-reduce over all four ranks (the product before);
* ``EDGC slow hop``: the partial distributed optimizer with EDGC on the inter-instance
  all-reduce of each rank's shard only.

EDGC runs as a static rank (``--edgc-mode static --edgc-rank R``, bypass off) so that the
flat and slow-hop modes compress at the same rank. Per run, after the first 3 iterations:
ms/iter, the DP sync (``grad_sync_ms``), the bytes that crossed the shaped links per
iteration (veth counters over the run, start-up and evaluation included, divided by the
iterations; and the records' ``dp_slow_hop_bytes_sent_job`` where the mode has one),
compression ms per rank, error-feedback MiB per rank, the final validation loss. Each
figure is the median over the repetitions with (min–max); ratios pair the runs of one
repetition. Repetition i runs seed 1234 + i (init and data order), so the repetitions are
also the loss's seeds: losses are compared paired per seed, against the seed-to-seed
spread. Before the runs of each link, the emulator is checked against the alpha-beta model
(concurrent all-reduces across the namespaces, :func:`bench.netns.selftest`). Writes the
``slow_hop`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.netns import (NetnsUnavailable, ShapedNetwork, selftest,  # noqa: E402
                         two_level_allreduce_s)
from bench.report import run_pretrain, write_section  # noqa: E402

RATES = ["100mbit", "300mbit", "1gbit"]
RANKS, PER_INSTANCE = 4, 2
RANK = 8
SEED = 1234            # repetition i runs seed SEED + i: the repetitions are the seeds
CHECK_NUMEL = 1_600_000  # the emulator check: concurrent all-reduces of 6.4 MB
BASE = ["--config", "configs/tiny-cpu.yaml", "--pipeline-model-parallel-size", "1",
        "--data-parallel-size", str(RANKS), "--edgc-bypass", "off"]
PARTIAL = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances",
           str(RANKS // PER_INSTANCE)]
STATIC = ["--edgc-mode", "static", "--edgc-rank", str(RANK)]
MODES = {
    "dense flat": [],
    "dense partial": PARTIAL,
    "EDGC flat": STATIC,
    "EDGC slow hop": PARTIAL + STATIC,
}


def steady(records, key, skip=3):
    """Mean of ``key`` over the records after the first ``skip`` (per-stage lists: their
    mean; one stage here)."""
    vals = []
    for r in records[skip:]:
        v = r.get(key)
        if isinstance(v, list):
            v = float(numpy.mean(v)) if v else None
        if isinstance(v, (int, float)):
            vals.append(v)
    return float(numpy.mean(vals)) if vals else float("nan")


def measure(records, summary, link_bytes, iters) -> dict:
    return {"iter_ms": steady(records, "iter_ms"),
            "sync_ms": steady(records, "grad_sync_ms"),
            "link_bytes_per_iter": link_bytes / iters,
            "slow_hop_bytes_job": steady(records, "dp_slow_hop_bytes_sent_job"),
            "compress_ms": steady(records, "dp_compress_ms"),
            "ef_mib": steady(records, "dp_ef_bytes") / 2**20,
            "val_loss": summary.get("val_loss", float("nan"))}


def run_all(rates, iters, repeats, out_root) -> dict:
    results: dict = {}
    port = 29700
    for rate in rates:
        with ShapedNetwork(RANKS, rate, ranks_per_namespace=PER_INSTANCE) as net:
            # the emulator against the alpha-beta model: every instance rank's all-reduce
            # across instances at once, sharing the links, as the slow hop's shards do
            check = selftest(net, CHECK_NUMEL, PER_INSTANCE)
            check["modelled"] = two_level_allreduce_s(CHECK_NUMEL * 4, RANKS // PER_INSTANCE,
                                                      PER_INSTANCE, rate)
            results.setdefault("check", {})[rate] = check
            for rep in range(repeats):
                for mode, flags in MODES.items():
                    port += 1
                    before = net.link_bytes()

                    def launch(cmd, port=port):
                        codes = net.run(cmd, port=port, env={"OMP_NUM_THREADS": "1"},
                                        timeout=3600, cwd=ROOT)
                        return max(abs(c) for c in codes)

                    records, summary = run_pretrain(
                        f"{mode.replace(' ', '_')}_rep{rep}",
                        BASE + flags + ["--eval-interval", str(iters), "--eval-iters", "5",
                                        "--lr-warmup-iters", str(max(2, iters // 10)),
                                        "--seed", str(SEED + rep)],
                        os.path.join(out_root, rate), iters, launch=launch)
                    results.setdefault(f"{rate}|{mode}", []).append(
                        measure(records, summary, net.link_bytes() - before, iters))
    return results


def remeasure(out_root, rates, iters) -> dict:
    """The recorded runs measured again (the veth bytes are only in results.json)."""
    with open(os.path.join(out_root, "results.json")) as fh:
        old = json.load(fh)
    results = {"check": old.get("check", {})}
    for key, runs in old.items():
        if key == "check":
            continue
        rate, mode = key.split("|")
        if rate not in rates:
            continue
        for rep, run in enumerate(runs):
            base = os.path.join(out_root, rate, f"{mode.replace(' ', '_')}_rep{rep}")
            with open(base + ".jsonl") as fh:
                records = [json.loads(line) for line in fh if line.strip()]
            with open(base + ".summary.json") as fh:
                summary = json.load(fh)
            results.setdefault(key, []).append(
                measure(records, summary, run["link_bytes_per_iter"] * iters, iters))
    return results


def cell(vals, spec=".1f", scale=1.0) -> str:
    vals = [v * scale for v in vals]
    if all(v != v for v in vals):   # NaN: the mode has no such figure (dense: no EF)
        return "—"
    if len(vals) == 1:
        return format(vals[0], spec)
    return f"{format(float(numpy.median(vals)), spec)} ({format(min(vals), spec)}–" \
           f"{format(max(vals), spec)})"


def report(results, rates, iters, repeats) -> str:
    lines = []
    if results.get("check"):
        lines += [f"The emulator against the alpha-beta model: {PER_INSTANCE} concurrent gloo "
                  f"all-reduces of {CHECK_NUMEL * 4 / 1e6:.1f} MB across the "
                  f"{RANKS // PER_INSTANCE} namespaces (one per instance rank, sharing the "
                  "links, min of 3, until every rank is done), and one inside each "
                  "namespace:", "",
                  "| link | across, measured | across, modelled | measured / modelled "
                  "| inside, measured |", "|---|---|---|---|---|"]
        for rate in rates:
            c = results["check"].get(rate)
            if c:
                lines.append(f"| {rate} | {1e3 * c['inter']:.1f} ms | "
                             f"{1e3 * c['modelled']:.1f} ms | {c['inter'] / c['modelled']:.3f} "
                             f"| {1e3 * c['intra']:.1f} ms |")
        lines.append("")
    lines += [f"Tiny default (4 layers, hidden 128), TP1·PP1·DP4 as 2 instances × 2 ranks, "
             f"{iters} iterations, static rank {RANK}, {repeats} repetition(s), repetition i "
             f"with seed {SEED} + i: median (min–max).", "",
             "| link | mode | ms/iter | DP sync ms | MB over the shaped links / iter | "
             "compress ms / rank | EF MiB / rank | val loss |",
             "|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        for mode in MODES:
            runs = results[f"{rate}|{mode}"]
            col = lambda k: [r[k] for r in runs]  # noqa: E731
            lines.append(f"| {rate} | {mode} | {cell(col('iter_ms'))} | {cell(col('sync_ms'))} "
                         f"| {cell(col('link_bytes_per_iter'), '.2f', 1e-6)} | "
                         f"{cell(col('compress_ms'), '.2f')} | {cell(col('ef_mib'), '.2f')} | "
                         f"{cell(col('val_loss'), '.4f')} |")
    lines += ["", "Ratios, paired per repetition (slow hop / flat EDGC; slow hop / dense "
                  "partial), and the validation loss paired per seed (slow hop − flat EDGC; "
                  "slow hop − dense partial) beside the seed-to-seed spread (max − min over "
                  "the seeds) of flat EDGC's loss:", "",
              "| link | compress ms | EF MiB | link bytes | ms/iter vs dense partial "
              "| Δ val loss vs flat EDGC | Δ val loss vs dense partial | seed spread |",
              "|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        hop, flat = results[f"{rate}|EDGC slow hop"], results[f"{rate}|EDGC flat"]
        dense = results[f"{rate}|dense partial"]
        ratio = lambda a, b, k: [x[k] / y[k] for x, y in zip(a, b)]  # noqa: E731
        diff = lambda a, b: [x["val_loss"] - y["val_loss"] for x, y in zip(a, b)]  # noqa: E731
        spread = max(r["val_loss"] for r in flat) - min(r["val_loss"] for r in flat)
        lines.append(f"| {rate} | {cell(ratio(hop, flat, 'compress_ms'), '.2f')} | "
                     f"{cell(ratio(hop, flat, 'ef_mib'), '.2f')} | "
                     f"{cell(ratio(hop, flat, 'link_bytes_per_iter'), '.2f')} | "
                     f"{cell(ratio(hop, dense, 'iter_ms'), '.2f')} | "
                     f"{cell(diff(hop, flat), '+.4f')} | {cell(diff(hop, dense), '+.4f')} | "
                     f"{spread:.4f} |")
    return "\n".join(lines) + "\n\n<!-- notes -->\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 repetition, 30 iterations")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--rates", nargs="+", default=RATES)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "slow_hop"))
    p.add_argument("--report-only", action="store_true",
                   help="re-measure the recorded runs (metrics files, veth bytes in "
                        "results.json) and rewrite the section")
    args = p.parse_args()
    iters = args.iters or (30 if args.quick else 100)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.report_only:
        results = remeasure(args.out, args.rates, iters)
        repeats = len(next(v for k, v in results.items() if k != "check"))
    else:
        try:
            results = run_all(args.rates, iters, repeats, args.out)
        except NetnsUnavailable as exc:
            print(f"error: the two-level cluster needs network namespaces ({exc})",
                  file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    body = report(results, args.rates, iters, repeats)
    print(body)
    write_section("slow_hop", "EDGC on the slow hop: a two-level cluster (issue 35)",
                  "sudo .venv/bin/python bench/slow_hop.py" + (" --quick" if args.quick else ""),
                  body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
