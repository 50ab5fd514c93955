#!/usr/bin/env python
"""PowerSGD's compress/decompress kernels on the paper configs' TP-sharded shapes.

    python bench/gpu_kernels.py [--device cuda] [--ranks 16 32 64] [--out FILE.json]
    python bench/gpu_kernels.py --device cpu --scale 16      # a dry run on CPU

For each paper config (``configs/gpt2-2.5b-v100x32.yaml``, ``configs/gpt2-12.1b-h100x64.yaml``)
it builds the gradient matrices of the largest (TP, PP) shard (stage 0, which holds the
word embedding; ``bench/model.py:shard_matrices``) as one bucket and runs the real
:class:`~megatron_edgc.compression.powersgd.BucketCompressor` on it as one DP rank (the
collectives left out: this times the math only), at each rank, factor dtype and gradient
buffer dtype (``--grad-dtypes``: fp32, or bf16 as Megatron's ``--grad-reduce-in-bf16``
gives, where the compressor forms ``M`` in fp32 slices and keeps ``G`` in the buffer):

* ``start``: error feedback ``M = G + E`` and ``P = M Q`` (batched by shape), the non-finite flag;
* ``middle``: the QR of ``P`` and ``Q = Mᵀ P̂``;
* ``finish``: ``P̂ Qᵀ`` into the gradients and the error-feedback update;

and, per shape group, the same kernels one by one (``ops``; fp32 buffers only). Intervals
are CUDA events on the current stream (read after a synchronize), the median of
``--repeats`` after ``--warmup`` steps. It also measures the entropy sampler (GDS: gather
of β of the shard's elements and the Gaussian estimate) and the memory of the
error-feedback state (the residual and warm-start Q kept between steps) and the peak of
one step.

Then the before/after of issue 33 (``--methods before after``): the step of before it
(stacked copy of the gradients, ``torch.linalg.qr``) and today's, each phase (start,
orthogonalization, middle, finish) against its floor (``bench/roofline.py``, with the
device's copy and fp32 matmul rates measured in the same run), for fp32/bf16 factors and
fp32/bf16 error feedback (``--ef-dtypes``) and fp32/bf16 gradient buffers (the floor counts
the buffer's bytes in its dtype; ``before`` ran on fp32 buffers and fp32 error feedback
only), with the error-feedback state and the step's transient memory
(``max_memory_allocated`` minus what stays between steps). Rows of JSONs from before
``--grad-dtypes`` read as fp32 gradients.

``--scale k`` divides hidden and ffn sizes by ``k`` (CPU dry runs; the report says so).
``--report FILE.json`` writes the BENCHMARKS.md section from a JSON of a GPU run (the lent
machine returns only files): ``bench/results/gpu_kernels_h100.json`` is the H100 one, and
``bench/model.py`` reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.model import CLUSTERS, shard_matrices  # noqa: E402
from bench.roofline import PHASES, measure_peaks  # noqa: E402
from bench.step_phases import Timer as StepTimer  # noqa: E402
from bench.step_phases import compare, time_method  # noqa: E402
from megatron_edgc.compression.matrices import FACTOR_DTYPES  # noqa: E402
from megatron_edgc.compression.orthonormal import orthonormalize  # noqa: E402
from megatron_edgc.compression.powersgd import BucketCompressor  # noqa: E402
from megatron_edgc.control.entropy import GradientSampler, estimate_entropy  # noqa: E402

VOCAB = 50304


class Timer:
    """Median milliseconds of a region over ``repeats`` after ``warmup`` calls (CUDA events
    on the current stream, or the host clock: :class:`bench.step_phases.Timer`)."""

    def __init__(self, device: torch.device):
        self.once = StepTimer(device)

    def __call__(self, fn, repeats: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        return statistics.median(self.once(fn) for _ in range(repeats))


def shard_shapes(cluster_key: str, scale: int) -> tuple[list, int, dict]:
    import yaml

    cluster = CLUSTERS[cluster_key]
    with open(os.path.join(ROOT, cluster.config)) as fh:
        cfg = yaml.safe_load(fh)
    md, par = cfg["model"], cfg["parallel"]
    hidden = md["hidden_size"] // scale
    ffn = (md.get("ffn_hidden_size") or 4 * md["hidden_size"]) // scale
    mats, rest = shard_matrices(md["num_layers"], hidden, ffn, VOCAB,
                                par["tensor_model_parallel_size"],
                                par["pipeline_model_parallel_size"])
    layout = {"tp": par["tensor_model_parallel_size"], "pp": par["pipeline_model_parallel_size"],
              "dp": par["data_parallel_size"], "hidden": hidden, "ffn": ffn,
              "layers_per_stage": md["num_layers"] // par["pipeline_model_parallel_size"]}
    return mats, rest, layout


def time_compressor(mats, rank: int, factor_dtype: str, device, timer, repeats, warmup,
                    grad_dtype: str = "fp32") -> dict:
    """The three phases of one compressed step on one bucket holding every matrix (today's
    step; ``middle`` includes the orthogonalization), and its memory, with the gradients
    in a ``grad_dtype`` buffer."""
    run = time_method("after", mats, rank, device, repeats=repeats, warmup=warmup,
                      factor_dtype=FACTOR_DTYPES[factor_dtype],
                      grad_dtype=FACTOR_DTYPES[grad_dtype])
    out = {"start": run["start"], "middle": run["middle"] + run["orth"],
           "finish": run["finish"], "total": run["step"], "total_min": run["step_min"],
           "total_max": run["step_max"], "ef_state_bytes": run["ef_state_bytes"],
           "ef_state_expected_bytes": run["ef_state_bytes"]}
    if "transient_bytes" in run:  # as before: the step's peak over what preceded the state
        out["step_peak_bytes"] = run["ef_state_bytes"] + run["transient_bytes"]
    for key in ("wire_bytes", "dense_bytes", "compressed_matrices"):
        out[key] = run[key]
    return out


def time_ops(mats, rank: int, factor_dtype: str, device, timer, repeats, warmup) -> dict:
    """Each kernel of the step, per shape group (k matrices of n x m), summed over groups."""
    dtype = FACTOR_DTYPES[factor_dtype]
    totals = Counter()
    for (n, m), k in Counter(mats).items():
        r = min(rank, n, m)
        g = torch.randn(k, n, m, device=device)
        e = torch.randn(k, n, m, device=device)
        q = torch.randn(k, m, r, device=device)
        mm = g + e
        p = torch.bmm(mm, q)
        p_hat = orthonormalize(p)
        q_loc = torch.bmm(mm.transpose(1, 2), p_hat)
        out = torch.empty(n, m, device=device)
        totals["ef_add"] += timer(lambda: torch.add(g, e, out=mm), repeats, warmup)
        totals["p_bmm"] += timer(lambda: torch.bmm(mm, q), repeats, warmup)
        totals["to_factor_dtype"] += timer(lambda: p.to(dtype), repeats, warmup)
        totals["qr"] += timer(lambda: orthonormalize(p), repeats, warmup)
        totals["q_bmm"] += timer(lambda: torch.bmm(mm.transpose(1, 2), p_hat), repeats, warmup)
        totals["decompress"] += timer(lambda: [torch.mm(p_hat[j], q_loc[j].T, out=out)
                                               for j in range(k)], repeats, warmup)
        totals["ef_update"] += timer(lambda: torch.baddbmm(mm, p_hat, q_loc.transpose(1, 2),
                                                           alpha=-1), repeats, warmup)
        del g, e, mm
    return dict(totals)


def floor_rows(shapes, args, device, peaks) -> list:
    """Before/after issue 33 per rank, factor dtype, error-feedback dtype and gradient
    buffer dtype, each phase against its floor (``bench/step_phases.py``); ``before`` only
    with fp32 gradients and fp32 error feedback."""
    rows = []
    for dtype in args.dtypes:
        for rank in args.ranks:
            for grad in args.grad_dtypes:
                for ef in args.ef_dtypes:
                    methods = [m for m in args.methods
                               if m != "before" or (ef == "fp32" and grad == "fp32")]
                    if not methods:
                        continue
                    r = compare(shapes, rank, device, peaks, repeats=args.repeats,
                                warmup=args.warmup, factor_dtype=FACTOR_DTYPES[dtype],
                                ef_dtype=FACTOR_DTYPES[ef], grad_dtype=FACTOR_DTYPES[grad],
                                methods=methods)
                    for method, run in r["runs"].items():
                        run.pop("groups", None)
                        rows.append({"rank": rank, "factor_dtype": dtype, "grad_dtype": grad,
                                     "ef_dtype": ef, "method": method, **run,
                                     "floor_ms": r["floor_ms"],
                                     "residual_bytes": r["residual_bytes"]})
                        print(f"floor r{rank} {dtype} factors {grad} grads {ef} EF {method}: "
                              f"step {run['step']:.2f} ms / floor {r['floor_ms']['step']:.2f} ms, "
                              f"transient {run.get('transient_bytes', 0) / 2**20:.0f} MiB",
                              flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    return rows


def time_entropy(mats, rest: int, device, timer, repeats, warmup,
                 grad_sample_rate: float = 0.25, iter_sample_rate: float = 0.1) -> dict:
    numel = sum(n * m for n, m in mats) + rest
    flat = torch.randn(numel, device=device)
    sampler = GradientSampler(numel, grad_sample_rate=grad_sample_rate)
    sampler.sample(flat, 0)  # draws and moves the window's indices once
    ms = timer(lambda: estimate_entropy(sampler.sample(flat, 0)), repeats, warmup)
    return {"numel": numel, "grad_sample_rate": grad_sample_rate,
            "iter_sample_rate": iter_sample_rate, "measured_iteration_ms": ms,
            "per_iteration_ms": ms * iter_sample_rate}


def render(report: dict, json_path: str) -> str:
    """The BENCHMARKS.md body of a run's JSON: per config, factor dtype and gradient
    buffer dtype (rows without one: fp32), the phases and the QR alone (ms), the
    error-feedback memory, and the entropy sampler's cost."""
    lines = ["| shard (config) | factors | grad_dtype | rank | start | middle (QR) | finish "
             "| total ms | wire / dense bytes | EF state MiB | step peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for key, entry in report["configs"].items():
        lay = entry["layout"]
        shard = f"TP{lay['tp']}·PP{lay['pp']} stage 0 ({key})"
        for row in entry["runs"]:
            qr = row.get("ops", {}).get("qr")
            total = f"**{row['total']:.2f}**" + (
                f" ({row['total_min']:.2f}–{row['total_max']:.2f})" if "total_min" in row else "")
            mem = (f"{row['ef_state_bytes'] / 2**20:.0f} | {row['step_peak_bytes'] / 2**20:.0f}"
                   if "ef_state_bytes" in row else "– | –")
            middle = f"{row['middle']:.2f}" + ("" if qr is None else f" ({qr:.2f})")
            lines.append(
                f"| {shard} | {row['factor_dtype']} | {row.get('grad_dtype', 'fp32')} | "
                f"{row['rank']} | {row['start']:.2f} | {middle} | {row['finish']:.2f} | "
                f"{total} | {100 * row['wire_bytes'] / row['dense_bytes']:.2f} % | {mem} |")
        ent = entry["entropy"]
        notes.append(f"* {key}: entropy sample (GDS, β = {ent['grad_sample_rate']}, one "
                     f"iteration in {round(1 / ent['iter_sample_rate'])}) "
                     f"{ent['measured_iteration_ms']:.2f} ms per sampled iteration, "
                     f"{ent['per_iteration_ms']:.3f} ms per iteration on average "
                     f"({ent['numel'] / 1e6:.0f} M elements).")
    floor_lines = []
    for key, entry in report["configs"].items():
        for row in entry.get("floor", []):
            fl = row["floor_ms"]
            cells = " | ".join(f"{row[p]:.2f} / {fl[p]:.2f} ({row[p] / fl[p]:.1f}x)"
                               for p in PHASES)
            tr = row.get("transient_bytes")
            floor_lines.append(
                f"| {key} | r{row['rank']} | {row['factor_dtype']} | "
                f"{row.get('grad_dtype', 'fp32')} | {row['ef_dtype']} | {row['method']} | "
                f"{cells} | **{row['step']:.2f}** / {fl['step']:.2f} "
                f"(**{row['step'] / fl['step']:.1f}x**) | {row['ef_state_bytes'] / 2**20:.0f} | "
                f"{'–' if tr is None else f'{tr / 2**20:.0f}'} |")
    if floor_lines:
        pk = report["peaks"]
        notes.append("")
        notes.append(f"**The step against its floor (issue 33).** Copy "
                     f"{pk['copy_bytes_per_s'] / 1e12:.2f} TB/s, fp32 matmul "
                     f"{pk['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s, measured in the same "
                     "run; floors from `bench/roofline.py` (the gradient buffer's bytes in its "
                     "dtype); cells: measured ms / floor ms.")
        notes.append("")
        notes.append("| config | rank | factors | grad_dtype | EF | step | start | "
                     "orthogonalization | middle (without it) | finish | whole step | "
                     "EF state MiB | transient MiB |")
        notes.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        notes.extend(floor_lines)
    scale = report.get("scale", 1)
    head = (f"Device **{report['device']}**, torch {report['torch']}, measured "
            f"{report['date']}; median of {report['repeats']} steps (CUDA events; the "
            f"total's min–max where recorded), one DP "
            f"rank's math (no collectives), the largest shard's matrices as one bucket, "
            f"batched by shape as the code does. TF32 off (the trainer's fp32 math)."
            + (f" **Dry run: hidden sizes divided by {scale}.**" if scale != 1 else "")
            + f" Raw figures: `{os.path.relpath(json_path, ROOT)}`.")
    return head + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(notes) + \
        "\n\n<!-- notes -->\n"


def write_report(json_path: str) -> None:
    from bench.report import write_section

    with open(json_path) as fh:
        report = json.load(fh)
    write_section("gpu_kernels", "GPU kernels: PowerSGD compress/decompress on the paper "
                  "shards", "python bench/gpu_kernels.py --out "
                  f"{os.path.relpath(json_path, ROOT)}", render(report, json_path),
                  stamp=f"measured {report['date']} on {report['device']}, "
                        f"torch {report['torch']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(FACTOR_DTYPES))
    ap.add_argument("--configs", nargs="+", default=list(CLUSTERS), choices=list(CLUSTERS))
    ap.add_argument("--scale", type=int, default=1, help="divide hidden/ffn by this (dry runs)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-ops", action="store_true", help="skip the per-kernel breakdown")
    ap.add_argument("--methods", nargs="*", default=["before", "fp32-gram", "after"],
                    choices=["before", "fp32-gram", "after"],
                    help="steps of the floor table (none: skip it): before issue 33, "
                         "before issue 56 (its fp32 Gram matrices), today's")
    ap.add_argument("--ef-dtypes", nargs="+", default=["fp32", "bf16"],
                    choices=list(FACTOR_DTYPES), help="error-feedback dtypes of 'after'")
    ap.add_argument("--grad-dtypes", nargs="+", default=["fp32", "bf16"],
                    choices=["fp32", "bf16"],
                    help="gradient buffer dtypes (bf16: Megatron's --grad-reduce-in-bf16); "
                         "'before' runs on fp32 only")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="only write the BENCHMARKS.md section of an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.report:
        write_report(args.report)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # what the trainer's fp32 math does
    timer = Timer(device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor() or platform.machine(),
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "scale": args.scale, "repeats": args.repeats, "configs": {}}
    for key in args.configs:
        mats, rest, layout = shard_shapes(key, args.scale)
        entry = {"layout": layout, "shapes": [[n, m, k] for (n, m), k in Counter(mats).items()],
                 "dense_rest": rest, "runs": []}
        for dtype in args.dtypes:
            for rank in args.ranks:
                for grad in args.grad_dtypes:
                    row = {"rank": rank, "factor_dtype": dtype, "grad_dtype": grad,
                           **time_compressor(mats, rank, dtype, device, timer, args.repeats,
                                             args.warmup, grad_dtype=grad)}
                    if not args.no_ops and grad == "fp32":  # the kernels on fp32 buffers
                        row["ops"] = time_ops(mats, rank, dtype, device, timer, args.repeats,
                                              args.warmup)
                    entry["runs"].append(row)
                    print(f"{key} r{rank} {dtype} {grad} grads: start {row['start']:.2f} "
                          f"middle {row['middle']:.2f} finish {row['finish']:.2f} = "
                          f"{row['total']:.2f} ms"
                          + (f", EF state {row['ef_state_bytes'] / 2**20:.0f} MiB, step peak "
                             f"{row['step_peak_bytes'] / 2**20:.0f} MiB"
                             if "ef_state_bytes" in row else ""), flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        if args.methods:
            peaks = report.setdefault("peaks", measure_peaks(device) if device.type == "cuda"
                                      else measure_peaks(device, 64, 1024, 2))
            entry["floor"] = floor_rows(mats + [(1, rest)], args, device, peaks)
        entry["entropy"] = time_entropy(mats, rest, device, timer, args.repeats, args.warmup)
        print(f"{key} entropy sample: {entry['entropy']['measured_iteration_ms']:.2f} ms per "
              f"measured iteration", flush=True)
        report["configs"][key] = entry
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
        if device.type == "cuda" and args.scale == 1:
            write_report(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
