#!/usr/bin/env python
"""The loss–bytes plane: dense, static PowerSGD ranks, the paper's EDGC and the budget
controller, side by side on the same data, seeds and iterations.

    python bench/pareto.py [--testbed tiny-dp4 tiny-pp2 small-dp4] [--seeds 3] [--report-only]

Per testbed every run trains from scratch with the same dense warm-up (static runs start
compressing at ``--edgc-start-iter`` = the iteration where EDGC's capped warm-up ends), and
reports the final validation loss and the DP bytes per iteration *after* warm-up, summed
from the per-iteration metrics (``dp_bytes_sent_job``). Dense and two static points run on
``--seeds`` seeds (data order and init). A seed moves every run of it together (its own
data order and init: ~0.09 in val loss between two seeds here), so every claim is a
*paired* difference (same seed) made against the seed-to-seed spread of such differences. Finished runs are reused: their metrics files
under ``runs/bench/pareto/TESTBED/``, or their committed records under
``bench/results/pareto/runs/`` (a sweep continues across sessions); delete both to rerun.

Writes ``bench/results/pareto/summary.json`` (one entry per run, computed from the metrics
files), a plot per testbed and the BENCHMARKS.md section, after every run it trains. From a
fresh clone ``--report-only`` rebuilds them from the committed records in seconds; without
it the planned runs not yet recorded train first (it lists them; about 6 min a tiny run
and 20 min a small-dp4 run on 2 cores).
"""

import argparse
import json
import math
import os
import subprocess
import sys

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.report import write_section  # noqa: E402

RUNS = os.path.join(ROOT, "runs", "bench", "pareto")
RESULTS = os.path.join(ROOT, "bench", "results", "pareto")
SEED0 = 1234

#: The EDGC window machinery of every testbed (the issue's setup: window 40, α 0.25,
#: r_min 1, s 2, warm-up capped at 100 iterations, so compression starts at 120).
EDGC_FLAGS = ["--edgc-mode", "edgc", "--edgc-window", "40", "--edgc-iter-sample-rate", "0.25",
              "--edgc-rank-min", "1", "--edgc-rank-step", "2", "--edgc-warmup-max-iters", "100"]
WARMUP_END = 120

TESTBEDS = {
    # (a) the tiny default on 4 DP replicas, 800 iterations (about half an epoch of the corpus)
    "tiny-dp4": dict(flags=["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4"],
                     iters=800, r_max=8, static=[1, 2, 4, 8, 16], seeded_static=[8, 4]),
    # (c) the tiny default's own layout, TP1·PP2·DP2: per-stage ranks show
    "tiny-pp2": dict(flags=[], iters=800, r_max=8, static=[1, 2, 4, 8, 16], seeded_static=[8, 4]),
    # The entropy question's regime test: the only phase in which the sampled entropy
    # falls on (a) is iterations ~1-80 (BENCHMARKS.md, the entropy study). The paper's
    # EDGC with its warm-up capped at 20 and 20-iteration windows decides there: does it
    # lower the rank, and at what loss against dense? Dense and the paper's EDGC only.
    "tiny-dp4-early": dict(flags=["--pipeline-model-parallel-size", "1",
                                  "--data-parallel-size", "4"],
                           iters=800, r_max=8, static=[8], seeded_static=[8, 4],
                           edgc=["--edgc-mode", "edgc", "--edgc-window", "20",
                                 "--edgc-iter-sample-rate", "0.25", "--edgc-rank-min", "1",
                                 "--edgc-rank-step", "2", "--edgc-warmup-max-iters", "20"],
                           only=("dense", "paper")),
    # MoE: the tiny default with 4 experts per layer (top-2, alltoall), EP 2 on DP 4: dense
    # buckets over DP 4, experts over expert-DP 2 (the dense/expert bytes split in JSONL)
    "tiny-moe-dp4": dict(flags=["--pipeline-model-parallel-size", "1",
                                "--data-parallel-size", "4", "--num-experts", "4",
                                "--expert-model-parallel-size", "2"],
                         iters=800, r_max=8, static=[8], seeded_static=[8, 4],
                         only=("dense", "paper")),
    # (b) configs/gpt2-small-cpu.yaml (6 layers, hidden 256) on 4 DP replicas
    "small-dp4": dict(flags=["--config", "configs/gpt2-small-cpu.yaml",
                             "--pipeline-model-parallel-size", "1", "--data-parallel-size", "4"],
                      iters=800, r_max=16, static=[2, 4, 8, 16, 32], seeded_static=[16, 8]),
}


def plan(testbed: str, seeds: int) -> list:
    """(name, controller, seed, flags) of every run of a testbed, most informative first:
    the seed-0 core (dense, r_max, the adaptive controllers, the seeded static point), then
    the other seeds of dense, the two seeded static points and budget50, then the rest of
    the static curve and the other budget variants, so a cut-short sweep still gives a
    verdict."""
    tb = TESTBEDS[testbed]
    r_max = tb["r_max"]
    # The plane's runs send fp32 factors (recorded before bf16 became the default); the
    # bf16 runs below say so explicitly.
    static = ["--edgc-mode", "static", "--edgc-start-iter", str(WARMUP_END),
              "--edgc-factor-dtype", "fp32"]
    edgc = tb.get("edgc", EDGC_FLAGS) + ["--edgc-rank-max", str(r_max),
                                         "--edgc-factor-dtype", "fp32"]
    budget50 = edgc + ["--edgc-controller", "budget", "--edgc-time-budget", "0.5"]
    budget50_lr = budget50 + ["--edgc-budget-schedule", "lr"]
    seeded = tb["seeded_static"]

    def static_run(r, seed):
        return (f"static-r{r}", "static", seed, static + ["--edgc-rank", str(r)])

    runs = [("dense", "dense", SEED0, []), static_run(seeded[0], SEED0),
            ("budget50", "budget", SEED0, budget50),
            ("budget50-lr", "budget", SEED0, budget50_lr),
            static_run(seeded[1], SEED0), ("paper", "paper", SEED0, edgc)]
    for seed in range(SEED0 + 1, SEED0 + seeds):
        runs += [("dense", "dense", seed, []), *(static_run(r, seed) for r in seeded),
                 ("budget50", "budget", seed, budget50)]
    runs += [static_run(r, SEED0) for r in tb["static"] if r not in seeded]
    runs.append((f"budget25-rmax{2 * r_max}", "budget", SEED0,
                 EDGC_FLAGS + ["--edgc-rank-max", str(2 * r_max), "--edgc-controller", "budget",
                               "--edgc-time-budget", "0.25"]))
    runs += [("budget50-lr", "budget", seed, budget50_lr)
             for seed in range(SEED0 + 1, SEED0 + seeds)]
    # budget25-rmax16 thrashed (shape ranks jumping 1 <-> 16 between windows): the same
    # budget50-lr with each shape's rank change limited to --edgc-rank-step per window
    runs += [("budget50-lr-step", "budget", seed,
              budget50_lr + ["--edgc-budget-step-limit", "on"])
             for seed in range(SEED0, SEED0 + seeds)]
    # the same stepped, LR-scheduled budget with errors weighed as Adam's update sees them
    runs.append(("budget50-lr-step-adam", "budget", SEED0,
                 budget50_lr + ["--edgc-budget-step-limit", "on",
                                "--edgc-budget-weight", "adam"]))
    # issues 15, 26: P and Q in bf16 at r_max (half the factor bytes): free on this plane?
    # Seeded as static r_max is, so each seed pairs with its fp32 run.
    runs += [(f"static-r{r_max}-bf16", "static-bf16", seed,
              static + ["--edgc-rank", str(r_max), "--edgc-factor-dtype", "bf16"])
             for seed in range(SEED0, SEED0 + seeds)]
    # issue 33: the step's batched CholeskyQR and in-place error feedback, with the flags
    # of static r_max (fp32 factors), paired with static r_max recorded with the old step
    # (torch.linalg.qr, stacked copy of the gradients) of the same seed
    runs += [(f"static-r{r_max}-issue33", "static-issue33", seed,
              static + ["--edgc-rank", str(r_max)])
             for seed in range(SEED0, SEED0 + seeds)]
    # issue 33: the error-feedback residual in bf16 (half that state), paired likewise
    runs += [(f"static-r{r_max}-ef-bf16", "static-ef-bf16", seed,
              static + ["--edgc-rank", str(r_max), "--edgc-ef-dtype", "bf16"])
             for seed in range(SEED0, SEED0 + seeds)]
    # Target A's byte limit (60 % of r_max's) spent with twice r_max allowed, stepped and
    # LR-scheduled: room for the shapes whose error curve still pays above r_max
    runs.append((f"budget30-rmax{2 * r_max}-lr-step", "budget", SEED0,
                 EDGC_FLAGS + ["--edgc-rank-max", str(2 * r_max), "--edgc-controller", "budget",
                               "--edgc-time-budget", "0.3", "--edgc-budget-schedule", "lr",
                               "--edgc-budget-step-limit", "on"]))
    if "only" in tb:
        runs = [r for r in runs if r[0] in tb["only"] and r[2] == SEED0]
    return runs


def run_one(testbed: str, name: str, seed: int, flags: list) -> str:
    """Train one run unless its metrics exist; returns the metrics path."""
    tb = TESTBEDS[testbed]
    metrics = metrics_path(testbed, name, seed)
    os.makedirs(os.path.dirname(metrics), exist_ok=True)
    if is_recorded(testbed, name, seed):
        return metrics
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"), *tb["flags"],
           "--train-iters", str(tb["iters"]), "--lr-warmup-iters", "40",
           "--eval-interval", "200", "--log-interval", "100", "--seed", str(seed),
           "--metrics-file", metrics, *flags]
    print(f"=== {testbed} {name} seed {seed}", flush=True)
    with open(os.path.splitext(metrics)[0] + ".log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    return metrics


def run_record_path(testbed: str, name: str, seed: int) -> str:
    return os.path.join(RESULTS, "runs", testbed, f"{name}-s{seed}.json")


def summarize_run(testbed: str, name: str, controller: str, seed: int, metrics: str) -> dict:
    """One summary.json entry, from the run's metrics files only (also written, with the
    run's loss curves, to ``bench/results/pareto/runs/``: the committed record of a run,
    so a sweep continues in a later session on another machine without retraining it)."""
    record_path = run_record_path(testbed, name, seed)
    if not os.path.exists(summary_path(metrics)) and os.path.exists(record_path):  # a stopped run's partial file
        # must not shadow the committed record of that run
        with open(record_path) as fh:
            return json.load(fh)["entry"]
    with open(metrics) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    with open(summary_path(metrics)) as fh:
        summary = json.load(fh)
    warmup_end = next((r["warmup_end_iter"] for r in reversed(records)
                       if r.get("warmup_end_iter") is not None), None)
    if warmup_end is None:  # dense and static: the shared dense phase
        warmup_end = WARMUP_END
    after = [r for r in records if r["iteration"] > warmup_end]
    ranks = [numpy.mean([x for x in r["rank_dp"] if x is not None]) for r in after
             if r.get("rank_dp") and any(x is not None for x in r["rank_dp"])]
    entry = {"testbed": testbed, "name": name, "controller": controller, "seed": seed,
             "val_loss": summary["val_loss"],
             "dp_bytes_sent": int(sum(r["dp_bytes_sent_job"] for r in after)),
             "dp_bytes_dense": int(sum(r["dp_bytes_dense_job"] for r in after)),
             "warmup_end_iter": warmup_end, "iterations_after_warmup": len(after),
             "mean_rank_after_warmup": float(numpy.mean(ranks)) if ranks else None}
    os.makedirs(os.path.dirname(record_path), exist_ok=True)
    with open(record_path, "w") as fh:
        json.dump({"entry": entry,
                   "val_loss": [[r["iteration"], r["val_loss"]] for r in records
                                if r.get("val_loss") is not None],
                   "train_loss_per_100": [[r["iteration"], round(float(numpy.mean(
                       [x["loss"] for x in records[max(0, i - 99):i + 1]])), 5)]
                       for i, r in enumerate(records) if r["iteration"] % 100 == 0],
                   "rank_dp_shapes": {str(r["iteration"]): r["rank_dp_shapes"]
                                      for r in records if r.get("rank_dp_shapes")
                                      and (r["iteration"] - 1) % 40 == 0}}, fh)
    return entry


def aggregate(entries: list) -> dict:
    """name -> per-seed val losses and bytes/iteration, their means, and the paired
    differences against static r_max of the same seed (filled by :func:`pair`)."""
    by_name: dict = {}
    for e in entries:
        by_name.setdefault(e["name"], []).append(e)
    out = {}
    for name, rows in by_name.items():
        losses = [r["val_loss"] for r in rows]
        out[name] = {
            "controller": rows[0]["controller"], "n": len(rows),
            "by_seed": {r["seed"]: r["val_loss"] for r in rows},
            "bytes_by_seed": {r["seed"]: r["dp_bytes_sent"] / r["iterations_after_warmup"]
                              for r in rows},
            "val_loss": float(numpy.mean(losses)),
            "std": float(numpy.std(losses, ddof=1)) if len(rows) > 1 else None,
            "bytes_per_iter": float(numpy.mean([r["dp_bytes_sent"] / r["iterations_after_warmup"]
                                                for r in rows])),
            "dense_per_iter": float(numpy.mean([r["dp_bytes_dense"] / r["iterations_after_warmup"]
                                                for r in rows])),
            "rank": rows[0]["mean_rank_after_warmup"],
            "seed0_loss": next((r["val_loss"] for r in rows if r["seed"] == SEED0), None)}
    return out


def static_curve_at(agg: dict, bytes_per_iter: float, seed: int):
    """The static Pareto curve of one seed at a byte count (linear in log bytes), or None
    outside the static points that seed has."""
    pts = sorted((v["bytes_by_seed"][seed], v["by_seed"][seed]) for v in agg.values()
                 if v["controller"] == "static" and seed in v["by_seed"])
    if len(pts) < 2 or not pts[0][0] <= bytes_per_iter <= pts[-1][0]:
        return None
    xs = [math.log(x) for x, _ in pts]
    return float(numpy.interp(math.log(bytes_per_iter), xs, [y for _, y in pts]))


def paired(agg: dict, name: str, ref: str) -> list:
    """``val_loss(name) - val_loss(ref)`` for every seed both have (same data order and
    init: the seed's own offset, common to every run of it, cancels)."""
    a, b = agg[name]["by_seed"], agg[ref]["by_seed"]
    return [a[s] - b[s] for s in sorted(a) if s in b]


def paired_spread(agg: dict, r_max: int):
    """The noise of a paired difference: the pooled seed-to-seed std of the differences
    of the multi-seed runs against static r_max (None with fewer than 2 seeds)."""
    ref = f"static-r{r_max}"
    if ref not in agg:
        return None
    stds = [float(numpy.std(d, ddof=1)) for name in agg if name != ref
            for d in [paired(agg, name, ref)] if len(d) > 1]
    return float(numpy.sqrt(numpy.mean(numpy.square(stds)))) if stds else None


def verdicts(testbed: str, agg: dict) -> tuple:
    """The issue's targets against static r_max and the static curve, as paired (same
    seed) differences, against the paired spread."""
    r_max = TESTBEDS[testbed]["r_max"]
    ref = agg.get(f"static-r{r_max}")
    spread = paired_spread(agg, r_max)
    lines = []
    if ref is None or spread is None:
        return spread, ["static r_max or the seeded runs are missing: no verdict yet"]
    for name, v in agg.items():
        if v["controller"] not in ("paper", "budget"):
            continue
        ratio = v["bytes_per_iter"] / ref["bytes_per_iter"]
        d_ref = paired(agg, name, f"static-r{r_max}")
        d_curve = [v["by_seed"][s] - c for s in sorted(v["by_seed"])
                   for c in [static_curve_at(agg, v["bytes_by_seed"][s], s)] if c is not None]
        m_ref = float(numpy.mean(d_ref)) if d_ref else None
        m_curve = float(numpy.mean(d_curve)) if d_curve else None
        a = m_ref is not None and ratio <= 0.6 and m_ref <= spread
        b = m_curve is not None and m_curve < -2 * spread

        def fmt(d, m):
            return "—" if m is None else f"{m:+.4f} (seeds: {', '.join(f'{x:+.4f}' for x in d)})"
        lines.append(f"| {name} (n={v['n']}) | {ratio:.2f} | {fmt(d_ref, m_ref)} | "
                     f"{fmt(d_curve, m_curve)} | {'met' if a else 'not met'} | "
                     f"{'met' if b else 'not met'} |")
    return spread, lines


def plot(testbed: str, agg: dict, path: str) -> None:
    """Seed-0 runs (every run has it); error bars: the paired spread, the noise of a
    comparison between two runs of one seed (seeds move every run together)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spread = paired_spread(agg, TESTBEDS[testbed]["r_max"]) or 0.0
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mib = 2 ** 20
    static = sorted(((v["bytes_by_seed"][SEED0], v["by_seed"][SEED0], k)
                     for k, v in agg.items()
                     if v["controller"] == "static" and SEED0 in v["by_seed"]))
    if static:
        ax.errorbar([b / mib for b, _, _ in static], [y for _, y, _ in static],
                    yerr=spread, fmt="o-", color="tab:blue", capsize=3,
                    label="static PowerSGD (Pareto curve)")
    for b, y, k in static:
        ax.annotate(k.replace("static-", ""), (b / mib, y), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    styles = {"dense": ("s", "black"), "paper": ("^", "tab:red"), "budget": ("*", "tab:green"),
              "static-bf16": ("D", "tab:cyan"), "static-issue33": ("P", "tab:olive"),
              "static-ef-bf16": ("X", "tab:purple")}
    for k, v in agg.items():
        if v["controller"] == "static" or SEED0 not in v["by_seed"]:
            continue
        marker, color = styles[v["controller"]]
        if v["controller"] == "budget":  # one colour per budget variant
            budgets = sorted(n for n, w in agg.items() if w["controller"] == "budget")
            color = ("tab:green", "tab:olive", "tab:purple", "tab:orange", "tab:brown",
                     "tab:pink")[budgets.index(k) % 6]
        ax.errorbar([v["bytes_by_seed"][SEED0] / mib], [v["by_seed"][SEED0]], yerr=spread,
                    fmt=marker, color=color, markersize=11 if marker == "*" else 8, capsize=3,
                    label=k)
    ax.set_xscale("log")
    ax.set_xlabel("DP MiB per iteration after warm-up (whole job, log)")
    ax.set_ylabel(f"final validation loss (seed {SEED0})")
    ax.set_title(f"{testbed}: loss against bytes (error bars: paired spread "
                 f"{spread:.4f})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(testbeds: list, entries: list) -> None:
    parts = []
    for testbed in testbeds:
        rows = [e for e in entries if e["testbed"] == testbed]
        if not rows:
            parts.append(f"### {testbed}\n\nNot run yet.")
            continue
        tb = TESTBEDS[testbed]
        agg = aggregate(rows)
        png = os.path.join(RESULTS, f"{testbed}.png")
        plot(testbed, agg, png)
        dense = agg.get("dense")
        ref = agg.get(f"static-r{tb['r_max']}")
        lines = ["| run | seeds | final val loss (mean ± std over seeds) | vs dense, same seed "
                 "| vs static r_max, same seed | DP MiB/iter after warm-up | bytes vs static "
                 "r_max | mean rank after warm-up |", "|---|---|---|---|---|---|---|---|"]
        order = sorted(agg.items(), key=lambda kv: -kv[1]["bytes_per_iter"])
        for name, v in order:
            pm = f" ± {v['std']:.4f}" if v["std"] is not None else ""
            vs = "—"
            if dense:
                d = [100 * x / dense["by_seed"][s] for s, x in
                     zip(sorted(s for s in v["by_seed"] if s in dense["by_seed"]),
                         paired(agg, name, "dense"))]
                vs = f"{numpy.mean(d):+.2f} %" if d else "—"
            dr = paired(agg, name, f"static-r{tb['r_max']}") if ref else []
            vr = f"{numpy.mean(dr):+.4f}" + (f" ± {numpy.std(dr, ddof=1):.4f}"
                                             if len(dr) > 1 else "") if dr else "—"
            rb = f"{v['bytes_per_iter'] / ref['bytes_per_iter']:.2f}" if ref else "—"
            rank = "—" if v["rank"] is None else f"{v['rank']:.2f}"
            lines.append(f"| {name} | {v['n']} | {v['val_loss']:.4f}{pm} | {vs} | {vr} | "
                         f"{v['bytes_per_iter'] / 2**20:.3f} | {rb} | {rank} |")
        spread, verdict = verdicts(testbed, agg)
        flags = " ".join(tb["flags"]) or "configs/tiny-cpu.yaml as it is (TP1·PP2·DP2)"
        parts.append(
            f"### {testbed}\n\n`{flags}`, {tb['iters']} iterations, dense until iteration "
            f"{WARMUP_END} in every run.\n\n" + "\n".join(lines) +
            f"\n\nPaired spread (pooled seed-to-seed std of the multi-seed runs' "
            f"differences against static r_max of the same seed; a seed's own offset, "
            f"common to all its runs, cancels): "
            f"{'n/a' if spread is None else format(spread, '.4f')}.\n\n"
            "| adaptive run | bytes / static r_max | Δ val loss vs static r_max (same seed) "
            "| Δ vs the same seed's static curve at equal bytes | target A (≤ 0.60 of the bytes, loss within the "
            "spread) | target B (below the curve by > 2× spread) |\n|---|---|---|---|---|---|\n"
            + ("\n".join(verdict) if verdict and verdict[0].startswith("|") else
               "| — | | | | | |\n\n" + " ".join(verdict)) +
            f"\n\n![{testbed}](bench/results/pareto/{testbed}.png)")
    body = ("Final validation loss against the DP bytes per iteration after warm-up "
            "(`bench/results/pareto/summary.json` holds every run, computed from its metrics "
            "file). Static points are joined as the Pareto curve; EDGC (`paper`) and the budget "
            "controller (`budget50`: r_max, half of its bytes; `budget50-lr`: the same mean "
            "budget following sqrt(LR); `budget50-lr-step`: the same, each shape's rank moving at "
            "most --edgc-rank-step per window; `budget25-rmax…`: twice r_max, a quarter of those "
            "bytes; `budget30-rmax…-lr-step`: twice r_max, 0.3 of its bytes, LR-scheduled and "
            "stepped; `…-adam`: errors weighed by Adam's second moment, "
            "--edgc-budget-weight adam) are marked. The columns against dense and static r_max "
            "pair each run with the same seed; no verdict is drawn from them (most runs have "
            "one seed).\n\n<!-- notes -->\n\n" + "\n\n".join(parts))
    write_section("pareto", "The loss–bytes plane: adaptive against static",
                  "python bench/pareto.py", body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--testbed", nargs="+", default=list(TESTBEDS), choices=list(TESTBEDS))
    p.add_argument("--seeds", type=int, default=3, help="seeds of dense and two static points")
    p.add_argument("--report-only", action="store_true",
                   help="summarize the runs that exist, train nothing")
    p.add_argument("--only", nargs="+", metavar="RUN", default=None,
                   help="train only the planned runs of these names (e.g. static-r8-bf16); "
                        "the report still covers every recorded run")
    args = p.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    todo = [(testbed, *run) for testbed in args.testbed for run in plan(testbed, args.seeds)
            if not is_recorded(testbed, run[0], run[2])
            and (args.only is None or run[0] in args.only)]
    if todo and not args.report_only:
        print(f"{len(todo)} runs to train (the others are reused); the report is rewritten "
              f"after each: {', '.join(f'{t} {n} s{s}' for t, n, _, s, _ in todo)}",
              flush=True)
        for testbed, name, _, seed, flags in todo:
            run_one(testbed, name, seed, flags)
            write_report(args.seeds)
    entries = write_report(args.seeds)
    print(json.dumps(entries, indent=1))
    return 0


def metrics_path(testbed: str, name: str, seed: int) -> str:
    return os.path.join(RUNS, testbed, f"{name}-s{seed}.jsonl")


def summary_path(metrics: str) -> str:
    """The summary a run writes when it finishes."""
    return os.path.splitext(metrics)[0] + ".summary.json"


def is_recorded(testbed: str, name: str, seed: int) -> bool:
    """A run finished here (its summary) or committed (its record)."""
    return os.path.exists(summary_path(metrics_path(testbed, name, seed))) or \
        os.path.exists(run_record_path(testbed, name, seed))


def recorded_entries(seeds: int) -> list:
    """summary.json's entries of every recorded run of every testbed, whatever the command
    line selected: the planned runs finished here or committed, and any committed record
    outside today's plan (another --seeds, a run since removed from it)."""
    import glob

    entries = {}
    for testbed in TESTBEDS:
        for name, controller, seed, _ in plan(testbed, seeds):
            if is_recorded(testbed, name, seed):
                entries[(testbed, name, seed)] = summarize_run(
                    testbed, name, controller, seed, metrics_path(testbed, name, seed))
        for path in sorted(glob.glob(os.path.join(RESULTS, "runs", testbed, "*.json"))):
            with open(path) as fh:
                entry = json.load(fh)["entry"]
            entries.setdefault((entry["testbed"], entry["name"], entry["seed"]), entry)
    return list(entries.values())


def write_report(seeds: int) -> list:
    """summary.json, the plots and the BENCHMARKS.md section from every recorded run of
    every testbed (a sweep of one testbed keeps the others' rows)."""
    entries = recorded_entries(seeds)
    with open(os.path.join(RESULTS, "summary.json"), "w") as fh:
        json.dump(entries, fh, indent=1)
    report(list(TESTBEDS), entries)
    return entries


if __name__ == "__main__":
    sys.exit(main())
