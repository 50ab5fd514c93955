#!/usr/bin/env python
"""Accuracy beyond loss: dense vs EDGC on the tiny default, validation perplexity and
zero-shot last-word (LAMBADA-style) accuracy on held-out passages.

    python bench/accuracy.py [--train-iters 400] [--examples 500]

Both runs: configs/tiny-cpu.yaml (TP1·PP2·DP2, 4 gloo processes), same data, seed and
iterations; EDGC as in the demo (DP sync and pipeline backward sends, DAC on). After the
last iteration each run scores the same held-out sentence-final words (test split first,
then validation; neither is trained on): exact match of the greedy word, and the mean
negative log-likelihood of the word (nats), which moves long before accuracy does.
Writes bench/results/accuracy/ and its section of BENCHMARKS.md.
"""

import argparse
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.report import run_pretrain, write_section  # noqa: E402

RUNS = {
    "dense": ["--edgc-mode", "off"],
    "EDGC": ["--edgc-mode", "edgc", "--edgc-pp-compression", "edgc"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--train-iters", type=int, default=400)
    p.add_argument("--examples", type=int, default=500)
    p.add_argument("--reuse", action="store_true")
    args = p.parse_args()
    out = os.path.join(ROOT, "bench", "results", "accuracy")
    os.makedirs(out, exist_ok=True)
    common = ["--last-word-examples", str(args.examples), "--eval-interval",
              str(args.train_iters // 4)]
    rows, base = [], None
    for name, flags in RUNS.items():
        records, summary = run_pretrain(name, common + flags, out, args.train_iters,
                                        args.reuse)
        dp = summary["dp_bytes_per_iter"] / 2**20
        acc, n, nll = summary["last_word_acc"], summary["last_word_n"], summary["last_word_nll"]
        se = math.sqrt(acc * (1 - acc) / n) if n else float("nan")
        base = base or summary
        rows.append(f"| {name} | {summary['val_loss']:.4f} | {summary['val_ppl']:.1f} | "
                    f"{100 * (summary['val_ppl'] / base['val_ppl'] - 1):+.2f} % | "
                    f"{100 * acc:.1f} % ± {100 * se:.1f} | {nll:.3f} | "
                    f"{nll - base['last_word_nll']:+.3f} | {n} | {dp:.2f} |")
    body = (f"Tiny default (TP1·PP2·DP2), {args.train_iters} iterations, same data and seed; "
            f"EDGC on the DP sync and the pipeline backward sends with DAC. Last-word: "
            f"{args.examples} held-out sentence-final words (± one standard error), exact "
            f"greedy match, and the word's mean NLL.\n\n"
            "| run | val loss | val ppl | ppl vs dense | last-word acc | word NLL (nats) | "
            "NLL vs dense | n | DP MiB/iter |\n|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows))
    write_section("accuracy", "Accuracy beyond loss: perplexity and zero-shot last word",
                  "python bench/accuracy.py", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
