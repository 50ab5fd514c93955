#!/usr/bin/env python
"""The error-feedback residual's dtype per device: what ``--edgc-ef-dtype auto`` weighs.

    .venv/bin/python bench/ef_dtype.py [--device cuda] [--repeats 15]

On the race's model (``configs/tiny-cpu.yaml``: hidden 128, 4 layers, 8192-id vocabulary;
r 32, bf16 factors) and on GPT-2 medium's largest shapes (hidden 1024, ``--medium``), one DP
rank, no collectives:

* the residual's round trip that ``auto`` times on a GPU
  (:func:`megatron_edgc.compression.ef_dtype.time_ef_dtypes`: ``M = G + E`` formed,
  ``E = M − A Bᵀ`` kept), fp32 and bf16 residual, on fp32 and bf16 gradient buffers;
* the whole compressed step (``bench/step_phases.py:time_method``: start, orthonormalization,
  middle, finish) in the same four settings, with its error-feedback state.

Writes the ``ef_dtype`` section of BENCHMARKS.md (the machine in its header). One thread
on CPU (the race runs 4 ranks on 2 cores with ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.report import write_section  # noqa: E402
from bench.step_phases import time_method  # noqa: E402
from megatron_edgc.compression.ef_dtype import BF16_MAX_COST, time_ef_dtypes  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_shapes(hidden: int, layers: int, vocab: int) -> list:
    ffn = 4 * hidden
    return [(vocab, hidden)] + [(3 * hidden, hidden), (hidden, hidden), (ffn, hidden),
                                (hidden, ffn)] * layers


MODELS = {"tiny-cpu (race)": model_shapes(128, 4, 8192),
          "GPT-2 medium, 4 layers": model_shapes(1024, 4, 50304)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    lines = ["| model | gradient buffer | round trip fp32 ms | round trip bf16 ms | bf16 / fp32 | "
             "step, fp32 residual ms (min–max) | step, bf16 residual ms (min–max) | "
             "bf16 / fp32 | state fp32 / bf16 MiB |", "|---" * 9 + "|"]
    for model in args.models:
        shapes = MODELS[model]
        for grads in ("fp32", "bf16"):
            trip = time_ef_dtypes(shapes, DTYPES[grads], device).tolist()
            steps = {ef: time_method("after", shapes, args.rank, device, repeats=args.repeats,
                                     warmup=3, factor_dtype=torch.bfloat16,
                                     ef_dtype=DTYPES[ef], grad_dtype=DTYPES[grads])
                     for ef in ("fp32", "bf16")}
            cell = {ef: f"{s['step']:.1f} ({s['step_min']:.1f}–{s['step_max']:.1f})"
                    for ef, s in steps.items()}
            state = {ef: s.get("ef_state_bytes", 0) / 2**20 for ef, s in steps.items()}
            lines.append(f"| {model} | {grads} | {trip[0]:.2f} | {trip[1]:.2f} | "
                         f"{trip[1] / trip[0]:.2f} | {cell['fp32']} | {cell['bf16']} | "
                         f"{steps['bf16']['step'] / steps['fp32']['step']:.2f} | "
                         f"{state['fp32']:.1f} / {state['bf16']:.1f} |")
            print(lines[-1], flush=True)
    limit = BF16_MAX_COST.get(device.type, BF16_MAX_COST["cpu"])
    body = (f"Device {device.type}; r {args.rank}, bf16 factors, one DP rank, no collectives"
            f"{', one thread' if device.type == 'cpu' else ''}; the step is the median "
            f"(min–max) of {args.repeats}, the round trip the least of 5. `auto` keeps bf16 on "
            f"this kind of device where the round trip's ratio is at most {limit:g}"
            f"{' (the host: never, untimed)' if limit <= 1.0 else ''}.\n\n"
            + "\n".join(lines) + "\n\n<!-- notes -->")
    write_section("ef_dtype", "The error feedback's dtype per device",
                  ".venv/bin/python bench/ef_dtype.py", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
