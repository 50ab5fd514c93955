#!/usr/bin/env python
"""The race's modes priced on a GPT-2 medium GPU cluster: time to the race's target, modeled.

    .venv/bin/python bench/cluster_price.py [--peers bench/results/peers]
    .venv/bin/python bench/cluster_price.py --peers bench/results/peers-2000 --loss-iters 2000

``--loss-iters`` is the length of the recorded loss curves, so the run length priced: the
warm-up weighs what it weighs in a run of that length (EDGC's is bounded at a fraction of
the run). Other than the race's 200 it writes a section of its own beside the race's.

**Measured on CPU** (bench/peers.py's race, ``DIR/loss/*_seed*.jsonl`` via ``peers.collect``):
iterations to ``peers.target_loss`` per mode and seed (linear between evaluations,
``scripts/plot_run.py:time_to_loss``) and EDGC's rank per iteration (``rank_dp``; None: dense).
The tiny model's ranks (r_max 32) are applied to GPT-2 medium's shapes as they are.

**Measured on one H200** (:func:`h200_step`, issue 72: the run of 2026-11-28 after the fp64
orthonormalization, 0 factorizations stood in; ``bench/results/gpu/h200-2026-11-28/``
``medium.json`` and ``medium-rerun.json``, scripts/gpu_check.py's GPT-2 medium checks: 24
layers, hidden 1024, ffn 4096, vocab 50304, seq 1024, micro-batch 8, ``--bf16``, DP 1 with the
compression's math on, 100 iterations): compute = the ``off`` checks' median ms/iter from
iteration 11, per gradient-buffer dtype (fp32 buffers 169.6 ms, bf16 buffers 175.8 ms); the
compressed step's math = the ``static`` checks' median ``compress_ms`` at r64 (fp32 buffers
15.7 ms, bf16 buffers 22.6 ms): ranks 8-32 are priced at r64's math (an upper bound; the EDGC
checks ran other ranks and moved); EDGC's sampler (GDS) = the EDGC checks' largest measured
cost of a sampled iteration (62.8 ms fp32 buffers, 77.3 ms bf16; host clock around the
sampler, the window's index draw included), charged once per window (``sampler_ms``); the
sensitivity rows charge it on every sampled iteration, and the math at x0.5 and x2.

**Modeled**: an iteration = compute + math + DP communication, no overlap (in the JSON too:
``s_overlap``, max(compute, comm) + math, an ideal; and the :data:`SENSITIVITY` variants);
the compute of the mode's gradient buffers (fp32-trained modes as ``--bf16`` with fp32
gradient buffers, Megatron's default). Communication:
``bench/model.py:allreduce_s`` (ring, alpha of its H100 cluster), pure DP over 8 and 64 GPUs
at 10, 25, 100 Gbit/s per GPU; an all-gather of b bytes per rank = half the all-reduce of n·b.
Bytes (``sync_bytes`` on ``shard_matrices`` + position embedding and final norm): dense, one
all-reduce at 4 or 2 bytes per parameter (this product's dense syncs at its default
``--edgc-dense-wire``, bf16 since issue 64, unless the mode names one); ``uint8``,
all-gathers of two fp32 per 512-element channel then the uint8 payload; PowerSGD, P then Q
(ours: bf16 factors, the rest in the gradient dtype; ``hook r_max``: all fp32, its math
assumed ours at that rank: likely low); ``local SGD``, gradient all-reduces for
``--hook-start-iter`` (2) iterations, then the fp32 parameter all-reduce amortized over its
period; DiLoCo (the tuned one where the race ran it), the fp32 pseudo-gradient's all-reduce
amortized over H, a dense warm-up's iterations one fp32 gradient all-reduce each (its
quorum's round trips to the lighthouse unpriced). Priced 0 (lower bounds for those peers):
the bf16 casts, uint8's (de)quantization of n gathered copies.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import peers  # noqa: E402
from bench.model import CLUSTERS, allreduce_s, kernel_s, shard_matrices, sync_bytes  # noqa: E402
from bench.report import write_section  # noqa: E402
from megatron_edgc.config.edgc import EdgcConfig  # noqa: E402

GPUS, LINKS = (8, 64), (10.0, 25.0, 100.0)
ALPHA_US = CLUSTERS["gpt2-12.1b-h100x64"].alpha_us
LAYERS, HIDDEN, FFN, VOCAB, SEQ = 24, 1024, 4096, 50304, 1024
CHANNEL, HOOK_START = 512, 2   # quantization_perchannel_hook's channel; --hook-start-iter
#: The H200 run the step is priced on (:func:`h200_step`).
H200_RUNS = os.path.join(ROOT, "bench", "results", "gpu", "h200-2026-11-28")


def h200_step(folder: str = H200_RUNS) -> dict:
    """The GPT-2 medium step measured on one H200 (scripts/gpu_check.py's checks that
    passed in ``folder``'s ``medium*.json``): ``compute_ms`` and ``gds_ms`` per gradient
    buffer dtype, ``math_ms`` as ``[(rank, buffers, ms)]`` from the static checks (one rank
    throughout; EDGC's checks moved between ranks), ``date`` and ``device``."""
    step = {"compute_ms": {}, "gds_ms": {}, "math_ms": []}
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("medium") and name.endswith(".json")):
            continue
        with open(os.path.join(folder, name)) as fh:
            run = json.load(fh)
        step["device"] = run["environment"]["device"]
        step["date"] = run["environment"]["date"].split()[0]
        for check in run["checks"]:
            kind, buffers = check["check"], check.get("grad_buffers")
            if not check.get("ok") or not kind.startswith("e2e-gpt2-medium-"):
                continue
            mode = kind[len("e2e-gpt2-medium-"):].removesuffix("-bf16grads")
            if mode == "off":
                step["compute_ms"][buffers] = check["ms_per_iter_median"]
            elif mode == "static" and check.get("compress_ms_median"):
                step["math_ms"].append((check["rank_last"][0], buffers,
                                        check["compress_ms_median"]))
            elif mode == "edgc" and check.get("entropy_ms_max"):
                step["gds_ms"][buffers] = check["entropy_ms_max"]
    return step


STEP = h200_step()
KERNELS = {"configs": {"gpt2-medium": {"runs": [
    {"rank": r, "factor_dtype": "bf16", "grad_dtype": g, "total": ms}
    for r, g, ms in STEP["math_ms"]]}}}
#: The sensitivity variants beside the seed spread (issue 72): the step's math at x0.5 and
#: x2, and GDS's largest measured cost charged on every sampled iteration (the table: once
#: per window). name -> (math scale, GDS on every sample).
SENSITIVITY = {"s_math_half": (0.5, False), "s_math_double": (2.0, False),
               "s_gds_every_sample": (1.0, True)}
MODES = peers.modes()   # the race's flags (main() adds the tuned DiLoCo)
#: this product's dense wire where a mode does not name one (issue 64: bf16)
DENSE_WIRE = EdgcConfig().dense_wire


def medium_shapes():
    """GPT-2 medium's weight matrices and dense rest (elements), hashable."""
    mats, rest = shard_matrices(LAYERS, HIDDEN, FFN, VOCAB, 1, 1)
    return tuple(mats) + ((SEQ, HIDDEN),), rest + 2 * HIDDEN   # + position emb., final norm


def n_params(shapes) -> int:
    return sum(n * m for n, m in shapes[0]) + shapes[1]


def flag(mode: str, name: str):
    flags = MODES[mode][1]
    return flags[flags.index(name) + 1] if name in flags else None


def bf16_trained(mode: str) -> bool:
    return "--grad-reduce-in-bf16" in MODES[mode][1]


def compresses(mode: str) -> bool:
    return flag(mode, "--edgc-mode") in ("static", "edgc") or \
        flag(mode, "--hook") in ("powersgd", "powersgd-bf16")


def mode_bytes(mode: str, rank, shapes) -> list:
    """One iteration's collectives ``[(kind, bytes)]`` (all-gather: bytes per rank);
    ``rank`` None: a dense iteration."""
    mats, rest = shapes
    params = n_params(shapes)
    if flag(mode, "--hook") == "quantize":
        chans = -(-params // CHANNEL)
        return [("allgather", chans * 2 * 4), ("allgather", chans * CHANNEL)]
    if rank is None or not compresses(mode):
        wire = flag(mode, "--edgc-dense-wire") or (
            DENSE_WIRE if flag(mode, "--edgc-mode") in ("static", "edgc") else None)
        bf16 = bf16_trained(mode) or "bf16" in (wire, flag(mode, "--hook")) or \
            flag(mode, "--hook") == "powersgd-bf16"   # the wrapper's bf16 warm-up
        return [("allreduce", params * (2 if bf16 else 4))]
    if flag(mode, "--hook") == "powersgd":
        return [("allreduce", b) for b in sync_bytes(mats, rest, rank, 4, factor_bytes=4)]
    b1, b2 = sync_bytes(mats, rest, rank, 4, factor_bytes=2)
    # sync_bytes prices the rest at fp32: at bf16 (bf16 buffers; the hook's bf16 wrapper)
    # it is half
    if bf16_trained(mode) or flag(mode, "--hook") == "powersgd-bf16":
        b1 -= sync_bytes(mats, rest, rank, 4, factor_bytes=0)[0] / 2
    return [("allreduce", b1), ("allreduce", b2)]


def allgather_s(nbytes: float, n: int, gbit: float, alpha_us: float) -> float:
    """Ring all-gather of ``nbytes`` per rank: (n−1)α + (n−1)·bytes/B."""
    return allreduce_s(n * nbytes, n, gbit, alpha_us) / 2


def comm_s(mode: str, rank, iteration: int, n: int, gbit: float, shapes,
           alpha_us: float = ALPHA_US, dense_warmup: bool = False) -> float:
    """Seconds of one iteration's DP communication (local SGD's averaging amortized;
    ``dense_warmup``: a DiLoCo run's dense warm-up iteration, one fp32 gradient all-reduce)."""
    if dense_warmup:
        return allreduce_s(4 * n_params(shapes), n, gbit, alpha_us)
    if flag(mode, "--hook") == "local-sgd":
        whole = allreduce_s(4 * n_params(shapes), n, gbit, alpha_us)
        return whole if iteration <= HOOK_START else whole / int(flag(mode, "--local-sgd-period"))
    if flag(mode, "--hook") == "diloco":   # the fp32 pseudo-gradient, every H steps
        return allreduce_s(4 * n_params(shapes), n, gbit, alpha_us) / int(
            flag(mode, "--diloco-sync-every"))
    return sum((allgather_s if kind == "allgather" else allreduce_s)(b, n, gbit, alpha_us)
               for kind, b in mode_bytes(mode, rank, shapes))


def buffers(mode: str) -> str:
    return "bf16" if bf16_trained(mode) else "fp32"


def sampler_ms(window: int, iter_sample_rate: float, grads: str = "fp32",
               every_sample: bool = False) -> float:
    """EDGC's entropy sampler per iteration, amortized over a window: the H200's largest
    measured sampled iteration once per window (``every_sample``: on each of the window's
    sampled iterations)."""
    samples = -(-window // max(1, round(1 / iter_sample_rate))) if every_sample else 1
    return samples * STEP["gds_ms"][grads] / window


def math_ms(mode: str, rank, scale: float = 1.0) -> float:
    """The compressed step's math (0 for a dense iteration), times ``scale``."""
    if rank is None or not compresses(mode):
        return 0.0
    return scale * 1e3 * kernel_s(KERNELS, "gpt2-medium", rank, "bf16", buffers(mode))


@functools.lru_cache(maxsize=None)
def iteration_ms(mode: str, rank, iteration: int, n: int, gbit: float, overlap: bool = False,
                 sampler: float = 0.0, math_scale: float = 1.0,
                 dense_warmup: bool = False) -> float:
    """compute + math (+ EDGC's ``sampler``) + communication; ``overlap``: max(compute, comm)."""
    comm = 1e3 * comm_s(mode, rank, iteration, n, gbit, medium_shapes(),
                        dense_warmup=dense_warmup)
    compute = STEP["compute_ms"][buffers(mode)]
    return (max(compute, comm) if overlap else compute + comm) + \
        math_ms(mode, rank, math_scale) + sampler


def price_run(mode, records, target, n, gbit, overlap=False, sampler=0.0,
              math_scale=1.0) -> dict:
    """One loss run priced: mean ms/iter over the run, seconds and iterations to target."""
    sampler = sampler if flag(mode, "--edgc-mode") == "edgc" else 0.0
    # a DiLoCo run's dense warm-up (peers.mark_dense_warmup; EDGC's is priced by its ranks)
    warm = peers.warmup_end(records) if flag(mode, "--hook") == "diloco" else 0
    ms = [iteration_ms(mode, peers.dp_rank(r), min(r["iteration"], HOOK_START + 1), n, gbit, overlap,
                       sampler, math_scale, r["iteration"] <= warm) for r in records]
    priced = [dict(r, iter_ms=m) for r, m in zip(records, ms)]
    return {"ms": float(numpy.mean(ms)), "s": peers.time_to_loss(priced, target),
            "iters": peers.time_to_loss([dict(r, iter_ms=1e3) for r in records], target)}


def price(data: dict, window: int, rate: float) -> dict:
    """``{"target", "rows": [...], "unpriced": {mode: why}}`` for every mode of the race;
    ratios per seed against the fastest peer (median) of the same training precision."""
    target = peers.target_loss(data)
    out = {"target": target, "rows": [], "unpriced": {}}
    # name -> (overlap, math scale, GDS on every sample)
    variants = {"s": (False, 1.0, False), "s_overlap": (True, 1.0, False),
                **{k: (False, m, e) for k, (m, e) in SENSITIVITY.items()}}
    for mode in MODES:
        seeds = data["loss"].get(mode)
        if not seeds or target is None:
            out["unpriced"][mode] = "no loss run recorded" if not seeds else "no target"
            continue
        ours = mode in peers.OURS or mode.startswith(("static", "EDGC"))
        for n in GPUS:
            for gbit in LINKS:
                runs = {v: [price_run(mode, recs, target, n, gbit, ov,
                                      sampler_ms(window, rate, buffers(mode), every), scale)
                            for recs in seeds.values()]
                        for v, (ov, scale, every) in variants.items()}
                out["rows"].append({
                    "mode": mode, "gpus": n, "gbit": gbit, "ours": ours,
                    "precision": "bf16" if bf16_trained(mode) else "fp32", "seeds": list(seeds),
                    "iters": [r["iters"] for r in runs["s"]],
                    "ms_per_iter": [r["ms"] for r in runs["s"]],
                    **{v: [r["s"] for r in rs] for v, rs in runs.items()}})
    for row in out["rows"]:
        key = (row["gpus"], row["gbit"], row["precision"])
        peer = [r for r in out["rows"] if (r["gpus"], r["gbit"], r["precision"]) == key
                and not r["ours"] and None not in r["s"]]
        if peer:
            best = peers.fastest_peer({r["mode"]: {(s, 0): t for s, t in zip(r["seeds"], r["s"])}
                                       for r in peer})
            best = next(r for r in peer if r["mode"] == best)
            row["best_peer"] = best["mode"]
            row["vs_best_peer"] = paired_by_seed(row, best, "s")
            row["sensitivity"] = {v: paired_by_seed(row, best, v) for v in SENSITIVITY}
    return out


def paired_by_seed(row: dict, best: dict, key: str) -> list:
    """``row``'s ``key`` seconds over ``best``'s, seed by seed (the seeds both ran)."""
    theirs = dict(zip(best["seeds"], best[key]))
    return [a and a / theirs[s] for s, a in zip(row["seeds"], row[key]) if s in theirs]


# ---------------------------------------------------------------- output

def table(result: dict, n: int) -> str:
    lines = ["| mode | trained | iterations to target | " + " | ".join(
        f"{g:g} Gbit/s: ms/iter | s to target | vs best peer" for g in LINKS) + " |",
        "|" + "---|" * (3 + 3 * len(LINKS))]
    for mode in MODES:
        rows = {r["gbit"]: r for r in result["rows"] if r["mode"] == mode and r["gpus"] == n}
        if not rows and "no loss run" in str(result["unpriced"].get(mode)):
            continue   # a mode not in this race (a long race runs the closest only)
        if not rows:
            lines.append(f"| {mode} | — | not priced: {result['unpriced'].get(mode)} |"
                         + " — |" * (3 * len(LINKS)))
            continue
        cells = []
        for r in (rows[g] for g in LINKS):
            vs, s = r.get("vs_best_peer"), r["s"]
            cells += [peers.spread(r["ms_per_iter"], ".0f"), peers.spread(s) if None not in s
                      else f"not reached in {s.count(None)} of {len(s)}",
                      "—" if not vs or None in vs else "1 (best peer)"
                      if r["best_peer"] == mode else peers.ratio_verdict(vs)]
        first = rows[LINKS[0]]
        lines.append(f"| {mode}{'' if first['ours'] else ' (peer)'} | {first['precision']} | "
                     f"{peers.iters_cell(first['iters'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SENSITIVITY_NAMES = {"s": "as measured", "s_math_half": "math x0.5",
                     "s_math_double": "math x2", "s_gds_every_sample": "GDS on every sample"}


def sensitivity_table(result: dict, n: int) -> str:
    """This product's modes against the best peer of their precision, as measured and in
    each :data:`SENSITIVITY` variant (the peer priced in the same variant)."""
    lines = ["| mode | variant | " + " | ".join(f"{g:g} Gbit/s vs best peer" for g in LINKS)
             + " |", "|" + "---|" * (2 + len(LINKS))]
    for mode in MODES:
        rows = {r["gbit"]: r for r in result["rows"] if r["mode"] == mode and r["gpus"] == n
                and r["ours"] and r.get("vs_best_peer")}
        if len(rows) < len(LINKS):
            continue
        for v, label in SENSITIVITY_NAMES.items():
            cells = []
            for g in LINKS:
                ratios = rows[g]["vs_best_peer"] if v == "s" else rows[g]["sensitivity"][v]
                cells.append("—" if None in ratios else peers.ratio_verdict(ratios))
            lines.append(f"| {mode} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Time to target against the link, one line per mode (timing-only twins left out)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(GPUS), figsize=(6 * len(GPUS), 4.5), sharey=True)
    for ax, n in zip(axes, GPUS):
        for mode in (m for m in MODES if m not in peers.LOSS_OF):
            rows = [r for r in result["rows"] if r["mode"] == mode and r["gpus"] == n
                    and None not in r["s"]]
            if rows:
                ax.plot([r["gbit"] for r in rows], [numpy.median(r["s"]) for r in rows],
                        "-o" if rows[0]["ours"] else "--s", label=mode, ms=4)
        ax.set(xscale="log", yscale="log", xlabel="link per GPU, Gbit/s",
               title=f"GPT-2 medium, {n} {STEP['device'].split()[-1]} (modeled)")
        ax.set_xticks(LINKS, [f"{g:g}" for g in LINKS])
    axes[0].set_ylabel("time to target, s (median over seeds)")
    axes[-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peers", default=os.path.join(ROOT, "bench", "results", "peers"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cluster_price"))
    p.add_argument("--loss-iters", type=int, default=200,
                   help="the length of the loss curves in --peers (bench/peers.py "
                        "--loss-iters): the run length priced; other than 200 its own "
                        "section, beside the race's")
    args = p.parse_args()
    global MODES
    peers.load_tuned(args.peers)   # the tuned DiLoCo, where the race ran it
    MODES = peers.modes()
    with open(os.path.join(ROOT, peers.CONFIG)) as fh:
        edgc = yaml.safe_load(fh)["edgc"]
    window, rate = edgc["window"], edgc["iter_sample_rate"]
    result = price(peers.collect(args.peers, args.loss_iters, 40), window, rate)
    if result["target"] is None:
        raise SystemExit(f"no target: {args.peers} lacks the dense runs")
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.loss_iters == 200 else f"_{args.loss_iters}"
    png = os.path.join(args.out, f"time_to_target{suffix}.png")
    result.update(step=STEP, alpha_us=ALPHA_US, peers_dir=os.path.relpath(args.peers, ROOT),
                  sampler_ms={g: sampler_ms(window, rate, g) for g in STEP["gds_ms"]})
    with open(os.path.join(args.out, f"cluster_price{suffix}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    plot(result, png)
    png = os.path.relpath(png, ROOT)
    compute = ", ".join(f"{ms:.1f} ms ({g} buffers)" for g, ms in sorted(STEP["compute_ms"].items()))
    maths = ", ".join(f"r{r} {ms:.1f} ms ({g} buffers)" for r, g, ms in STEP["math_ms"])
    gds = ", ".join(f"{ms:.1f} ms ({g} buffers)" for g, ms in sorted(STEP["gds_ms"].items()))
    body = (f"**Modeled** (inputs and assumptions: bench/cluster_price.py's docstring). "
            f"Loss curves of {args.loss_iters} iterations; iterations to the race's target "
            f"({result['target']:.4f}; `{result['peers_dir']}`;"
            f" median (min–max) over seeds) measured on the CPU race's tiny GPT-2; each "
            f"iteration priced as GPT-2 medium on {STEP['device']}s, the step measured on one "
            f"({STEP['date']}, `{os.path.relpath(H200_RUNS, ROOT)}`): compute {compute}; the "
            f"compressed step's math {maths} (lower ranks at r64's); EDGC's entropy sampler "
            f"(GDS) at its largest measured sampled iteration, {gds}, once per window of "
            f"{window}; pure DP ring all-reduce (alpha {ALPHA_US:g} us), no overlap of "
            f"communication with compute. Ratios: per seed, against the fastest peer trained "
            f"in the same precision; faster or slower only where every seed's ratio is on one "
            f"side of 1. Plot: [{png}]({png}); the overlap ideal is in the JSON.\n\n"
            + "\n\n".join(f"**{n} GPUs**\n\n{table(result, n)}" for n in GPUS)
            + "\n\n**Sensitivity** (the seed spread beside the model's: the step's math "
              "halved and doubled, GDS's largest sampled iteration charged on every sampled "
              "iteration instead of once per window; the peers priced in the same variant)\n\n"
            + "\n\n".join(f"*{n} GPUs*\n\n{sensitivity_table(result, n)}" for n in GPUS)
            + "\n\n<!-- notes -->")
    title = "Price on a GPU cluster: GPT-2 medium, time to target (modeled)"
    command = ".venv/bin/python bench/cluster_price.py"
    if suffix:
        title += f", {args.loss_iters}-iteration runs"
        command += f" --peers {result['peers_dir']} --loss-iters {args.loss_iters}"
    write_section(f"cluster_price{suffix}", title, command, body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
