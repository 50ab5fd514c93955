#!/usr/bin/env python
"""Metrics JSONL → PNG plots: loss (train and validation), entropy and rank per stage.

    python scripts/plot_run.py runs/demo/edgc.jsonl [more.jsonl ...] --out runs/demo/plots

With several files, the loss panel overlays them (e.g. dense vs EDGC); the entropy and
rank panels show every file that has them, one line per pipeline stage.
"""

import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def per_stage(records, key):
    """{stage: ([iteration], [value])} for list-valued fields, skipping None entries."""
    out = {}
    for r in records:
        values = r.get(key)
        if not isinstance(values, list):
            continue
        for s, v in enumerate(values):
            if v is not None:
                xs, ys = out.setdefault(s, ([], []))
                xs.append(r["iteration"])
                ys.append(v)
    return out


def plot(paths, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    runs = {os.path.splitext(os.path.basename(p))[0]: read(p) for p in paths}
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, recs in runs.items():
        ax.plot([r["iteration"] for r in recs], [r["loss"] for r in recs], label=f"{name} train",
                alpha=0.6)
        val = [(r["iteration"], r["val_loss"]) for r in recs if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o-", label=f"{name} validation")
    ax.set_xlabel("iteration"), ax.set_ylabel("loss (nats)"), ax.legend(), ax.grid(alpha=0.3)
    ax.set_title("Loss")
    written.append(_save(fig, out_dir, "loss.png"))

    for key, ylabel, fname, title in [
            ("entropy", "entropy (nats)", "entropy.png", "Sampled gradient entropy per stage"),
            ("rank_dp", "PowerSGD rank (DP sync)", "rank.png", "Rank in force per stage")]:
        series = {name: per_stage(recs, key) for name, recs in runs.items()}
        if not any(series.values()):
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, stages in series.items():
            for s, (xs, ys) in stages.items():
                style = "-" if key == "entropy" else "-"
                ax.step(xs, ys, where="post", label=f"{name} stage {s}") if key == "rank_dp" \
                    else ax.plot(xs, ys, style, marker=".", label=f"{name} stage {s}")
            warm = [r["warmup_end_iter"] for r in runs[name] if "warmup_end_iter" in r]
            if warm:
                ax.axvline(warm[0], color="grey", ls="--", lw=1)
                ax.text(warm[0], ax.get_ylim()[1], " warm-up end", va="top", fontsize=8)
        ax.set_xlabel("iteration"), ax.set_ylabel(ylabel), ax.legend(), ax.grid(alpha=0.3)
        ax.set_title(title)
        written.append(_save(fig, out_dir, fname))
    return written


def _save(fig, out_dir, name):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("metrics", nargs="+")
    p.add_argument("--out", default=None, help="directory for the PNGs (default: beside the "
                                                "first metrics file, plots/)")
    args = p.parse_args()
    for path in args.metrics:
        if not os.path.isfile(path):
            p.error(f"metrics: {path} does not exist")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics[0])), "plots")
    for path in plot(args.metrics, out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
