#!/usr/bin/env python
"""Paper-scale cost model: dense vs EDGC DP-sync latency and iteration time (alpha-beta).

    python bench/model.py [--rank-schedule 64:0.1,32:0.9]

A *model*, not a measurement: every figure it prints is labelled "modelled". For each of
the paper's two setups it takes the config in ``configs/`` (layer shapes, TP × PP × DP,
micro/global batch) and the assumptions declared in :data:`CLUSTERS` (link bandwidth and
latency per GPU for the DP ring, compute throughput), and predicts per iteration:

* DP-sync latency: ring all-reduce ``2(N−1)α + 2(N−1)/N · bytes / B`` of one
  (TP, PP) shard's gradients — dense, or PowerSGD at rank r (two all-reduces: all P with
  the dense rest, then all Q), using the same per-matrix rule as the code
  (``compression/powersgd.py:is_compressible``);
* iteration time: compute (``6 · params · tokens`` plus attention ``12 · L · h · s²`` per
  sequence, over the declared sustained FLOP/s) plus the 1F1B bubble plus the DP sync,
  which is exposed (no overlap assumed: the pessimistic case for dense);
* over a rank schedule (fractions of iterations at each rank, dense included) the means.

The paper reports up to 46.45 % less communication latency and 16.13 % less training
time for GPT2-12.1B on 64 H100; the model prints its own figures next to those.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_edgc.compression.powersgd import is_compressible  # noqa: E402

PAPER = {"comm_reduction": 0.4645, "time_reduction": 0.1613}


@dataclass
class Cluster:
    """Declared hardware assumptions (all stated in the report)."""

    name: str
    config: str
    dp_bandwidth_gbit: float   # per GPU, for its DP ring (inter-node share)
    alpha_us: float            # per ring step
    sustained_tflops: float    # per GPU, what the model's matmuls actually reach
    grad_bytes: int            # bytes per gradient element in the DP sync (dense)


CLUSTERS = {
    "gpt2-2.5b-v100x32": Cluster(
        "GPT2-2.5B on 32 V100 (4 nodes x 8, 100 Gbit/s EDR per node: 12.5 Gbit/s per GPU)",
        "configs/gpt2-2.5b-v100x32.yaml", dp_bandwidth_gbit=12.5, alpha_us=20.0,
        sustained_tflops=15.7 * 0.6, grad_bytes=4),
    "gpt2-12.1b-h100x64": Cluster(
        "GPT2-12.1B on 64 H100 (8 nodes x 8, 400 Gbit/s NDR per GPU)",
        "configs/gpt2-12.1b-h100x64.yaml", dp_bandwidth_gbit=400.0, alpha_us=10.0,
        sustained_tflops=989.0 * 0.4, grad_bytes=4),
}


def shard_matrices(layers: int, hidden: int, ffn: int, vocab: int, tp: int, pp: int):
    """(n, m) of the weight matrices of the largest (TP, PP) shard (stage 0 holds the
    embedding) and its dense rest (biases, norms) in elements."""
    per_stage = layers // pp
    mats = []
    for _ in range(per_stage):
        mats += [(3 * hidden // tp, hidden), (hidden, hidden // tp),
                 (ffn // tp, hidden), (hidden, ffn // tp)]
    mats.append((vocab // tp, hidden))
    dense_rest = per_stage * (3 * hidden // tp + hidden + ffn // tp + hidden + 4 * hidden)
    return mats, dense_rest


def allreduce_s(nbytes: float, n: int, bandwidth_gbit: float, alpha_us: float) -> float:
    if n < 2:
        return 0.0
    return 2 * (n - 1) * alpha_us * 1e-6 + 2 * (n - 1) / n * nbytes / (bandwidth_gbit * 1e9 / 8)


def sync_bytes(mats, dense_rest: int, rank: Optional[int], grad_bytes: int,
               min_rate: float = 2.0) -> tuple[float, float]:
    """(bytes of the first all-reduce, bytes of the second) for one shard."""
    if rank is None:
        return (sum(n * m for n, m in mats) + dense_rest) * grad_bytes, 0.0
    p_elems, q_elems, rest = 0, 0, dense_rest
    for n, m in mats:
        if is_compressible(n, m, rank, min_rate):
            p_elems += n * rank
            q_elems += m * rank
        else:
            rest += n * m
    return (p_elems + rest) * 4.0, q_elems * 4.0


def predict(cluster: Cluster, schedule: list) -> dict:
    import yaml

    with open(os.path.join(ROOT, cluster.config)) as fh:
        cfg = yaml.safe_load(fh)
    md, par, tr = cfg["model"], cfg["parallel"], cfg["training"]
    layers, hidden, seq = md["num_layers"], md["hidden_size"], md["seq_length"]
    ffn = md.get("ffn_hidden_size") or 4 * hidden
    tp, pp, dp = (par["tensor_model_parallel_size"], par["pipeline_model_parallel_size"],
                  par["data_parallel_size"])
    vocab = 50304
    mats, rest = shard_matrices(layers, hidden, ffn, vocab, tp, pp)
    params = layers * (12 * hidden * hidden + 13 * hidden) + vocab * hidden
    gbs = tr["global_batch_size"]
    micro = gbs // (tr["micro_batch_size"] * dp)
    flops = 6 * params * gbs * seq + 12 * layers * hidden * seq * seq * gbs
    gpus = tp * pp * dp
    compute_s = flops / (gpus * cluster.sustained_tflops * 1e12)
    compute_s *= 1 + (pp - 1) / micro                     # 1F1B bubble
    rows = []
    for rank, share in schedule:
        b1, b2 = sync_bytes(mats, rest, rank, cluster.grad_bytes)
        sync = allreduce_s(b1, dp, cluster.dp_bandwidth_gbit, cluster.alpha_us) + \
            (allreduce_s(b2, dp, cluster.dp_bandwidth_gbit, cluster.alpha_us) if b2 else 0.0)
        rows.append((rank, share, sync, compute_s + sync, b1 + b2))
    dense_b1, _ = sync_bytes(mats, rest, None, cluster.grad_bytes)
    dense_sync = allreduce_s(dense_b1, dp, cluster.dp_bandwidth_gbit, cluster.alpha_us)
    mean_sync = sum(s * sync for _, s, sync, _, _ in rows)
    mean_iter = sum(s * it for _, s, _, it, _ in rows)
    # The DP bandwidth at which dense sync would be 35 % of the iteration (issue 7's bar).
    target = 0.35 / 0.65 * compute_s - 2 * (dp - 1) * cluster.alpha_us * 1e-6
    breakeven_gbit = 2 * (dp - 1) / dp * dense_b1 * 8 / target / 1e9 if target > 0 else None
    return {"cluster": cluster, "params": params, "breakeven_gbit": breakeven_gbit, "compute_s": compute_s,
            "dense_sync_s": dense_sync, "dense_iter_s": compute_s + dense_sync,
            "dense_bytes": dense_b1, "rows": rows, "mean_sync_s": mean_sync,
            "mean_iter_s": mean_iter,
            "comm_reduction": 1 - mean_sync / dense_sync,
            "time_reduction": 1 - mean_iter / (compute_s + dense_sync),
            "sync_share_dense": dense_sync / (compute_s + dense_sync)}


def parse_schedule(text: str) -> list:
    out = []
    for part in text.split(","):
        rank, share = part.split(":")
        out.append((None if rank == "dense" else int(rank), float(share)))
    total = sum(s for _, s in out)
    if abs(total - 1) > 1e-6:
        raise ValueError(f"schedule shares must sum to 1, got {total}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rank-schedule", default="dense:0.02,64:0.18,48:0.3,32:0.5",
                   help="rank:share,... over the run (dense = warm-up)")
    args = p.parse_args()
    schedule = parse_schedule(args.rank_schedule)
    lines = ["| setup (modelled) | params | compute s/iter | dense DP sync s | sync share "
             "| EDGC DP sync | EDGC iteration | paper | DP link where dense sync = 35 % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for cluster in CLUSTERS.values():
        r = predict(cluster, schedule)
        lines.append(
            f"| {cluster.name} | {r['params'] / 1e9:.2f} B | {r['compute_s']:.2f} | "
            f"{r['dense_sync_s']:.3f} | {100 * r['sync_share_dense']:.1f} % | "
            f"−{100 * r['comm_reduction']:.1f} % | −{100 * r['time_reduction']:.1f} % | "
            f"−{100 * PAPER['comm_reduction']:.2f} % / −{100 * PAPER['time_reduction']:.2f} % | "
            f"{r['breakeven_gbit']:.1f} Gbit/s per GPU |")
    body = ("**Modelled, not measured.** Alpha-beta ring all-reduce of the largest (TP, PP) "
            "shard's gradients (fp32; PowerSGD: P + dense rest, then Q, per-matrix rule of the "
            "code), compute = (6·params·tokens + 12·L·h·s²·sequences) / (GPUs × sustained "
            "FLOP/s) × (1 + bubble), DP sync fully exposed (no overlap). Declared: V100 15.7 "
            "TFLOP/s fp32 × 0.6 sustained, 12.5 Gbit/s per GPU (100 Gbit/s EDR shared by 8), "
            "α 20 µs; H100 989 TFLOP/s bf16 × 0.4, 400 Gbit/s per GPU (NDR), α 10 µs. Rank "
            f"schedule (share of iterations): `{args.rank_schedule}`.\n\n" + "\n".join(lines) +
            "\n\nWith these links the DP sync is a few per cent of the iteration, so even a "
            "90 %+ cut in sync latency moves iteration time by a few per cent: the paper's "
            "16 % needs a DP link near the last column (or less overlap-friendly compute). "
            "EDGC's sync reduction here exceeds the paper's 46 % because the model counts "
            "bytes only; the paper's figure includes compression time and its own rank "
            "schedule.")
    from bench.report import write_section

    write_section("cost_model", "Paper-scale cost model (modelled)", "python bench/model.py",
                  body)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
