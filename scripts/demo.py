#!/usr/bin/env python
"""The main job on the tiny CPU default: train, then print a side-by-side summary.

    python scripts/demo.py [--train-iters N] [extra pretrain flags...]

Each run writes ``runs/demo/<name>.jsonl`` (one record per iteration), its summary
``runs/demo/<name>.summary.json`` and TensorBoard events under ``runs/demo/tb/<name>``.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> extra flags (the EDGC settings are the edgc: section of the config).
# EDGC: entropy-chosen ranks on the DP sync and the pipeline backward sends, with DAC.
RUNS = {"dense": [], "edgc": ["--edgc-mode", "edgc", "--edgc-pp-compression", "edgc"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "demo"))
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny-cpu.yaml"))
    args, extra = p.parse_known_args()
    os.makedirs(args.out, exist_ok=True)
    summaries = {}
    for name, flags in RUNS.items():
        print(f"=== {name} ===", flush=True)
        metrics = os.path.join(args.out, f"{name}.jsonl")
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"), "--config", args.config,
               "--metrics-file", metrics, "--tensorboard-dir", os.path.join(args.out, "tb", name),
               *flags, *extra]
        code = subprocess.call(cmd, cwd=ROOT)
        if code:
            return code
        with open(os.path.splitext(metrics)[0] + ".summary.json") as fh:
            summaries[name] = json.load(fh)
    print()
    print(f"{'run':<10} {'first loss':>10} {'final loss':>10} {'val loss':>9} {'val ppl':>9} "
          f"{'ms/iter':>8} {'DP MiB/iter':>11} {'PP MiB/iter':>11}")
    for name, s in summaries.items():
        mib = "—" if s.get("dp_bytes_per_iter") is None else f"{s['dp_bytes_per_iter'] / 2**20:.2f}"
        pp = "dense" if s.get("pp_bytes_per_iter") is None \
            else f"{s['pp_bytes_per_iter'] / 2**20:.3f}"
        print(f"{name:<10} {s['first_loss']:>10.4f} {s['final_loss']:>10.4f} {s['val_loss']:>9.4f} "
              f"{s['val_ppl']:>9.2f} {s['ms_per_iter']:>8.1f} {mib:>11} {pp:>11}")
    edgc_metrics = os.path.join(args.out, "edgc.jsonl")
    if os.path.exists(edgc_metrics):
        print("\nEDGC rank schedule (first iteration in force: DP rank per pipeline stage "
              "[CQM rank before DAC] | pipeline rank):")
        last = None
        for rec in map(json.loads, open(edgc_metrics)):
            table = (rec.get("rank_dp"), rec.get("rank_cqm"), rec.get("rank_pp"))
            if table != last:
                dp, cqm, pp = (" / ".join("dense" if r is None else str(r) for r in t or [])
                               for t in (table[0], table[1], [table[2]]))
                print(f"  {rec['iteration']:>5}: {dp} [{cqm}] | pp {pp}")
                last = table
    plots = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_run.py"),
                            *[os.path.join(args.out, f"{n}.jsonl") for n in RUNS],
                            "--out", os.path.join(args.out, "plots")],
                           capture_output=True, text=True)
    print(f"\nplots: {plots.stdout.split() if plots.returncode == 0 else plots.stderr}")
    print(f"metrics, summaries and TensorBoard events: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
