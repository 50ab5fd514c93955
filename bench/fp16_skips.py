#!/usr/bin/env python
"""Does compression add fp16 overflows? The loss scaler's skips of dense, static and EDGC
fp16 runs, side by side (issue 71 item 8).

    .venv/bin/python bench/fp16_skips.py [--iters 200] [--seeds 1234 1235 1236]

After a skipped step a compressed bucket's residual holds the whole message it did not
apply (``E = M``, docs/reliability.md), so its next message carries about two steps of
gradient into fp16 buffers at the same scale: it could overflow where dense would not.
Measured so: the compressed result written into fp16 buffers overflowed where the dense
sum did not, and each skip after it gave back a larger message (three in a row). So
since issue 71 a compressing fp16 run keeps its gradient buffers in fp32 by default
(``--accumulate-allreduce-grads-in-fp32``); both are run here, fp16 buffers by
``--no-accumulate-allreduce-grads-in-fp32``.
``configs/tiny-cpu.yaml --fp16`` (megatron-core's dynamic scaler from its default 2^32,
hysteresis 2) for each mode and seed, ``ITERS`` iterations; per run the skipped
iterations, those after iteration 20 (past the scale's descent from 2^32), the scale
changes and the final loss (mean of the last 10). Writes the
``fp16_skips`` section of BENCHMARKS.md and the records under
``bench/results/fp16_skips/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.report import write_section  # noqa: E402

CONFIG = "configs/tiny-cpu.yaml"
OUT = os.path.join(ROOT, "bench", "results", "fp16_skips")
FP16_BUFFERS = ["--no-accumulate-allreduce-grads-in-fp32"]
#: mode -> (file stem, flags): compression with fp16 gradient buffers (the default before
#: issue 71) and with fp32 ones (the default since, where compression is on)
MODES = {"dense": ("dense", ["--edgc-mode", "off"]),
         "static r8, fp16 buffers": ("static16", ["--edgc-mode", "static", *FP16_BUFFERS]),
         "EDGC, fp16 buffers": ("edgc16", ["--edgc-mode", "edgc", *FP16_BUFFERS]),
         "static r8, fp32 buffers": ("static", ["--edgc-mode", "static"]),
         "EDGC, fp32 buffers": ("edgc", ["--edgc-mode", "edgc"])}


def complete(mode: str, seed: int, iters: int) -> bool:
    metrics = os.path.join(OUT, f"{MODES[mode][0]}-{seed}.jsonl")
    return os.path.exists(metrics) and sum(1 for _ in open(metrics)) >= iters


def run(mode: str, seed: int, iters: int) -> dict:
    stem, flags = MODES[mode]
    name = f"{stem}-{seed}"
    metrics = os.path.join(OUT, f"{name}.jsonl")
    if not os.path.exists(metrics) or sum(1 for _ in open(metrics)) < iters:
        if os.path.exists(metrics):
            os.remove(metrics)
        subprocess.run([sys.executable, "pretrain_gpt2_edgc.py", "--config", CONFIG, "--fp16",
                        "--seed", str(seed), "--train-iters", str(iters), "--eval-interval",
                        str(iters), "--metrics-file", metrics, *flags],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in open(metrics)]
    skipped = [r["iteration"] for r in records if r.get("skipped")]
    scales = [r.get("loss_scale") for r in records]
    return {"mode": mode, "seed": seed, "skipped": len(skipped),
            "skipped_at": skipped,
            "late_skips": len([s for s in skipped if s > 20]),
            "scale_changes": sum(a != b for a, b in zip(scales, scales[1:])),
            "final_loss": statistics.mean(r["loss"] for r in records[-10:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1235, 1236])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--existing", action="store_true",
                    help="report the runs already complete, run nothing")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    rows = [run(mode, seed, args.iters) for seed in args.seeds for mode in args.modes
            if not args.existing or complete(mode, seed, args.iters)]
    with open(os.path.join(OUT, "summary.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    lines = ["| mode | seeds | skipped | after iteration 20 (at) | scale changes | final loss |",
             "|---|---|---|---|---|---|"]
    modes = [m for m in MODES if m in args.modes]
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        late = [f"{r['late_skips']}" + (" (" + ", ".join(str(s) for s in r["skipped_at"]
                                                          if s > 20) + ")"
                                        if r["late_skips"] else "") for r in mine]
        lines.append(f"| {mode} | {' / '.join(str(r['seed']) for r in mine)} | "
                     f"{' / '.join(str(r['skipped']) for r in mine)} | "
                     f"{' / '.join(late)} | "
                     f"{' / '.join(str(r['scale_changes']) for r in mine)} | "
                     f"{' / '.join('%.4f' % r['final_loss'] for r in mine)} |")
    dense = {r["seed"]: r["skipped"] for r in rows if r["mode"] == "dense"}
    paired = {m: [(r["skipped"], dense[r["seed"]]) for r in rows
                  if r["mode"] == m and r["seed"] in dense] for m in modes if m != "dense"}
    extra = {m: sum(a - b for a, b in pairs) for m, pairs in paired.items()}
    rule = ("Verdict rule, per mode against dense on the same seeds: adds skips where it "
            "skips at least as often on every seed and more in total; adds none where it "
            "skips at most as often on every seed; not resolved otherwise.")

    def verdict_of(pairs: list) -> str:
        if all(a <= b for a, b in pairs):
            return "adds none"
        return "adds skips" if all(a >= b for a, b in pairs) else "not resolved"

    verdict = "; ".join(f"{m}: {extra[m]:+d} against dense over {len(pairs)} seed(s), "
                        f"{verdict_of(pairs)}" for m, pairs in paired.items() if pairs)
    write_section("fp16_skips", "fp16: does compression add overflows?",
                  f"bench/fp16_skips.py --iters {args.iters} --seeds "
                  f"{' '.join(map(str, args.seeds))}" + ("" if modes == list(MODES) else
                                                        " --modes ..."),
                  "\n".join(lines) + f"\n\n{rule} {verdict}.\n\n<!-- notes -->")
    print("\n".join(lines))
    print(rule, verdict)


if __name__ == "__main__":
    main()
