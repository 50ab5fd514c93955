#!/usr/bin/env python
"""EDGC on the tiny CPU default: entropy sampling cost and fidelity; EDGC vs dense vs static.

    python bench/edgc_tiny.py [--train-iters 200]

Runs, side by side on configs/tiny-cpu.yaml (same data, seed and iterations): dense,
static PowerSGD at r_max and at r_min, EDGC, and EDGC with the full-gradient entropy
reference (``--edgc-entropy-reference``: the full estimate every iteration, timed apart,
changing no decision). Reports entropy-estimation time sampled vs full-every-iteration,
the correlation of the sampled and full entropy trajectories, and final validation loss,
DP bytes and ms per iteration of each run. Writes BENCHMARKS.md and bench/results/edgc_tiny/.
"""

import argparse
import os
import shutil
import subprocess
import sys

import numpy
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.report import run_pretrain, write_section  # noqa: E402


def estimator_costs(numel, grad_sample_rate, every, repeats=15):
    """Median ms of one full estimate vs one sampled estimate (single process, quiet)."""
    import time

    import torch

    from megatron_edgc.control.entropy import GradientSampler, gaussian_entropy

    torch.set_num_threads(1)
    grad = torch.randn(numel)
    sampler = GradientSampler(numel, grad_sample_rate=grad_sample_rate, seed=0)

    def timed(fn):
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1e3)
        return float(numpy.median(times))

    full = timed(lambda i: gaussian_entropy(grad.clone()))          # the probe copies pre-sync
    sampled = timed(lambda i: gaussian_entropy(sampler.sample(grad, i // every)))
    return full, sampled, sampled / every


def pearson(a, b):
    a, b = numpy.asarray(a, float), numpy.asarray(b, float)
    return float(numpy.corrcoef(a, b)[0, 1]) if len(a) > 2 else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--train-iters", type=int, default=200)
    p.add_argument("--reuse", action="store_true",
                   help="re-report the runs already in runs/bench/edgc_tiny (no training)")
    args = p.parse_args()
    edgc = yaml.safe_load(open(os.path.join(ROOT, "configs", "tiny-cpu.yaml")))["edgc"]
    r_max, r_min, window = edgc["rank_max"], edgc["rank_min"], edgc["window"]
    out = os.path.join(ROOT, "runs", "bench", "edgc_tiny")
    os.makedirs(out, exist_ok=True)
    runs = {}
    for name, flags in [("dense", []),
                        (f"static-r{r_max}", ["--edgc-mode", "static", "--edgc-rank", str(r_max)]),
                        (f"static-r{r_min}", ["--edgc-mode", "static", "--edgc-rank", str(r_min)]),
                        ("edgc", ["--edgc-mode", "edgc"]),
                        ("edgc-reference", ["--edgc-mode", "edgc", "--edgc-entropy-reference"])]:
        runs[name] = run_pretrain(name, flags, out, args.train_iters, args.reuse)

    # Entropy: cost and fidelity (from the reference run; decisions are identical).
    recs = runs["edgc-reference"][0]
    n = len(recs)
    sampled_ms = sum(r.get("entropy_ms", 0.0) for r in recs) / n
    full_ms = sum(r["entropy_full_ms"] for r in recs) / n
    stages = len(recs[0]["entropy_full"])
    corr_points, corr_windows = [], []
    for s in range(stages):
        meas = [r for r in recs if r.get("entropy")]
        corr_points.append(pearson([r["entropy"][s] for r in meas],
                                   [r["entropy_full"][s] for r in meas]))
        win_sampled, win_full = [], []
        for w in range(n // window):
            chunk = recs[w * window:(w + 1) * window]
            win_sampled.append(numpy.mean([r["entropy"][s] for r in chunk if r.get("entropy")]))
            win_full.append(numpy.mean([r["entropy_full"][s] for r in chunk]))
        corr_windows.append(pearson(win_sampled, win_full))
    same = [r["rank_dp"] for r in runs["edgc"][0]] == [r["rank_dp"] for r in recs]

    dense_val = runs["dense"][1]["val_loss"]
    dense_bytes = numpy.mean([r["dp_bytes_sent_job"] for r in runs["dense"][0]])
    warm = next((r["warmup_end_iter"] for r in runs["edgc"][0] if "warmup_end_iter" in r), None)
    after = lambda recs: [r["dp_bytes_sent_job"] for r in recs if warm and r["iteration"] > warm]
    rows = ["| run | final val loss | Δ vs dense | DP MiB/iter (job) | bytes vs dense | "
            "MiB/iter after EDGC's warm-up | ms/iter |", "|---|---|---|---|---|---|---|"]
    for name in ["dense", f"static-r{r_max}", f"static-r{r_min}", "edgc"]:
        recs_n, summ = runs[name]
        b = numpy.mean([r["dp_bytes_sent_job"] for r in recs_n])
        post = after(recs_n)
        post = f"{numpy.mean(post) / 2**20:.2f}" if post else "—"
        rows.append(f"| {name} | {summ['val_loss']:.4f} | "
                    f"{100 * (summ['val_loss'] / dense_val - 1):+.2f} % | {b / 2**20:.2f} | "
                    f"{b / dense_bytes:.3f} | {post} | {summ['ms_per_iter']:.0f} |")
    schedule, last = [], None
    for r in runs["edgc"][0]:
        if r["rank_dp"] != last:
            schedule.append(f"{r['iteration']}: " + "/".join(
                "dense" if x is None else str(x) for x in r["rank_dp"]))
            last = r["rank_dp"]

    # Plots: loss of all runs; entropy and rank of EDGC.
    res = os.path.join(ROOT, "bench", "results", "edgc_tiny")
    os.makedirs(res, exist_ok=True)
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_run.py"),
                    *[os.path.join(out, f"{k}.jsonl") for k in
                      ["dense", f"static-r{r_max}", f"static-r{r_min}", "edgc"]],
                    "--out", res], check=True)
    shutil.copy(os.path.join(out, "edgc.jsonl"), os.path.join(res, "edgc.jsonl"))

    saving = 1 - sampled_ms / full_ms
    every = max(1, round(1 / edgc["iter_sample_rate"]))
    cost_rows = ["| gradient elements per rank | full, every iteration | sampled (β), one estimate "
                 "| sampled, per iteration (α) | saving |", "|---|---|---|---|---|"]
    for numel in (235_136, 10_000_000, 50_000_000):
        full, one, per_iter = estimator_costs(numel, edgc["grad_sample_rate"], every)
        cost_rows.append(f"| {numel:,} | {full:.2f} ms | {one:.2f} ms | {per_iter:.2f} ms | "
                         f"{100 * (1 - per_iter / full):.0f} % |")
    body = f"""configs/tiny-cpu.yaml (TP1·PP2·DP2, 4 gloo processes), {args.train_iters} iterations per run, same data and seed. EDGC settings (the config's `edgc:` section): w = {window}, α = {edgc['iter_sample_rate']}, β = {edgc['grad_sample_rate']}, r_max = {r_max}, r_min = {r_min}, s = {edgc['rank_step']}, ε_H = {edgc['warmup_eps']}, K = {edgc['warmup_windows']}, warm-up cap {edgc.get('warmup_max_iters') or str(edgc['warmup_max_fraction']) + ' of the run'}.

**Entropy estimation (GDS)** — in the training run, mean per iteration: sampled (α, β) {sampled_ms:.2f} ms vs the full gradient every iteration {full_ms:.2f} ms: {100 * saving:.0f} % less (target ≥ 90 %; these are millisecond timings of 4 processes sharing 2 cores, noise-dominated). Measured apart, one quiet process, median of 15 (the tiny model's stage has 235,136 gradient elements per rank; larger buffers show where the sampling pays):

{chr(10).join(cost_rows)}

 Correlation of sampled vs full entropy, per stage: at the measured iterations {', '.join(f'{c:.3f}' for c in corr_points)}; window-mean trajectories {', '.join(f'{c:.3f}' for c in corr_windows)} (target ≥ 0.94). The reference run's rank schedule {'equals' if same else 'DIFFERS from'} the plain EDGC run's.

**EDGC vs dense vs static** (goal: EDGC within 1 % of dense validation loss, fewer bytes than static r_max):

{chr(10).join(rows)}

Over the whole run EDGC pays for its dense warm-up ({warm} of {args.train_iters} iterations here; the paper's runs are 100k iterations long); after it, it sends less than static r_max whenever a stage's rank is below r_max. EDGC warm-up ended at iteration {warm}; rank schedule (iteration: stage 0 / stage 1): {'; '.join(schedule)}.

![loss](bench/results/edgc_tiny/loss.png) ![entropy](bench/results/edgc_tiny/entropy.png) ![rank](bench/results/edgc_tiny/rank.png)

ms/iter on loopback CPU varies by about ±10 % between runs: it is not evidence either way here."""
    write_section("edgc_tiny", "EDGC on the tiny default: entropy sampling, ranks, loss and bytes",
                  "python bench/edgc_tiny.py", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
