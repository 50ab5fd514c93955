#!/usr/bin/env python
"""The main job on the tiny CPU default: dense (fp32 and bf16 reduce) vs EDGC over a slow
link, side by side.

    python scripts/demo.py [--link 150mbit] [--train-iters N] [extra pretrain flags...]

Compression pays only where the link is slower than the compression math, which loopback
between local processes never is. So, as root, every rank runs in its own network
namespace behind a tbf-shaped veth link at ``--link`` (bench/netns.py): the DP all-reduces
and the pipeline sends really cross a 150 Mbit link. Without root (or with ``--link none``)
the ranks run over loopback, EDGC's bypass is told the link rate (``--edgc-link-gbps``),
and the table adds to each run's measured times the alpha-beta all-reduce time of its
measured DP bytes at that rate, labelled "modelled".

Each run writes ``runs/demo/<name>.jsonl`` (one record per iteration), its summary
``runs/demo/<name>.summary.json`` and TensorBoard events under ``runs/demo/tb/<name>``.
The table ends with the time each run took to reach the higher of the two final
validation losses (training seconds: the sum of the iterations' ms/iter, evaluations
excluded; linear between the two evaluations around it), and the plots
(``runs/demo/plots/``) show the loss against iterations and against those seconds.
"""

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import plot_run  # noqa: E402
from bench.netns import (NetnsUnavailable, ShapedNetwork, alpha_beta_allreduce_s,  # noqa: E402
                         rate_bits)
from megatron_edgc.config import ConfigError, parse_config  # noqa: E402

# name -> extra flags (the EDGC settings are the edgc: section of the config).
# EDGC: entropy-chosen ranks on the DP sync and the pipeline backward sends, with DAC; the
# bypass sends a bucket dense wherever compressing it would not pay on the measured link.
# Its windows are halved against the config's (10 iterations, warm-up at most 40) so that
# two thirds of a 120-iteration run are compressed.
# The precision is the trainer's default on this CPU (issue 91): fp32 without bf16
# instructions (an AMD EPYC Zen 3 ran the tiny config 4-6x slower in bf16), otherwise the
# faster of the two at the model's shapes, timed here once (bf16 on a Zen 4, fp32 on an
# Intel Xeon with AVX512-BF16 and no AMX) and given to all three runs. "dense" reduces
# the gradients in fp32, Megatron-LM's default; "dense-bf16" sends them as bf16, what an
# informed user turns on first (half the bytes, free): in bf16 training Megatron's
# --grad-reduce-in-bf16, in fp32 training the dense sync with a bf16 wire (torch's
# bf16_compress_hook; here EDGC's dense path, compression never started). EDGC runs on the
# same buffers, and its bypass weighs compression against that bf16 dense sync.
EDGC = ["--edgc-mode", "edgc", "--edgc-pp-compression", "edgc", "--edgc-bypass", "auto",
        "--edgc-window", "10", "--edgc-warmup-max-iters", "40"]
RUNS_BY_PRECISION = {
    "bf16": {"dense": [], "dense-bf16": ["--grad-reduce-in-bf16"],
             "edgc": ["--grad-reduce-in-bf16", *EDGC]},
    "fp32": {"dense": [], "dense-bf16": ["--edgc-mode", "static", "--edgc-start-iter",
                                         "1000000000", "--edgc-dense-wire", "bf16"],
             "edgc": EDGC}}
RUNS = RUNS_BY_PRECISION["bf16"]   # the names, the same in both
# Both runs: megatron-core's overlapped DP buckets, as Megatron users train. Each bucket's
# all-reduce (dense) or P (EDGC) starts during backward as soon as the bucket is ready;
# 500k-element buckets give the tiny model 4 of them (the losses do not depend on it).
# 120 iterations at 150 Mbit keep both runs under 5 minutes on 2 cores (3 min 48 s). The
# link is slow enough that the DP sync is most of a dense iteration, so that EDGC's gain
# stands clear of the ~15 % by which the machine's speed drifts between the two runs (at
# 300 Mbit it was -16 % to +1 % over five runs, 2026-11-23/24). At 120 Mbit the gain was
# no larger (0.80x, 0.77x, two runs): the tied-embedding all-reduce between the first and
# the last stage, which EDGC does not compress, grows with it. An evaluation every 10
# iterations (5 batches, ~0.1 s here, outside ms/iter) draws the validation loss against
# time and places the time to loss. Flags given to the demo come later and win.
COMMON = ["--overlap-grad-reduce", "--bucket-size", "500000", "--train-iters", "120",
          "--eval-interval", "10"]


def layout(config: str, extra: list) -> tuple:
    """(world size, DP size, precision note) of the run the flags describe (validated, no
    process started)."""
    cfg = parse_config(["--config", config, *extra])
    p = cfg.parallel
    dp = p.data_parallel_size or 1
    return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * dp, dp, cfg


def train(args, extra: list, world: int, runs: dict) -> int:
    """Both runs, over the emulated link when namespaces can be made; records how in
    ``OUT/link.json``."""
    net = None
    if args.link != "none":
        try:
            net = ShapedNetwork(world, args.link).__enter__()
            how = (f"each of the {world} ranks in its own network namespace behind a "
                   f"tbf-shaped {args.link} veth link (DP all-reduces and pipeline sends "
                   f"cross it)")
        except NetnsUnavailable as exc:
            how = (f"loopback ({exc}); the {args.link} link is modelled: EDGC's bypass is "
                   f"told the rate, and each run's DP all-reduce time at {args.link} "
                   f"(alpha-beta, from its measured bytes) is added to its times")
    else:
        how = "loopback: local processes, where compression cannot pay"
    print(f"link: {how}", flush=True)

    try:
        for i, (name, flags) in enumerate(runs.items()):
            print(f"=== {name} ===", flush=True)
            metrics = os.path.join(args.out, f"{name}.jsonl")
            run_flags = COMMON + list(flags)
            if "--edgc-mode" in flags and net is None and args.link != "none":
                run_flags += ["--edgc-link-gbps", str(rate_bits(args.link) / 1e9)]
            cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"),
                   "--config", args.config, "--metrics-file", metrics,
                   "--tensorboard-dir", os.path.join(args.out, "tb", name), *run_flags, *extra]
            if net is not None:
                codes = net.run(cmd, port=29700 + i, env={"OMP_NUM_THREADS": "1"}, cwd=ROOT)
                code = max(abs(c) for c in codes)
            else:
                code = subprocess.call(cmd, cwd=ROOT)
            if code:
                return code
    finally:
        if net is not None:
            net.close()

    with open(os.path.join(args.out, "link.json"), "w") as fh:
        json.dump({"rate": args.link, "how": how,
                   "modelled": net is None and args.link != "none"}, fh)
    return 0


def time_to_loss_line(records: dict, extra_ms=None, tag: str = "") -> str:
    """One line: when each run's validation loss reached the higher of the runs' final
    validation losses, in training seconds (the sum of ms/iter, plus ``extra_ms(record)``
    per iteration where given; evaluations excluded), linear between the two evaluations
    around it, and the ratio of the last run to each of the others."""
    target = plot_run.common_target(records)
    if target is None:
        return "time to loss: a run has no validation loss"
    times = {name: plot_run.time_to_loss(recs, target, extra_ms)
             for name, recs in records.items()}
    parts = [f"{name} {'—' if t is None else format(t, '.1f') + ' s'}"
             for name, t in times.items()]
    last, t1 = list(times.items())[-1]
    ratio = "".join(f"; {last}/{name} {t1 / t0:.2f}x" for name, t0 in list(times.items())[:-1]
                    if t0 and t1 is not None)
    return (f"time to val loss {target:.4f} (the higher final; training seconds{tag}: sum of "
            f"ms/iter, evaluations excluded; linear between the evaluations around it): "
            f"{', '.join(parts)}{ratio}")


def modelled_link_ms(link: dict, world: int, dp: int):
    """``bytes -> ms``: the modelled DP all-reduce time of a run's DP bytes at the link
    rate, or None where the link is real (or loopback)."""
    if not link["modelled"]:
        return None
    return lambda dp_bytes: alpha_beta_allreduce_s(dp_bytes / world, dp, link["rate"]) * 1e3


def report(out: str, summaries: dict, world: int, dp: int, link: dict) -> None:
    """The side-by-side table: whole run, time to loss, then after EDGC's warm-up (both
    runs)."""
    modelled, how = link["modelled"], link["how"]
    modelled_ms = modelled_link_ms(link, world, dp)

    def link_ms(dp_bytes: float) -> float:
        """The modelled DP all-reduce time of a run's bytes at the link rate (0 if real)."""
        return modelled_ms(dp_bytes) if modelled_ms is not None else 0.0

    print()
    print(f"link: {how}")
    tag = " (modelled)" if modelled else ""
    print(f"{'run':<10} {'ms/iter' + tag:>19} {'DP-sync ms' + tag:>22} {'DP MiB/iter':>11} "
          f"{'PP MiB/iter':>11} {'val loss':>9} {'vs dense':>9}")
    dense_loss = summaries["dense"]["val_loss"]
    for name, s in summaries.items():
        dp_bytes = s.get("dp_bytes_per_iter") or 0.0
        extra_ms = link_ms(dp_bytes)
        sync = s.get("grad_sync_ms")
        sync_txt = "—" if sync is None or math.isnan(sync) else f"{sync + extra_ms:.1f}"
        pp = "dense" if s.get("pp_bytes_per_iter") is None \
            else f"{s['pp_bytes_per_iter'] / 2**20:.3f}"
        print(f"{name:<10} {s['ms_per_iter'] + extra_ms:>19.1f} {sync_txt:>22} "
              f"{dp_bytes / 2**20:>11.2f} {pp:>11} {s['val_loss']:>9.4f} "
              f"{100 * (s['val_loss'] / dense_loss - 1):>+8.2f}%")
    print("(whole-run means per iteration: EDGC's dense warm-up included)")
    records = {name: plot_run.read(os.path.join(out, f"{name}.jsonl")) for name in summaries}
    print(time_to_loss_line(records, None if modelled_ms is None
                            else lambda r: modelled_ms(r["dp_bytes_sent_job"]), tag))
    start = next((r["warmup_end_iter"] for r in reversed(records.get("edgc", []))
                  if r.get("warmup_end_iter") is not None), None)
    if start is not None:
        # The first compressed iteration also measures the link for the bypass (a one-off
        # probe with its own synchronize, like bench/slow_links.py's steady range): shown,
        # then left out of the means, in both runs.
        probe = next(r for r in records["edgc"] if r["iteration"] == start + 1)
        steady_from = start + 2
        print(f"\nafter EDGC's warm-up (iterations {steady_from}-"
              f"{records['edgc'][-1]['iteration']}, both runs; iteration {start + 1}, where "
              f"EDGC's bypass probed the link at start-up, took {probe['iter_ms']:.0f} ms and is "
              f"left out):")
        print(f"{'run':<10} {'ms/iter' + tag:>19} {'DP-sync ms' + tag:>22} {'DP MiB/iter':>11}")
        for name, recs in records.items():
            after = [r for r in recs if r["iteration"] >= steady_from]
            mean = lambda key: sum(r[key] for r in after) / len(after)  # noqa: E731
            dp_bytes = mean("dp_bytes_sent_job")
            extra_ms = link_ms(dp_bytes)
            # per stage: the slowest stage's sync (NaN where a stage has none)
            syncs = [max((x for x in r["grad_sync_ms"] if x is not None and x == x),
                         default=0.0) if isinstance(r["grad_sync_ms"], list)
                     else r["grad_sync_ms"] for r in after if r.get("grad_sync_ms") is not None]
            sync_txt = "—" if not syncs else f"{max(0.0, sum(syncs) / len(syncs)) + extra_ms:.1f}"
            print(f"{name:<10} {mean('iter_ms') + extra_ms:>19.1f} {sync_txt:>22} "
                  f"{dp_bytes / 2**20:>11.2f}")
    edgc_metrics = os.path.join(out, "edgc.jsonl")
    if os.path.exists(edgc_metrics):
        print("\nEDGC rank schedule (first iteration in force: DP rank per pipeline stage "
              "[CQM rank before DAC] | pipeline rank):")
        last = None
        for rec in map(json.loads, open(edgc_metrics)):
            table = (rec.get("rank_dp"), rec.get("rank_cqm"), rec.get("rank_pp"))
            if table != last:
                dp_r, cqm, pp = (" / ".join("dense" if r is None else str(r) for r in t or [])
                                 for t in (table[0], table[1], [table[2]]))
                print(f"  {rec['iteration']:>5}: {dp_r} [{cqm}] | pp {pp}")
                last = table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "demo"))
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny-cpu.yaml"))
    p.add_argument("--report-only", action="store_true",
                   help="print the table and plots of the runs already in --out")
    p.add_argument("--link", default="150mbit",
                   help="link rate of every rank, e.g. 100mbit, 1gbit; 'none': loopback")
    args, extra = p.parse_known_args()
    if args.link != "none":
        try:
            rate_bits(args.link)
        except ValueError as exc:
            p.error(f"--link: {exc}")
    try:
        world, dp, cfg = layout(args.config, extra)
    except (ConfigError, SystemExit) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)

    if not args.report_only:
        if cfg.bf16_by_cpu:
            # timed here once, on a worker's threads, and given to all three runs: one
            # precision for the whole comparison
            import torch

            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
            extra = extra + ["--bf16" if cfg.precision == "bf16" else "--no-bf16"]
        print(cfg.precision_note, flush=True)
        runs = RUNS_BY_PRECISION["bf16" if cfg.precision == "bf16" else "fp32"]
        code = train(args, extra, world, runs)
        if code:
            return code
        with open(os.path.join(args.out, "precision.txt"), "w") as fh:
            fh.write(cfg.precision_note + "\n")
    with open(os.path.join(args.out, "link.json")) as fh:
        link = json.load(fh)
    summaries = {}
    for name in RUNS:
        with open(os.path.join(args.out, f"{name}.summary.json")) as fh:
            summaries[name] = json.load(fh)
    precision = os.path.join(args.out, "precision.txt")
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        if os.path.exists(precision):
            print(open(precision).read().strip())
        report(args.out, summaries, world, dp, link)
    print(table.getvalue(), end="")
    with open(os.path.join(args.out, "report.txt"), "w") as fh:   # the README's block
        fh.write(table.getvalue())

    modelled_ms = modelled_link_ms(link, world, dp)
    try:
        plots = plot_run.plot(
            [os.path.join(args.out, f"{n}.jsonl") for n in RUNS],
            os.path.join(args.out, "plots"),
            extra_ms=None if modelled_ms is None
            else lambda r: modelled_ms(r["dp_bytes_sent_job"]),
            time_label=None if modelled_ms is None
            else f"training seconds (sum of ms/iter + the modelled {link['rate']} DP "
                 f"all-reduce; evaluations excluded)")
    except Exception as exc:  # the table is the result; a plot failure must not hide it
        plots = f"not drawn: {type(exc).__name__}: {exc}"
    print(f"\nplots: {plots}")
    print(f"metrics, summaries and TensorBoard events: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
