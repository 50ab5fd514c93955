#!/usr/bin/env python
"""Metrics JSONL → PNG plots: loss (train and validation) against iterations and against
training time, entropy and rank per stage.

    python scripts/plot_run.py runs/demo/dense.jsonl runs/demo/edgc.jsonl --out runs/demo/plots

With several files, the loss panels overlay them (e.g. dense vs EDGC). The first file is the
reference: drawn dashed and last, so that where the runs coincide (before EDGC's warm-up
ends, every run is dense) both stay visible. ``loss_time.png`` puts the loss against the
training time: the cumulative ``iter_ms`` of the records (the training steps; evaluations
are outside ``iter_ms`` and take the same time in every run), and marks when each run's
validation loss first reaches the highest of the runs' final validation losses
(:func:`time_to_loss`). The entropy and rank panels show every file that has them, one line
per pipeline stage.
"""

import argparse
import json
import os
import sys


def read(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def elapsed_s(records, extra_ms=None) -> list:
    """Training seconds at the end of each record's iteration: the cumulative ``iter_ms``,
    plus ``extra_ms(record)`` per record where given (e.g. a modelled link time)."""
    total, out = 0.0, []
    for r in records:
        total += r["iter_ms"] + (extra_ms(r) if extra_ms is not None else 0.0)
        out.append(total / 1e3)
    return out


def evaluations(records, extra_ms=None) -> list:
    """``(training seconds, iteration, val_loss)`` of each evaluation, in order."""
    return [(t, r["iteration"], r["val_loss"])
            for t, r in zip(elapsed_s(records, extra_ms), records) if "val_loss" in r]


def time_to_loss(records, target: float, extra_ms=None):
    """Training seconds at which the validation loss first reaches ``target``: between the
    first evaluation at or below it and the evaluation before, linearly interpolated in
    (seconds, loss); the first evaluation's own time when that one is already at or below.
    None if no evaluation reaches it."""
    prev = None
    for t, _, loss in evaluations(records, extra_ms):
        if loss <= target:
            if prev is None:
                return t
            t0, l0 = prev
            return t0 + (t - t0) * (l0 - target) / (l0 - loss)
        prev = (t, loss)
    return None


def common_target(runs: dict):
    """The highest of the runs' final validation losses (None if a run has none): the loss
    every run reaches."""
    finals = [next((r["val_loss"] for r in reversed(recs) if "val_loss" in r), None)
              for recs in runs.values()]
    return None if not finals or None in finals else max(finals)


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


def _styles(names: list) -> dict:
    """Per run: colour, line style, marker, z-order. The first run (the reference) is
    dashed with open markers and drawn on top; the others solid with filled markers."""
    out = {}
    for i, name in enumerate(names):
        reference = i == 0 and len(names) > 1
        out[name] = {"color": f"C{i}", "ls": "--" if reference else "-",
                     "marker": "o" if reference else "s",
                     "mfc": "white" if reference else f"C{i}",
                     "z": 3 if reference else 2}
    return out


def _loss_panel(ax, runs: dict, styles: dict, xs_of, train: bool = True) -> None:
    """Train (unless ``train`` is false) and validation loss of every run, the reference
    last (on top)."""
    for name in reversed(list(runs)):
        recs, st = runs[name], styles[name]
        xs = xs_of(name)
        if train:
            ax.plot(xs, [r["loss"] for r in recs], color=st["color"], ls=st["ls"], lw=1,
                    alpha=0.55, zorder=st["z"], label=f"{name} train")
        val = [(x, r["val_loss"]) for x, r in zip(xs, recs) if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), color=st["color"], ls=st["ls"], lw=2, marker=st["marker"],
                    mfc=st["mfc"], ms=6, zorder=st["z"] + 2, label=f"{name} validation")


def plot(paths, out_dir, extra_ms=None, time_label=None):
    """Write the PNGs; returns their paths. ``extra_ms(record)`` is added to each
    iteration's time on the time axis (the demo's modelled link), ``time_label`` names
    that axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    runs = {os.path.splitext(os.path.basename(p))[0]: read(p) for p in paths}
    styles = _styles(list(runs))
    written = []

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    _loss_panel(ax, runs, styles, lambda n: [r["iteration"] for r in runs[n]])
    ax.set_xlabel("iteration"), ax.set_ylabel("loss (nats)"), ax.legend(), ax.grid(alpha=0.3)
    ax.set_title("Loss")
    save(fig, "loss.png")

    if all(all("iter_ms" in r for r in recs) for recs in runs.values()):
        seconds = {name: elapsed_s(recs, extra_ms) for name, recs in runs.items()}
        fig, (full, tail) = plt.subplots(1, 2, figsize=(12, 4.5),
                                         gridspec_kw={"width_ratios": [1, 1]})
        target = common_target(runs) if len(runs) > 1 else None
        for ax in (full, tail):
            _loss_panel(ax, runs, styles, lambda n: seconds[n], train=ax is full)
            if target is not None:
                ax.axhline(target, color="grey", ls=":", lw=1, zorder=1)
                for name, recs in runs.items():
                    t = time_to_loss(recs, target, extra_ms)
                    if t is not None:
                        ax.axvline(t, color=styles[name]["color"], ls=styles[name]["ls"],
                                   lw=1, alpha=0.8, zorder=1)
            ax.set_xlabel(time_label or "training seconds (sum of ms/iter, evaluations "
                                        "excluded)")
            ax.set_ylabel("loss (nats)"), ax.grid(alpha=0.3)
        full.set_title("Loss against training time")
        full.legend()
        # The end of the runs, where they differ: validation only, its lower half.
        vals = [r["val_loss"] for recs in runs.values() for r in recs if "val_loss" in r]
        if len(vals) > 1:
            lo, hi = min(vals), sorted(vals)[len(vals) // 2]
            pad = 0.15 * max(hi - lo, 1e-3)
            tail.set_ylim(lo - pad, hi + pad)
            first = min((t for name, recs in runs.items()
                         for t, r in zip(seconds[name], recs)
                         if "val_loss" in r and r["val_loss"] <= hi), default=None)
            if first is not None:
                tail.set_xlim(left=first * 0.95)
        title = "Validation loss, the end enlarged"
        if target is not None:
            reached = [f"{name} {t:.0f} s" for name, recs in runs.items()
                       for t in [time_to_loss(recs, target, extra_ms)] if t is not None]
            title += f"\n{target:.4f} (the higher final) reached at " + ", ".join(reached)
        tail.set_title(title, fontsize=10)
        tail.legend()
        save(fig, "loss_time.png")

    for key, ylabel, fname, title in [
            ("entropy", "entropy (nats)", "entropy.png", "Sampled gradient entropy per stage"),
            ("rank_dp", "PowerSGD rank (DP sync)", "rank.png", "Rank in force per stage")]:
        series = {name: per_stage(recs, key) for name, recs in runs.items()}
        if not any(series.values()):
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, stages in series.items():
            for s, (xs, ys) in stages.items():
                ax.step(xs, ys, where="post", label=f"{name} stage {s}") if key == "rank_dp" \
                    else ax.plot(xs, ys, "-", marker=".", label=f"{name} stage {s}")
            warm = [r["warmup_end_iter"] for r in runs[name] if "warmup_end_iter" in r]
            if warm:
                ax.axvline(warm[0], color="grey", ls="--", lw=1)
                ax.text(warm[0], ax.get_ylim()[1], " warm-up end", va="top", fontsize=8)
        ax.set_xlabel("iteration"), ax.set_ylabel(ylabel), ax.legend(), ax.grid(alpha=0.3)
        ax.set_title(title)
        save(fig, fname)
    return written


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
