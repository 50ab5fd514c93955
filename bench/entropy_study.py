#!/usr/bin/env python
"""The entropy question (the paper's first experiment): does gradient entropy fall while a
GPT trains, when, and why (not)?

    python bench/entropy_study.py [--report-only]

Trains the tiny default (TP1·PP2·DP1, dense DP sync: EDGC's warm-up never ends — no ε
reached, its cap beyond the run — so the sampler runs on every 10th iteration without
ever compressing; the report refuses a run that compressed) with ``--edgc-grad-stats``:
per stage the sampled Gaussian entropy, the skewness and excess kurtosis of the sampled
gradient, the entropy per layer type (attention, MLP, embedding, norms), and the global
gradient norm every iteration. Checkpoints every 250 iterations and resumes from them, so
a long run can be continued across sessions. Then plots it and writes the BENCHMARKS.md
section with the numbers the paragraph there quotes.
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

OUT = os.path.join(ROOT, "runs", "bench", "entropy_study")
RESULTS = os.path.join(ROOT, "bench", "results", "entropy_study")
ITERS = 5000
METRICS = os.path.join(OUT, f"tiny-pp2-{ITERS}.jsonl")


def train(iters: int) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"),
           "--pipeline-model-parallel-size", "2", "--data-parallel-size", "1",
           "--train-iters", str(iters), "--lr-warmup-iters", "40",
           "--eval-interval", "250", "--log-interval", "250",
           "--edgc-mode", "edgc", "--edgc-window", "100", "--edgc-iter-sample-rate", "0.1",
           "--edgc-warmup-eps", "1e-9", "--edgc-warmup-max-iters", str(iters + 1),
           "--edgc-grad-stats",
           "--save", os.path.join(OUT, "ckpt"), "--load", os.path.join(OUT, "ckpt"),
           "--save-interval", "250", "--metrics-file", METRICS]
    os.makedirs(OUT, exist_ok=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def load() -> list:
    with open(METRICS) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    compressed = [r["iteration"] for r in records if any(x is not None for x in r["rank_dp"])]
    if compressed:  # the study is of dense training: the warm-up must never end
        raise SystemExit(f"{METRICS}: compressed from iteration {compressed[0]}; not a dense "
                         f"run (delete {OUT} and rerun)")
    return records


def window_means(records, key_fn, width=250):
    """(iteration mid-point, mean) of ``key_fn(record)`` over blocks of ``width`` iterations."""
    blocks: dict = {}
    for r in records:
        v = key_fn(r)
        if v is not None and math.isfinite(v):
            blocks.setdefault((r["iteration"] - 1) // width, []).append(v)
    return [((b + 0.5) * width, float(numpy.mean(v))) for b, v in sorted(blocks.items())]


def plot(records, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in records if "entropy" in r]
    its = [r["iteration"] for r in measured]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    for s in range(len(measured[0]["entropy"])):
        ax.plot(its, [r["entropy"][s] for r in measured], ".", ms=2, label=f"stage {s}")
        ax.plot(*zip(*window_means(measured, lambda r, s=s: r["entropy"][s])), "o-", ms=3)
    ax.set_title("sampled Gaussian entropy per stage (nats)")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    for name in measured[0]["entropy_by_type"]:
        for s in range(len(measured[0]["entropy"])):
            pts = window_means(measured, lambda r, s=s, n=name: r["entropy_by_type"][n][s])
            if pts:
                ax.plot(*zip(*pts), "-", label=f"{name} (stage {s})")
    ax.set_title("entropy per layer type (250-iteration means)")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    ax.plot(*zip(*window_means(records, lambda r: math.log(r["grad_norm"]))), "o-", ms=3,
            label="ln global grad norm (post-sync)")
    val = [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r]
    ax.plot(*zip(*window_means(records, lambda r: r["loss"])), "o-", ms=3, label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="val loss")
    ax.set_title("loss and gradient norm")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    for s in range(len(measured[0]["entropy"])):
        ax.plot(*zip(*window_means(measured, lambda r, s=s: r["grad_kurt"][s])), "o-", ms=3,
                label=f"excess kurtosis, stage {s}")
    ax.set_yscale("log")
    ax.set_title("excess kurtosis of the sampled gradient (Gaussian: 0)")
    ax.legend(fontsize=8)
    for a in axes.flat:
        a.set_xlabel("iteration")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(records) -> dict:
    measured = [r for r in records if "entropy" in r]
    stages = len(measured[0]["entropy"])
    blocks = {s: window_means(measured, lambda r, s=s: r["entropy"][s]) for s in range(stages)}
    facts = {"iterations": records[-1]["iteration"], "stages": {}}
    for s in range(stages):
        pts = blocks[s]
        lowest = min(pts, key=lambda p: p[1])
        facts["stages"][s] = {
            "first": pts[0][1], "lowest": lowest[1], "lowest_at": lowest[0], "last": pts[-1][1],
            "kurtosis_median": float(numpy.median([r["grad_kurt"][s] for r in measured])),
            "skew_median": float(numpy.median([r["grad_skew"][s] for r in measured])),
            "by_type_first_last": {
                name: [f(window_means(measured, lambda r, s=s, n=name: r["entropy_by_type"][n][s]))
                       for f in (lambda p: p[0][1] if p else float("nan"),
                                 lambda p: p[-1][1] if p else float("nan"))]
                for name in measured[0]["entropy_by_type"]}}
    # How much of the entropy is the log of the gradient's scale: correlate the stage-0
    # entropy with the log of the (post-sync, global) gradient norm on measured iterations.
    h = numpy.array([r["entropy"][0] for r in measured])
    g = numpy.log([r["grad_norm"] for r in measured])
    facts["corr_entropy_log_gradnorm"] = float(numpy.corrcoef(h, g)[0, 1])
    val = [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r]
    facts["val_loss"] = val
    best = min(val, key=lambda v: v[1]) if val else None
    facts["best_val"] = best
    return facts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    if not args.report_only:
        train(ITERS)
    records = load()
    os.makedirs(RESULTS, exist_ok=True)
    plot(records, os.path.join(RESULTS, "entropy.png"))
    facts = report(records)
    with open(os.path.join(RESULTS, "facts.json"), "w") as fh:
        json.dump(facts, fh, indent=1)
    rows = ["| stage | entropy, first 250 it. | lowest (at it.) | last 250 it. | median skew "
            "| median excess kurtosis |", "|---|---|---|---|---|---|"]
    for s, f in facts["stages"].items():
        rows.append(f"| {s} | {f['first']:.3f} | {f['lowest']:.3f} ({f['lowest_at']:.0f}) | "
                    f"{f['last']:.3f} | {f['skew_median']:.2f} | {f['kurtosis_median']:.0f} |")
    types = ["| stage | layer type | entropy, first 250 it. | last 250 it. |", "|---|---|---|---|"]
    for s, f in facts["stages"].items():
        for name, (a, b) in f["by_type_first_last"].items():
            types.append(f"| {s} | {name} | {a:.3f} | {b:.3f} |")
    val = ", ".join(f"{it}: {v:.3f}" for it, v in facts["val_loss"])
    body = (f"Tiny default, TP1·PP2·DP1, dense, {facts['iterations']} iterations "
            f"(cosine LR 1e-3 → 1e-4 over the run), entropy sampled on every 10th iteration "
            f"(β = 0.25).\n\n" + "\n".join(rows) + "\n\n" + "\n".join(types) +
            f"\n\nCorrelation of stage 0's sampled entropy with ln(global gradient norm) on the "
            f"measured iterations: {facts['corr_entropy_log_gradnorm']:.3f}. Validation loss: "
            f"{val}.\n\n![entropy study](bench/results/entropy_study/entropy.png)\n\n"
            "<!-- notes -->")
    write_section("entropy_study", "The entropy question: does gradient entropy fall?",
                  "python bench/entropy_study.py", body)
    print(json.dumps(facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
