#!/usr/bin/env python
"""Rerun a captured compressed step phase by phase and name the first phase whose output
is not finite (issue 50).

    python scripts/replay_step.py DUMP [DUMP ...] [--device cpu|cuda]

``DUMP``: a file ``--edgc-debug-dump`` wrote (``iter{I}-rank{R}-{bucket}.pt``), or its
directory (every file in it). A ``*.factors.pt`` (the summed factors of the matrices whose
basis stood in) is orthonormalized again, batched and one matrix at a time. Each is one rank's step of one bucket: its inputs and the
sums its collectives returned, so it replays alone, with no process group. The same dump
replayed on the device that failed and on the CPU says whether the device is the cause.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_edgc.compression.step_capture import replay, replay_factors  # noqa: E402


def dumps(paths: list) -> list:
    files = []
    for path in paths:
        files += sorted(glob.glob(os.path.join(path, "*.pt"))) if os.path.isdir(path) else [path]
    return files


def report_factors(path: str, device: str) -> int:
    """Prints the replay of a ``*.factors.pt`` (the summed factors whose basis stood in):
    each group orthonormalized batched and one matrix at a time on ``device``, and the
    smallest eigenvalue of its unit-column Gram; returns the matrices that stood in."""
    rec = torch.load(path, map_location="cpu", weights_only=True)
    print(f"{path}: iteration {rec['iteration']}, rank {rec['rank']}, {rec['bucket']}: "
          f"factors that stood in on {rec['device']}; replayed on {device}")
    if not rec["groups"]:
        print("  none stood in when orthonormalized again on that device")
    total = 0
    for key, how, stood_in, of, smallest in replay_factors(rec, device):
        total += stood_in
        print(f"  {key} {how}: {stood_in} of {of} stood in (smallest eigenvalue of the "
              f"unit-column Gram, fp64: {smallest:.3e})")
    return total


def report(path: str, device: str) -> str:
    """Prints the replay of one dump; returns its first non-finite phase ('' if none)."""
    if path.endswith(".factors.pt"):
        report_factors(path, device)
        return ""
    rec = torch.load(path, map_location="cpu", weights_only=True)
    scale = rec.get("loss_scale", 1.0)
    print(f"{path}: iteration {rec['iteration']}, rank {rec['rank']}, {rec['bucket']} "
          f"({rec.get('cause', '?')}); {rec['factor_dtype']} factors, {rec['ef_dtype']} "
          f"residual, loss scale {float(scale):g}; replayed on {device}")
    for g in rec["groups"]:
        print(f"  {g['key']}: {len(g['names'])} x [{g['n']}, {g['m']}] at rank {g['rank']}, "
              f"gradients {str(g['grad'].dtype).replace('torch.', '')}")
    first, received = "", {}
    for key, phase, finite in replay(rec, device):
        print(f"  {'ok        ' if finite else 'NON-FINITE'}  {key}: {phase}")
        if finite or first or key in received:   # after a non-finite sum the step received,
            continue                 # what the group makes of it is not this device's doing
        if "(captured)" in phase:
            received[key] = f"{key}: {phase}"
        else:
            first = f"{key}: {phase}"
    if first:
        print(f"first non-finite phase: {first}")
    else:
        print(f"every phase finite on {device}: the failure did not reproduce here"
              + (f" (non-finite only in what the step received: "
                 f"{'; '.join(received.values())})" if received else ""))
    return first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", nargs="+", help="a file --edgc-debug-dump wrote, or its directory")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args(argv)
    files = dumps(args.dump)
    if not files:
        ap.error(f"no dump in {args.dump}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    for path in files:
        report(path, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
