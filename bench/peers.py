#!/usr/bin/env python
"""EDGC against what a user would run instead, by time to a target validation loss.

    .venv/bin/python bench/peers.py             # ~110 min on 2 cores (root: netns); finished runs reused
    .venv/bin/python bench/peers.py --report-only
    .venv/bin/python bench/peers.py --phase tune-diloco --loss-iters 2000   # first: DiLoCo's grid

Same model (``configs/tiny-cpu.yaml`` at TP1·PP1·DP4, so PyTorch DDP runs the same layout),
same data and seeds. Two precisions, and ratios only within one:

* **trained in fp32.** PyTorch's peers cannot train in bf16 mixed precision here
  (``torch.autocast`` fails in megatron-core's linear layers on CPU, and bf16 parameters
  without fp32 main weights are not what a user runs), so they train in fp32 and a bf16
  reduction goes on the wire through ``bf16_compress_hook``. Modes: ``dense fp32``
  (megatron-core's all-reduce), ``torch DDP fp32`` (torch DDP's; timed only, its loss curve
  is dense fp32's), ``bf16 wire`` (``bf16_compress_hook``), ``ours dense bf16 wire`` (this
  product's dense sync on a bf16 wire, ``--edgc-dense-wire bf16``: the warm-up's and the
  bypass's; timed only, its curve is bf16 wire's), ``uint8``
  (``quantization_perchannel_hook``'s algorithm), ``hook r_max`` (``powerSGD_hook``),
  ``hook r_max bf16`` (``powerSGD_hook`` in ``bf16_compress_wrapper``: bf16 factors),
  ``local SGD /8`` (``PostLocalSGDOptimizer`` + ``PeriodicModelAverager``, every 8 steps),
  ``DiLoCo H8`` / ``DiLoCo H32`` (torchft's ``DiLoCo`` with its own lighthouse, started
  by the peer: inner AdamW, outer Nesterov lr 0.7 momentum 0.9, a sync every H steps)
  and ``Streaming DiLoCo H32/4`` (4 fragments, each sync overlapping one inner step);
  ``DiLoCo H8 tuned`` / ``H32 tuned`` after ``--phase tune-diloco`` (``diloco_grid`` on
  the tuning seed, searched in two stages: ``tuning_stages``; the lowest final val loss of
  the global model: ``choose_tuned``; timed as the paper-setting DiLoCo of its H:
  ``timed_as``, a dense warm-up's iterations priced as dense fp32's: ``mark_dense_warmup``),
  ``static r_max`` (this
  product's PowerSGD at a fixed rank), ``EDGC`` (the paper controller with its default
  flags: dense warm-up bounded at 10 % of the run, the residual's dtype ``auto``);
* **trained in bf16** (``--bf16 --grad-reduce-in-bf16``, Megatron-LM's bf16 mixed precision
  with bf16 gradient buffers): ``dense bf16`` (megatron-core's bf16 all-reduce, the peer),
  ``static r_max bf16``, ``EDGC bf16 grads``.

``hook r_max bf16 model`` (``powerSGD_hook`` with bf16 factors on a bf16 model: torch
DDP's parameters in bf16, stepped by its AdamW without fp32 main weights) is the
compressing bf16 peer.

This product's modes run as they ship (issue 80): the bypass at ``auto``, EDGC's windows,
sampling and warm-up from the config, the same flags in the loss and the timing runs.

Two kinds of runs, composed, the timing first:

1. **Timing** per link (100 Mbit, 300 Mbit, 1 Gbit; tbf-shaped veth, one namespace per
   rank, bench/netns.py): each mode's loss-run config stopped after ``--time-iters``
   iterations (96: whole outer rounds of every DiLoCo and local SGD, EDGC's dense warm-up
   and two windows), 3 repetitions interleaved (every mode once per repetition), in one
   timing session per precision on one version of the timed code (``timing_session``:
   runs of other code are moved aside, never reused; bf16 on a CPU with bf16
   instructions, which the fp32 session's need not be; the section names each session's
   code, start and CPU), its steady ms/iter (after its warm-up, over whole outer rounds), DP sync, bytes
   and the bypass's decisions (:func:`dense_share`). EDGC's dense warm-up iterations of
   the loss run are priced at the mode's own measured warm-up ms/iter (iterations 3 to
   its end).
2. **Loss curves**: each mode, 5 seeds (``--seed 1234+i``), ``--loss-iters`` iterations
   (200), an evaluation every 5 % of the run (a DiLoCo or local SGD at the last round's
   end before each: bench/torch_ddp_peers.py ``eval_schedule``), on loopback; a mode
   whose bypass decides (:data:`BYPASSING`) once per link, with the link its timing
   measured declared to the bypass (:func:`declared_link`), so that its curve takes the
   decisions it takes on that link (the run's records show each one).

Time to target: dense fp32's validation loss at 75 % of its run, the highest over the
seeds: a loss every dense and peer run reaches well before its last evaluation (the first
two races' target, the worst final loss of the dense modes, sat at the end of the curves,
and a mode equal to dense missed it by a seed's noise; it stays in a column). Each mode's
time is its loss run's iterations priced at its measured ms/iter per link, interpolated
between evaluations (scripts/plot_run.py). Ratios are against the fastest peer of the same
precision (peers: every mode that is not this product's), and EDGC against static r_max of
its precision, paired per seed and repetition; a ratio range that spans 1 is not
resolved (the race's one rule: ``ratio_verdict``). Every record carries its code stamp
(issue 93: the commit and a hash of any uncommitted diff, ``bench/report.py``
``code_stamp``); no time or ratio is priced across runs that differ in a file both execute
(``code_conflict``, :data:`EXECUTES`), and the section names each mode's stamps (runs
recorded before stamps: "unstamped"). Writes ``bench/results/peers/`` and the ``peers``
section of BENCHMARKS.md,
from all recorded runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import sys

import numpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench.netns import NetnsUnavailable, ShapedNetwork  # noqa: E402
from bench.report import run_pretrain, write_section  # noqa: E402
from plot_run import time_to_loss  # noqa: E402

CONFIG, R_MAX, R_MIN = "configs/tiny-cpu.yaml", 32, 8
PURE_DP = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
           "--data-parallel-size", "4"]
RATES = ["100mbit", "300mbit", "1gbit"]
SEEDS = [1234, 1235, 1236, 1237, 1238]
REPEATS = 3   # issue 72: at least 3, interleaved (every mode once per repetition)
EVAL_EVERY = 20
OURS = ("ours dense bf16 wire", "static r_max", "EDGC", "static r_max bf16", "EDGC bf16 grads")
#: The modes trained in bf16 (bf16 mixed precision, bf16 gradient buffers); the rest fp32.
#: Ratios are taken within a precision.
BF16_TRAINED = ("dense bf16", "static r_max bf16", "EDGC bf16 grads", "hook r_max bf16 model")
#: The bf16-trained peers with bf16 parameters only (torch DDP: no fp32 main weights).
BF16_MODEL = ("hook r_max bf16 model",)
#: This product's modes whose bypass decides per link (``--edgc-bypass auto``): their loss
#: runs are per link, on loopback with the link the timing measured declared to the bypass
#: (:func:`declared_link`), so each link's curve takes that link's decisions.
BYPASSING = ("static r_max", "EDGC", "static r_max bf16", "EDGC bf16 grads")
#: The static PowerSGD each precision's EDGC must be no slower than.
STATIC_OF = {"fp32": "static r_max", "bf16": "static r_max bf16"}
#: The target: dense fp32's val loss at this fraction of the run (the highest over seeds).
TARGET_FRACTION = 0.75
TRAINER, DDP = "pretrain_gpt2_edgc.py", "bench/torch_ddp_peers.py"


def precision(mode: str) -> str:
    return "bf16" if mode in BF16_TRAINED else "fp32"


def edgc_flags(controller: str) -> list:
    """EDGC as it ships on the race's config: its windows, sampling and warm-up bound
    (``configs/tiny-cpu.yaml``), the bypass at the product's default (auto), in the loss
    and the timing runs alike (issue 80)."""
    return ["--edgc-mode", "edgc", "--edgc-controller", controller, "--edgc-bypass", "auto",
            "--edgc-rank-max", str(R_MAX), "--edgc-rank-min", str(R_MIN)]


#: The dense syncs in bf16 (the warm-up's, the bypass's, the uncompressed rest's): the
#: wire of the fastest dense peer, on the fp32 buffers every mode here trains with.
BF16_DENSE = ["--edgc-dense-wire", "bf16"]
#: bf16 mixed precision with bf16 gradient buffers (Megatron-LM's --grad-reduce-in-bf16):
#: every dense sync is bf16 already; its fair peer is bf16 on the wire.
BF16_GRADS = ["--bf16", "--grad-reduce-in-bf16"]
#: The fp32 modes say so: unset, the trainer's precision follows the CPU (bf16 where it has
#: bf16 instructions, issue 80), which trained them in bf16 on such a CPU.
FP32 = ["--no-bf16"]


def modes() -> dict:
    """name -> (script, flags), every mode's precision set (:func:`precision`)."""
    static = ["--edgc-mode", "static", "--edgc-start-iter", "2", "--edgc-bypass", "auto"]
    table = {
        # trained in fp32
        "dense fp32": (TRAINER, ["--edgc-mode", "off"]),
        "torch DDP fp32": (DDP, ["--hook", "allreduce"]),
        # this product's dense sync on a bf16 wire (the warm-up's, the bypass's): a static
        # run that never starts compressing
        "ours dense bf16 wire": (TRAINER, ["--edgc-mode", "static", "--edgc-rank", str(R_MAX),
                                           "--edgc-start-iter", "1000000", *BF16_DENSE]),
        "bf16 wire": (DDP, ["--hook", "bf16"]),
        "uint8": (DDP, ["--hook", "quantize"]),
        "hook r_max": (DDP, ["--hook", "powersgd", "--hook-rank", str(R_MAX)]),
        # the hook in PyTorch's bf16_compress_wrapper: bf16 factors, as EDGC's
        "hook r_max bf16": (DDP, ["--hook", "powersgd-bf16", "--hook-rank", str(R_MAX)]),
        "local SGD /8": (DDP, ["--hook", "local-sgd", "--local-sgd-period", "8"]),
        "DiLoCo H8": (DDP, ["--hook", "diloco", "--diloco-sync-every", "8"]),
        "DiLoCo H32": (DDP, ["--hook", "diloco", "--diloco-sync-every", "32"]),
        # the settings --phase tune-diloco chose on the tuning seed, beside the paper's
        **{f"DiLoCo H{h} tuned": (DDP, t["flags"]) for h, t in sorted(TUNED.items())},
        "Streaming DiLoCo H32/4": (DDP, ["--hook", "diloco", "--diloco-sync-every", "32",
                                         "--diloco-fragments", "4",
                                         "--diloco-fragment-sync-delay", "1"]),
        "static r_max": (TRAINER, static + ["--edgc-rank", str(R_MAX)]),
        "EDGC": (TRAINER, edgc_flags("paper")),
        # trained in bf16 (megatron-core's bf16 mixed precision, bf16 gradient buffers)
        "dense bf16": (TRAINER, ["--edgc-mode", "off", *BF16_GRADS]),
        "static r_max bf16": (TRAINER, static + ["--edgc-rank", str(R_MAX), *BF16_GRADS]),
        "EDGC bf16 grads": (TRAINER, edgc_flags("paper") + BF16_GRADS),
        # a compressing bf16 peer (issue 80): the hook's bf16 factors on a bf16 model (torch
        # DDP, bf16 parameters stepped by torch's AdamW: no fp32 main weights)
        "hook r_max bf16 model": (DDP, ["--hook", "powersgd-bf16", "--hook-rank", str(R_MAX),
                                        "--bf16"]),
    }
    return {name: (script, flags + (FP32 if precision(name) == "fp32" else []))
            for name, (script, flags) in table.items()}


#: Timing-only modes: their loss curve is this mode's (the same math).
LOSS_OF = {"torch DDP fp32": "dense fp32", "ours dense bf16 wire": "bf16 wire"}




def on_link(name: str, rate: str) -> bool:
    """Whether mode ``name`` runs on ``rate`` (a mode named "... @RATE" only there)."""
    return "@" not in name or name.endswith("@" + rate)


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("/", "per")


def eval_interval(iters: int) -> int:
    """An evaluation every 20 iterations, every 5 % of a long run."""
    return max(EVAL_EVERY, iters // 20) if iters >= 100 else iters


def base_flags(iters: int, seed: int) -> list:
    return ["--config", os.path.join(ROOT, CONFIG), *PURE_DP, "--seed", str(seed),
            "--eval-interval", str(eval_interval(iters)), "--eval-iters", "5",
            "--lr-warmup-iters", str(max(2, iters // 10))]


def run_losses(out: str, iters: int, only=None, seeds=SEEDS, rates=RATES) -> None:
    """Each mode's loss curve per seed, on loopback; a :data:`BYPASSING` mode's once per
    link, that link's measured model declared (:func:`declared_link`: time it first)."""
    for seed in seeds:
        for name, (script, flags) in modes().items():
            if (only and name not in only) or name in LOSS_OF:
                continue
            for rate in rates if name in BYPASSING else [None]:
                link = [] if rate is None else declared_link(out, rate, name)
                if link is None:
                    print(f"=== {name} @{rate}: no timing run measured the link yet "
                          f"(--phase time first)", flush=True)
                    continue
                run = f"{slug(name)}{'' if rate is None else '@' + rate}_seed{seed}"
                fresh = not os.path.exists(os.path.join(out, "loss", f"{run}.summary.json"))
                run_pretrain(run, base_flags(iters, seed) + flags + link,
                             os.path.join(out, "loss"), iters, reuse=True, script=script)
                if fresh:
                    record_loss_machine(out, run)


def record_loss_machine(out: str, run: str) -> None:
    """The machine loss run ``run`` ran on, into ``out/loss/machines.json``: a long race's
    loss runs span sessions, and machines (the timing names its own)."""
    from bench.report import machine

    path = os.path.join(out, "loss", "machines.json")
    seen = {}
    if os.path.exists(path):
        with open(path) as fh:
            seen = json.load(fh)
    seen[run] = machine()
    with open(path, "w") as fh:
        json.dump(seen, fh, indent=1, sort_keys=True)


def loss_machines(out: str) -> str:
    """The machines of the recorded loss runs, with their counts (those run before
    machines were recorded counted apart)."""
    runs = [os.path.basename(p)[:-len(".summary.json")]
            for p in glob.glob(os.path.join(out, "loss", "*.summary.json"))]
    path = os.path.join(out, "loss", "machines.json")
    seen = {}
    if os.path.exists(path):
        with open(path) as fh:
            seen = json.load(fh)
    counts = {}
    for run in runs:
        key = seen.get(run, "not recorded")
        counts[key] = counts.get(key, 0) + 1
    order = sorted(counts.items(), key=lambda kv: (kv[0] == "not recorded", -kv[1], kv[0]))
    return "; ".join(f"{m}: {n}" for m, n in order)


def declared_link(out: str, rate: str, mode: str):
    """The link mode ``mode``'s timing runs on ``rate`` measured, as the bypass's flags
    (``--edgc-link-gbps``, ``--edgc-link-latency-ms``: the median over the repetitions of
    each run's last refit); None before a timing run recorded one. A loss run on loopback
    given them decides as on that link (tests/test_netns.py checks it)."""
    links = []
    folder = os.path.join(time_folder(out, precision(mode)), rate)
    for path in sorted(glob.glob(os.path.join(folder, f"{slug(mode)}_rep*.jsonl"))):
        with open(path) as fh:
            last = [r for r in map(json.loads, filter(str.strip, fh)) if "dp_link_alpha_ms" in r]
        if last:
            links.append((last[-1]["dp_link_gbps"], last[-1]["dp_link_alpha_ms"]))
    if not links:
        return None
    gbps, alpha = (float(numpy.median(v)) for v in zip(*links))
    return ["--edgc-link-gbps", f"{gbps:.6g}", "--edgc-link-latency-ms", f"{alpha:.6g}"]


#: DiLoCo's tuning (issue 72), on a seed no verdict uses, per H: the outer step (lr,
#: momentum; the scaling-law study's range, arXiv 2503.09799, and below), the inner lr at 1x
#: and 0.5x dense's, a dense warm-up arm (the warm-up EDGC gets, its time charged to it),
#: and plain averaging (outer lr 1, no momentum: LocalSGD's) as the floor.
TUNE_SEED = 1239
TUNE_H = (8, 32)
OUTER_STEPS = [(0.3, 0.9), (0.5, 0.9), (0.7, 0.9), (1.0, 0.5), (1.0, 0.8), (1.0, 0.0)]
#: Tuned settings (``--phase tune-diloco`` writes them; :func:`modes` races them).
TUNED: dict = {}


def edgc_dense_iters(iters: int) -> int:
    """The dense warm-up EDGC gets in an ``iters`` run at the race's config: its bound, the
    first window end from ``warmup_max_fraction`` of the run (what the loss runs record
    as ``dense_end_iter``)."""
    import yaml

    with open(os.path.join(ROOT, CONFIG)) as fh:
        edgc = yaml.safe_load(fh)["edgc"]
    window = edgc["window"]
    return max(window, -(-int(edgc["warmup_max_fraction"] * iters) // window) * window)


def diloco_grid(h: int, iters: int) -> dict:
    """name -> peer flags of DiLoCo's tuning grid at ``h`` for an ``iters`` run."""
    import yaml

    with open(os.path.join(ROOT, CONFIG)) as fh:
        training = yaml.safe_load(fh)["training"]
    grid = {}
    for scale in (1.0, 0.5):
        inner = ["--lr", f"{training['lr'] * scale:g}",
                 "--min-lr", f"{training['min_lr'] * scale:g}"]
        arms = [(lr, m, 0) for lr, m in OUTER_STEPS] + [(0.7, 0.9, edgc_dense_iters(iters))]
        for lr, m, warmup in arms:
            grid[arm_name(h, lr, m, scale, warmup)] = [
                "--hook", "diloco", "--diloco-sync-every", str(h),
                "--diloco-outer-lr", str(lr), "--diloco-outer-momentum", str(m),
                "--diloco-warmup-iters", str(warmup), *inner]
    return grid


def arm_name(h: int, lr: float, momentum: float, scale: float, warmup: int) -> str:
    return (f"DiLoCo H{h} outer {lr:g}/{momentum:g} inner x{scale:g}"
            + (f" after {warmup} dense" if warmup else ""))


def choose_tuned(final_val: dict) -> str:
    """The rule: the lowest final validation loss of the global model on the tuning seed
    (the name sorts first among equals)."""
    return min(sorted(final_val), key=lambda name: final_val[name])


def tuning_stages(grid: dict) -> tuple[list, callable]:
    """The search, staged for 2 cores: every outer step (and the warm-up arm) at the inner
    lr 1x, then the best of those at 0.5x; returns (the first stage's names, best -> its
    0.5x twin)."""
    first = [n for n in grid if " inner x1" in n]
    return first, lambda best: best.replace(" inner x1", " inner x0.5")


def tune_diloco(out: str, iters: int) -> dict:
    """Run the staged grid (:func:`tuning_stages`) for each H of :data:`TUNE_H` on
    :data:`TUNE_SEED` (finished runs reused); ``{H: {"chosen", "flags", "final_val"}}``
    into ``out/diloco_tuning.json`` (the arms not run: None)."""
    result = {}
    for h in TUNE_H:
        grid, finals = diloco_grid(h, iters), {}

        def run(name):
            records, _ = run_pretrain(f"{slug(name)}_seed{TUNE_SEED}",
                                      base_flags(iters, TUNE_SEED) + grid[name],
                                      os.path.join(out, "tune"), iters, reuse=True, script=DDP)
            finals[name] = final_val(records)
        first, halved = tuning_stages(grid)
        for name in first:
            run(name)
        run(halved(choose_tuned({n: v for n, v in finals.items() if v is not None})))
        chosen = choose_tuned({n: v for n, v in finals.items() if v is not None})
        result[str(h)] = {"chosen": chosen, "flags": grid[chosen],
                          "final_val": {n: finals.get(n) for n in grid}}
    with open(os.path.join(out, "diloco_tuning.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    return result


def tuning_table(tuning: dict) -> str:
    """``diloco_tuning.json`` as a table: per H and outer step, the final validation loss
    of the global model on :data:`TUNE_SEED` at the inner lr 1x and 0.5x (the chosen in
    bold; "not run": the staged search tried only the best outer step at 0.5x)."""
    lines = ["| H | outer lr / momentum | inner lr x1 | inner lr x0.5 |", "|---" * 4 + "|"]
    for h, t in sorted(tuning.items(), key=lambda kv: int(kv[0])):
        vals = t["final_val"]
        for name in (n for n in vals if " inner x1" in n):
            cells = []
            for arm in (name, name.replace(" inner x1", " inner x0.5")):
                v = vals.get(arm)
                cell = "not run" if v is None else f"{v:.4f}"
                cells.append(f"**{cell}** (chosen)" if arm == t["chosen"] else cell)
            outer = name.removeprefix(f"DiLoCo H{h} outer ").replace(" inner x1", "")
            lines.append(f"| {h} | {outer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diloco_rounds(out: str) -> dict:
    """Over every DiLoCo run under ``out`` (tuning and race): ``{"runs", "rounds",
    "discarded", "val_on"}``, the rounds torchft discarded (``should_commit`` false) summed
    and where each run was evaluated (runs recorded before these fields: left out)."""
    runs = rounds = discarded = 0
    val_on = set()
    for path in sorted(glob.glob(os.path.join(out, "*", "DiLoCo*.summary.json"))):
        with open(path) as fh:
            summary = json.load(fh)
        if "diloco_rounds" not in summary:
            continue
        runs += 1
        rounds += summary["diloco_rounds"]
        discarded += summary["diloco_discarded_rounds"]
        val_on.add(summary.get("val_on"))
    return {"runs": runs, "rounds": rounds, "discarded": discarded,
            "val_on": sorted(v for v in val_on if v)}


def diloco_section(out: str) -> str:
    """The report's paragraph on DiLoCo's tuning and rounds ("" before the tuning ran)."""
    if not TUNED:
        return ""
    r = diloco_rounds(out)
    chosen = "; ".join(f"H{h}: {t['chosen'].removeprefix(f'DiLoCo H{h} ')}"
                       for h, t in sorted(TUNED.items(), key=lambda kv: int(kv[0])))
    return (f"\n\nDiLoCo's tuning (`--phase tune-diloco`) on seed {TUNE_SEED}, which no "
            f"verdict uses: final validation loss of the global model per setting, the "
            f"lowest chosen per H ({chosen}) and raced as \"DiLoCo H<H> tuned\" (its per-"
            f"iteration cost the paper-setting DiLoCo's of its H, a dense warm-up's "
            f"iterations dense fp32's):\n\n{tuning_table(TUNED)}\n\n"
            f"Rounds torchft discarded (`should_commit` false): {r['discarded']} of "
            f"{r['rounds']} outer rounds over {r['runs']} DiLoCo runs (tuning and race), "
            f"each evaluated on {' / '.join(r['val_on']) or '?'}.")


def diloco_warmup(flags: list) -> int:
    """The dense iterations a DiLoCo run's flags put before its first inner loop (0: none)."""
    return int(flags[flags.index("--diloco-warmup-iters") + 1]) \
        if "--diloco-warmup-iters" in flags else 0


def timed_as(mode: str, flags: list) -> str:
    """The timed mode whose per-iteration cost ``mode`` has: a tuned DiLoCo runs the code
    path and bytes of the paper-setting DiLoCo at its H (learning rates and momentum change
    no per-iteration cost; a dense warm-up's iterations are priced as dense ones:
    :func:`mark_dense_warmup`); any other mode, itself."""
    return mode.removesuffix(" tuned") if mode.endswith(" tuned") else mode


def mark_dense_warmup(records: list, dense_iters: int) -> list:
    """A DiLoCo run with a dense warm-up records no end of it (bench/torch_ddp_peers.py):
    its flags say ``dense_iters``; the record of that iteration gets ``dense_end_iter``, as
    EDGC's does, so :func:`priced` charges those iterations at the dense warm-up's cost."""
    return [dict(r, dense_end_iter=dense_iters) if r["iteration"] == dense_iters else r
            for r in records]


#: What a timing run executes: a commit touching none of it (docs, tests, the report)
#: keeps the session going.
#: Every file a timed run executes (issue 80): the package, the trainer and its configs, the
#: benchmark's own code (this file, the peers' trainer, the shaped links, the report) and
#: the pricing of the loss curves; the committed results are data, not code.
TIMED_CODE = ["megatron_edgc", "pretrain_gpt2_edgc.py", "configs", "bench",
              ":(exclude)bench/results", "scripts/plot_run.py"]


def code_version() -> str:
    """The code the timing prices: the last commit that changed :data:`TIMED_CODE`,
    ``-dirty`` with local changes to it."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    return git("log", "-1", "--format=%h", "--abbrev=12", "--", *TIMED_CODE) + (
        "-dirty" if git("status", "--porcelain", "-uno", "--", *TIMED_CODE) else "")


#: The files a mode's process executes (issue 93), by the script it runs: the package
#: (``configs`` is a link into it) and the script itself. The rule is conservative and
#: needs no import tracing: any change in the package counts for every mode, a change in
#: one script only for the modes that run it. The bench's own code (this file, the shaped
#: links, the pricing) runs in the bench's process, one version per report, not the mode's.
EXECUTES = {TRAINER: ("megatron_edgc", "configs", TRAINER),
            DDP: ("megatron_edgc", "configs", DDP)}


@functools.lru_cache(maxsize=None)
def _committed_changes(a: str, b: str, paths: tuple):
    """The files of ``paths`` changed between commits ``a`` and ``b``; None where git does
    not know one of them."""
    if a == b:
        return ()
    from bench.report import _git

    out = _git("diff", "--name-only", a, b, "--", *paths)
    return None if out is None else tuple(out.split())


def stamps_differ(a: dict, b: dict, paths) -> list:
    """The files of ``paths`` whose code may differ between two stamped runs (issue 93):
    those changed between their commits, and, unless both ran the same commit with the
    same uncommitted diff, every file either diff touched; ``["commit X unknown"]`` where
    git cannot tell."""
    if a["commit"] == b["commit"] and a.get("diff") == b.get("diff"):
        return []
    paths = tuple(paths)
    changed = _committed_changes(a["commit"], b["commit"], paths)
    if changed is None:
        return [f"commit {a['commit'][:12]} or {b['commit'][:12]} unknown here"]
    under = lambda f: any(f == p or f.startswith(p + "/") for p in paths)  # noqa: E731
    return sorted(set(changed) | {f for f in (*a.get("dirty", ()), *b.get("dirty", ()))
                                  if under(f)})


def code_conflict(runs) -> str | None:
    """The rule a comparison is priced by (issue 93): every pair of the runs it reads
    (``(script, stamp)``) must have run the same code in every file both execute
    (:data:`EXECUTES`); returns the first difference as the report words it, None where
    there is none. Unstamped runs (recorded before stamps) cannot be checked: left out
    here, named "unstamped" in the report."""
    seen = {}
    for script, stamp in runs:
        if stamp:
            seen.setdefault((script, json.dumps(stamp, sort_keys=True)), (script, stamp))
    items = sorted(seen.values(), key=lambda v: (v[0], json.dumps(v[1], sort_keys=True)))
    for i, (s1, a) in enumerate(items):
        for s2, b in items[i + 1:]:
            shared = [p for p in EXECUTES.get(s1, ()) if p in EXECUTES.get(s2, ())]
            files = stamps_differ(a, b, shared)
            if files:
                from bench.report import stamp_text

                more = f" and {len(files) - 2} more" if len(files) > 2 else ""
                return (f"{', '.join(files[:2])}{more} differ between {stamp_text(a)} and "
                        f"{stamp_text(b)}")
    return None


def mode_runs(data: dict, rate: str, mode: str) -> list:
    """``(script, stamp)`` of every run mode ``mode``'s time to target on ``rate`` reads:
    its loss curves (a timing-only mode's: the mode whose curve it takes) and its timing
    runs (a tuned DiLoCo's: the paper setting's of its H, the same script)."""
    table = modes()
    script = table[mode][0] if mode in table else None
    loss_script = table.get(LOSS_OF.get(mode, mode), (script,))[0]
    runs = [(loss_script, records[0].get("code") if records else None)
            for records in curves(data, rate).get(mode, {}).values()]
    runs += [(script, fig.get("code")) for fig in data["time"].get(rate, {}).get(mode, [])]
    return runs


def pair_refusal(data: dict, rate: str, a: str, b: str) -> str | None:
    """Why the ratio of ``a`` to ``b`` on ``rate`` is not priced (their runs differ in a
    file both execute: :func:`code_conflict`), None where it is."""
    return code_conflict(mode_runs(data, rate, a) + mode_runs(data, rate, b))


def stamps_line(data: dict) -> str:
    """Each mode's code, as the report names it: the stamps of the runs it reads over
    every link (loss and timing), "unstamped" for runs recorded before stamps."""
    from bench.report import stamp_text

    lines = []
    for mode in modes():
        stamps = {}
        for rate in data["time"]:
            for _, stamp in mode_runs(data, rate, mode):
                text = stamp_text(stamp)
                stamps[text] = stamps.get(text, 0) + 1
        if stamps:
            lines.append(f"{mode}: " + ", ".join(
                f"{t} ({n} run{'s' * (n > 1)})" for t, n in sorted(stamps.items())))
    return "; ".join(lines) or "no runs"


#: Each precision's timing session, a folder of ``out``: ratios are taken within one
#: precision, and bf16 is timed only on a CPU with bf16 instructions (a CPU without them
#: converts every bf16 operand, 4-80x slower: issue 80), which need not be the fp32 one's.
TIME_DIRS = {"fp32": "time", "bf16": "time-bf16"}


def time_folder(out: str, prec: str) -> str:
    """Where ``out``'s modes trained in ``prec`` are timed: their session's folder, or
    ``time/`` in a race timed before each precision had a session of its own."""
    folder = os.path.join(out, TIME_DIRS[prec])
    return folder if os.path.isdir(folder) else os.path.join(out, "time")


def timing_session(out: str, code: str, prec: str = "fp32") -> dict:
    """The one timing session of ``out``'s modes trained in ``prec`` (issue 72: every mode
    of a precision timed in one session, on the landed code): ``out/<TIME_DIRS[prec]>/
    session.json``. Runs timed on other code are moved aside to ``<that folder>-<code>/``
    (kept, never read, never reused) and a new session starts."""
    import datetime
    import shutil

    from bench.report import machine

    folder = os.path.join(out, TIME_DIRS[prec])
    path = os.path.join(folder, "session.json")
    session = None
    if os.path.exists(path):
        with open(path) as fh:
            session = json.load(fh)
    elif os.path.isdir(folder) and os.listdir(folder):
        session = {"code": "unknown"}   # timed before sessions were recorded
    if session is not None and session["code"] != code:
        shutil.move(folder, f"{folder}-{session['code']}")
        session = None
    if session is None:
        os.makedirs(folder, exist_ok=True)
        session = {"code": code, "machine": machine(), "started":
                   datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        with open(path, "w") as fh:
            json.dump(session, fh)
    return session


def sessions_text(sessions: dict) -> str:
    """Each precision's timing session as the section names it: its code, start and CPU
    (one session named once, with every precision it timed)."""
    precs: dict = {}
    for prec, v in sessions.items():
        precs.setdefault(json.dumps(v, sort_keys=True), []).append(prec)
    return "; ".join(
        f"{' and '.join(p)}: " + (f"code {v['code']}, started {v['started']}, "
                                  f"{v.get('machine', '?')}" if "started" in v else
                                  "timed before sessions were recorded")
        for v, p in ((json.loads(k), p) for k, p in precs.items())) or "none recorded"


def round_length(flags: list) -> int:
    """The iterations of one outer round of a mode whose replicas meet every H steps
    (DiLoCo, local SGD); 1 for the modes that sync every step."""
    for flag in ("--diloco-sync-every", "--local-sgd-period"):
        if flag in flags:
            return int(flags[flags.index(flag) + 1])
    return 1


def check_time_iters(time_iters: int, loss_iters: int) -> None:
    """A timing run is the loss run's config stopped early (``--exit-interval``): it must
    hold whole outer rounds of every mode (issue 80: DiLoCo priced over whole rounds) and
    EDGC's dense warm-up with two windows after it. Raises ValueError naming the bound."""
    rounds = [round_length(f) for _, f in modes().values()]
    lcm = int(numpy.lcm.reduce(rounds))
    if time_iters % lcm:
        raise ValueError(f"--time-iters: must be a multiple of {lcm} (every mode's outer "
                         f"round), got {time_iters}")
    import yaml

    with open(os.path.join(ROOT, CONFIG)) as fh:
        window = yaml.safe_load(fh)["edgc"]["window"]
    need = edgc_dense_iters(loss_iters) + 2 * window
    if time_iters < need:
        raise ValueError(f"--time-iters: must be >= {need} (EDGC's dense warm-up of a "
                         f"{loss_iters}-iteration run and two windows), got {time_iters}")


def run_timing(out: str, iters: int, time_iters: int, only=None, rates=RATES,
               repeats=REPEATS) -> None:
    """Every mode on each shaped link, its loss run's config (``iters``) stopped after
    ``time_iters`` (``--exit-interval``), ``repeats`` times interleaved, in its precision's
    timing session (:func:`timing_session`; a precision none of ``only`` trains in is not
    touched)."""
    port = 29700
    for prec, folder in TIME_DIRS.items():
        chosen = {name: run for name, run in modes().items()
                  if precision(name) == prec and (not only or name in only)}
        if chosen:
            timing_session(out, code_version(), prec)
            port = _time_modes(out, folder, chosen, iters, time_iters, rates, repeats, port)


def _time_modes(out, folder, chosen, iters, time_iters, rates, repeats, port) -> int:
    for rate in rates:
        try:
            net_cm = ShapedNetwork(4, rate)
            net = net_cm.__enter__()
        except NetnsUnavailable as exc:
            raise SystemExit(f"the timing runs need tbf-shaped namespaces (root): {exc}")
        try:
            for rep in range(repeats):
                for name, (script, flags) in chosen.items():
                    if not on_link(name, rate):
                        continue
                    port += 1

                    def launch(cmd, net=net, port=port):
                        codes = net.run(cmd, port=port, env={"OMP_NUM_THREADS": "1"},
                                        timeout=3600, cwd=ROOT)
                        return max(abs(c) for c in codes)

                    run_pretrain(f"{slug(name)}_rep{rep}", base_flags(iters, SEEDS[0]) + flags
                                 + ["--exit-interval", str(time_iters)],
                                 os.path.join(out, folder, rate), iters, reuse=True,
                                 script=script, launch=launch)
        finally:
            net_cm.close()
    return port


# ---------------------------------------------------------------- reading the runs

def read_run(path: str):
    with open(path) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    with open(os.path.splitext(path)[0] + ".summary.json") as fh:
        return records, json.load(fh)


def warmup_end(records) -> int:
    """The last dense iteration of an EDGC run (0 without a warm-up record): where its
    dense part was bounded, that bound; else its warm-up's end."""
    for key in ("dense_end_iter", "warmup_end_iter"):
        end = next((r[key] for r in records if r.get(key) is not None), None)
        if end is not None:
            return end
    return 0


def steady(records, key, start: int, stop: float = float("inf")):
    vals = [r[key] for r in records if start < r["iteration"] <= stop
            and r.get(key) is not None]
    vals = [max((x for x in v if x == x), default=float("nan")) if isinstance(v, list) else v
            for v in vals]
    return float(numpy.mean(vals)) if vals else None


def dp_rank(record):
    """The iteration's DP rank (the largest of its buckets'; None: dense or no record)."""
    ranks = [r for r in (record.get("rank_dp") or []) if r is not None]
    return max(ranks) if ranks else None


def rank_costs(records, start: int) -> dict:
    """``{rank: mean ms/iter}`` over a timing run's iterations after ``start`` at each DP
    rank, each rank's first iteration left out (the change's): EDGC's 40-iteration timing
    run visits other ranks than its long loss run, which is priced rank by rank."""
    by_rank, previous = {}, None
    for r in records:
        rank = dp_rank(r)
        if r["iteration"] > start and rank is not None and rank == previous:
            by_rank.setdefault(rank, []).append(r["iter_ms"])
        previous = rank
    return {rank: float(numpy.mean(v)) for rank, v in sorted(by_rank.items())}


def ms_at_rank(rank_ms: dict, rank, default: float) -> float:
    """The measured ms/iter at ``rank``: linear between the timed ranks, the nearest timed
    rank's outside them (above the lowest, an upper bound); ``default`` without a rank."""
    if rank is None or not rank_ms:
        return default
    pts = sorted((int(k), v) for k, v in rank_ms.items())
    if rank <= pts[0][0]:
        return pts[0][1]
    for (r0, m0), (r1, m1) in zip(pts, pts[1:]):
        if rank <= r1:
            return m0 + (m1 - m0) * (rank - r0) / (r1 - r0)
    return pts[-1][1]


def timing_figures(records, round_len: int = 1) -> dict:
    """A timing run's steady figures: after its warm-up (+2: the rank change) or iteration 3,
    over whole outer rounds of ``round_len`` iterations (issue 80: a DiLoCo window that
    holds a sync per H steps, not one in 37 iterations); its own warm-up's ms/iter
    (iterations 3 to its end; None without one), which prices the loss run's warm-up
    iterations; and the bypass's decisions (:func:`dense_share`)."""
    end = warmup_end(records)
    start = -(-max(3, end + 2) // round_len) * round_len
    stop = max(r["iteration"] for r in records) // round_len * round_len
    if stop <= start:   # a run of before issue 80, shorter than a round after its start
        start, stop = max(3, end + 2), float("inf")
    warm = [r["iter_ms"] for r in records if 3 <= r["iteration"] <= end]
    return {"code": records[0].get("code") if records else None,   # None: unstamped
            "iter_ms": steady(records, "iter_ms", start, stop),
            "warmup_ms": float(numpy.mean(warm)) if len(warm) >= 3 else None,
            "rank_ms": rank_costs(records, start),
            "sync_ms": steady(records, "grad_sync_ms", start, stop),
            "mib": steady(records, "dp_bytes_sent_job", start, stop) / 2**20,
            "compress_ms": steady(records, "dp_compress_ms", start, stop),
            "dense_share": dense_share(records, start)}


def dense_share(records, start: int = 0):
    """The bypass's decisions in a run: the share of its iterations after ``start`` whose
    decision in force sent a bucket dense (an exploring iteration counted by the decision
    in force, not by what it sent); None where no bypass decided."""
    decided = [(r["dp_bypassed_buckets"] > 0) != bool(r.get("dp_bypass_explored"))
               for r in records if r["iteration"] > start and "dp_link_gbps" in r]
    return float(numpy.mean(decided)) if decided else None


def collect(out: str, loss_iters: int, time_iters: int, time_dir: str | None = None) -> dict:
    """Every recorded run: ``{"loss": {mode: {seed: records}}, "time": {rate: {mode: [figs]}}}``
    (all that is on disk, whatever the command line selected); the timing from ``time_dir``
    where given (a long race's curves priced at the 200-iteration race's timing: the
    per-iteration cost does not depend on the run's length)."""
    names = {slug(n): n for n in modes()}
    loss: dict = {}
    loss_at: dict = {}   # rate -> {mode: {seed: records}} of the BYPASSING modes
    for path in sorted(glob.glob(os.path.join(out, "loss", "*_seed*.summary.json"))):
        stem = os.path.basename(path)[:-len(".summary.json")]
        mode, seed = stem.rsplit("_seed", 1)
        mode, _, rate = mode.partition("@")
        if mode in names:
            curves = loss_at.setdefault(rate, {}) if rate else loss
            curves.setdefault(names[mode], {})[int(seed)] = \
                read_run(os.path.splitext(path[:-len(".summary.json")])[0] + ".jsonl")[0]
    timing: dict = {}
    sessions: dict = {}
    for rate, prec in ((r, p) for r in RATES for p in TIME_DIRS):
        folder = time_folder(time_dir or out, prec)
        for path in sorted(glob.glob(os.path.join(folder, rate, "*_rep*.summary.json"))):
            stem = os.path.basename(path)[:-len(".summary.json")]
            mode, _ = stem.rsplit("_rep", 1)
            if mode in names and precision(names[mode]) == prec:
                sessions[prec] = os.path.join(folder, "session.json")
                recs, _ = read_run(path[:-len(".summary.json")] + ".jsonl")
                timing.setdefault(rate, {}).setdefault(names[mode], []).append(
                    timing_figures(recs, round_length(modes()[names[mode]][1])))
    for mode, (_, flags) in modes().items():
        if diloco_warmup(flags) and mode in loss:
            loss[mode] = {seed: mark_dense_warmup(records, diloco_warmup(flags))
                          for seed, records in loss[mode].items()}
    for mode, base in LOSS_OF.items():
        if base in loss:
            loss[mode] = loss[base]
    for rate_timing in timing.values():
        for mode, (_, flags) in modes().items():
            twin = timed_as(mode, flags)
            if mode not in rate_timing and twin in rate_timing:
                rate_timing[mode] = rate_timing[twin]
    data = {"loss": loss, "loss_at": loss_at, "time": timing, "session": {}}
    for prec, path in sessions.items():   # each timed precision's session
        data["session"][prec] = {}
        with contextlib.suppress(OSError):
            with open(path) as fh:
                data["session"][prec] = json.load(fh)
    return data


def curves(data: dict, rate: str) -> dict:
    """``{mode: {seed: records}}`` of the loss curves priced on ``rate``: every mode's,
    a :data:`BYPASSING` mode's from its run with that link declared (a run of before
    issue 80, one curve for every link, where no per-link one exists)."""
    return {**data["loss"], **data.get("loss_at", {}).get(rate, {})}


def final_val(records):
    return next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)


def priced(records, ms: float, warm_ms: float, rank_ms: dict | None = None) -> list:
    """The loss run's records with each iteration priced at the link's measured ms/iter:
    the dense warm-up at ``warm_ms``, a compressed iteration at its own rank's measured cost
    (``rank_ms``, :func:`ms_at_rank`), else ``ms``."""
    warm = warmup_end(records)
    return [dict(r, iter_ms=warm_ms if r["iteration"] <= warm else
                 ms_at_rank(rank_ms, dp_rank(r), ms)) for r in records]


def val_at(records, iteration: float):
    """The validation loss at ``iteration``, linear between the evaluations around it."""
    evals = [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r]
    for (i0, l0), (i1, l1) in zip(evals, evals[1:]):
        if i0 <= iteration <= i1:
            return l0 + (l1 - l0) * (iteration - i0) / (i1 - i0)
    return None


def target_loss(data: dict, fraction: float = TARGET_FRACTION):
    """Dense fp32's validation loss at ``fraction`` of its run, the highest over the seeds:
    a loss every dense and peer run reaches well before its last evaluation (a mode equal
    to dense then does not miss it by a seed's noise). None until dense fp32 has a run."""
    vals = []
    for records in data["loss"].get("dense fp32", {}).values():
        last = max(r["iteration"] for r in records)
        vals.append(val_at(records, fraction * last))
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def old_target_loss(data: dict):
    """The first and second races' target: the worst final validation loss of the two
    dense runs (fp32 and bf16 wire) over every seed (kept for comparison: a mode equal to
    dense misses it by chance on the seed that set it)."""
    finals = [final_val(records) for mode in ("dense fp32", "bf16 wire")
              for records in data["loss"].get(mode, {}).values()]
    finals = [f for f in finals if f is not None]
    return max(finals) if finals else None


def times_to_target(data: dict, rate: str, target) -> dict:
    """``{mode: {(seed, repetition): seconds}}`` on ``rate`` to ``target`` (None where a
    run never reaches it)."""
    loss, timing = curves(data, rate), data["time"].get(rate, {})
    dense = timing.get("dense fp32")
    out = {}
    for mode, seeds in loss.items():
        if mode not in timing or dense is None or target is None:
            continue
        why = code_conflict(mode_runs(data, rate, mode))
        if why:   # its curve and its timing (or two curves) ran different code: no price
            data.setdefault("refused", {}).setdefault(rate, {})[mode] = why
            continue
        vals = {}
        for seed, records in sorted(seeds.items()):
            for rep, fig in enumerate(timing[mode]):
                # the warm-up at the mode's own measured warm-up (its dense wire), else
                # (runs recorded before it was kept) at dense fp32's
                warm_ms = fig.get("warmup_ms") or dense[min(rep, len(dense) - 1)]["iter_ms"]
                vals[(seed, rep)] = time_to_loss(priced(records, fig["iter_ms"], warm_ms,
                                                        fig.get("rank_ms")),
                                                 target)
        out[mode] = vals
    return out


def iterations_to(data: dict, target, rate: str) -> dict:
    """``{mode: [iterations to target per seed]}`` on ``rate``'s curves (interpolated;
    None: not reached)."""
    return {m: [None if target is None else
                time_to_loss([dict(r, iter_ms=1e3) for r in recs], target)
                for _, recs in sorted(seeds.items())] for m, seeds in curves(data, rate).items()}


def spread(vals, spec=".1f", scale=1.0) -> str:
    """median (min–max); "—" where nothing was measured (None, or NaN: DiLoCo has no
    gradient sync)."""
    vals = [v * scale for v in vals if v is not None and not numpy.isnan(v)]
    if not vals:
        return "—"
    med = format(float(numpy.median(vals)), spec)
    return med if len(vals) == 1 else f"{med} ({format(min(vals), spec)}–{format(max(vals), spec)})"


def iters_cell(vals: list) -> str:
    """Iterations to the target per seed (interpolated), or how many seeds never got there."""
    missed = sum(v is None for v in vals)
    cell = spread([v for v in vals if v is not None], ".0f")
    return cell + (f", not reached in {missed} of {len(vals)}" if missed else "")


def fastest_peer(ttt: dict):
    """The peer with the lowest median time to target over the (seed, repetition) pairs
    every peer that reached it ran (a peer with fewer seeds is not judged on its luckiest
    ones); None without one."""
    done = {m: v for m, v in ttt.items() if v and None not in v.values()}
    if not done:
        return None
    common = set.intersection(*(set(v) for v in done.values())) or None
    return min(sorted(done), key=lambda m: numpy.median(
        [t for k, t in done[m].items() if common is None or k in common]))


def ratio_verdict(ratios: list) -> str:
    """The race's one rule (issue 72): over the paired ratios (seeds × repetitions)
    "faster" only where every one is below 1, "slower" only where every one is above,
    "not resolved" otherwise (not "no difference": the spread does not show one)."""
    if not ratios:
        return "—"
    return judged_range(ratios, lambda lo, hi: "faster" if hi < 1.0 else
                        "slower" if lo > 1.0 else "not resolved")


def judged_range(ratios: list, word_of) -> str:
    """``median (min–max)× word``, ``word_of(min, max)`` the rule's word, printed with as many
    digits as the range needs to show it (0.998 is not "1.00": the printed bounds give the
    same word as the measured ones)."""
    word = word_of(min(ratios), max(ratios))
    for digits in range(2, 7):
        if word_of(*(float(format(v, f".{digits}f")) for v in (min(ratios), max(ratios)))) \
                == word:
            break
    return spread(ratios, f".{digits}f") + "× " + word


def paired(ttt: dict, mode: str, other: str):
    """Ratios of ``mode`` to ``other`` on the (seed, repetition) pairs both ran (None
    unless both reached the target on every one of them)."""
    a, b = ttt.get(mode) or {}, ttt.get(other) or {}
    keys = sorted(set(a) & set(b))
    if not keys or any(a[k] is None or b[k] is None for k in keys):
        return None
    return [a[k] / b[k] for k in keys]


#: Issue 80's goal for EDGC at its defaults, per link: its time to target at most this
#: many times the fastest peer's of its precision.
GOAL = {"100mbit": 0.85, "300mbit": 0.85, "1gbit": 1.0}
EDGC_OF = {"fp32": "EDGC", "bf16": "EDGC bf16 grads"}


def time_split(ttt: dict, iters_to: dict, loss: dict, mode: str, peer: str) -> dict:
    """Where ``mode``'s time to target against ``peer``'s goes: the ratio of their
    iterations to the target per seed, and of their priced time per iteration per (seed,
    repetition) pair (the time ratio over the seed's iteration ratio)."""
    seeds = {m: dict(zip(sorted(loss[m]), iters_to[m])) for m in (mode, peer)}
    its = {s: seeds[mode][s] / seeds[peer][s] for s in seeds[mode] if s in seeds[peer]
           and None not in (seeds[mode][s], seeds[peer][s])}
    keys = sorted(k for k in set(ttt[mode]) & set(ttt[peer]) if k[0] in its)
    return {"iterations": [its[s] for s in sorted(its)],
            "per_iteration": [ttt[mode][k] / ttt[peer][k] / its[k[0]] for k in keys]}


def goal_verdict(ratios: list, bound: float) -> str:
    """The one rule against the goal's bound: "met" only where every paired ratio is at or
    below it, "missed" only where every one is above, "open" otherwise."""
    return judged_range(ratios, lambda lo, hi: "met" if hi <= bound else
                        "missed" if lo > bound else "open").replace("× ", f"× ≤ {bound:g}: ")


def goal_table(verdicts: dict) -> str:
    """EDGC against the fastest peer of its precision on each link, judged against the
    goal by the one rule (``verdicts`` as :func:`report` returns them)."""
    lines = ["| link | trained in | fastest peer | EDGC's time to target over it, paired, "
             "against the goal | of which: iterations to target over the peer's, per seed | "
             "and priced time per iteration over the peer's, paired |", "|---" * 6 + "|"]
    for rate, v in verdicts.items():
        for prec, edgc in EDGC_OF.items():
            ratios = v["vs_peer"].get(edgc)
            refused = v.get("refused", {}).get(edgc)
            cell = goal_verdict(ratios, GOAL[rate]) if ratios else \
                f"not priced: {refused}" if refused else "no pairs"
            split = v.get("split", {}).get(edgc) or {}
            lines.append(f"| {rate.replace('mbit', ' Mbit').replace('gbit', ' Gbit')} | "
                         f"{prec} | {v['best_peer'].get(prec) or '—'} | {cell} | "
                         f"{spread(split.get('iterations', []), '.3f')} | "
                         f"{spread(split.get('per_iteration', []), '.3f')} |")
    return "\n".join(lines)


def report(data: dict) -> tuple[str, dict]:
    target, old = target_loss(data), old_target_loss(data)
    n_seeds = max((len(v) for v in data["loss"].values()), default=0)
    lines = ["| link | mode | trained in | ms/iter | DP sync ms | DP MiB/iter | compress ms | "
             "bypass: iterations dense, timing / loss | "
             f"final val loss ({n_seeds} seeds) | iterations to target | time to target s | "
             "vs best peer of its precision, paired | vs static r_max, paired | "
             "time to old target s |", "|---" * 14 + "|"]
    verdicts = {}
    for rate in RATES:
        if rate not in data["time"]:
            continue
        ttt = times_to_target(data, rate, target)
        ttt_old = times_to_target(data, rate, old)
        loss, iters_to = curves(data, rate), iterations_to(data, target, rate)
        best = {}
        for prec in ("fp32", "bf16"):
            best[prec] = fastest_peer({m: v for m, v in ttt.items() if m not in OURS
                                       and precision(m) == prec})
        verdicts[rate] = {"best_peer": best, "vs_peer": {}, "vs_static": {}, "split": {},
                          "refused": {}}
        for mode in modes():
            figs = data["time"][rate].get(mode)
            if not figs or not loss.get(mode):   # timed, no curve of this length
                continue
            prec = precision(mode)
            finals = [final_val(r) for r in loss[mode].values()]
            shares = [f.get("dense_share") for f in figs]
            bypass = "—" if all(v is None for v in shares) else (
                spread(shares, ".0%") + " / " + spread([dense_share(r) for r in
                                                       loss[mode].values()], ".0%"))
            vs, vs_static = "—", "—"
            why = pair_refusal(data, rate, mode, best[prec]) if best[prec] else None
            ratios = paired(ttt, mode, best[prec]) if best[prec] and not why else None
            if why:   # issue 93: no ratio across runs of differing code
                vs = f"not priced: {why}"
                verdicts[rate]["refused"][mode] = why
            if ratios:
                vs = "1 (best peer)" if mode == best[prec] else ratio_verdict(ratios)
                verdicts[rate]["vs_peer"][mode] = ratios
                if mode == EDGC_OF[prec]:
                    verdicts[rate]["split"][mode] = time_split(ttt, iters_to, loss, mode,
                                                               best[prec])
            static = STATIC_OF[prec]
            if mode in OURS and mode != static and "dense" not in mode:
                why = pair_refusal(data, rate, mode, static)
                ratios = None if why else paired(ttt, mode, static)
                if why:
                    vs_static = f"not priced: {why}"
                if ratios:
                    vs_static = ratio_verdict(ratios)
                    verdicts[rate]["vs_static"][mode] = ratios

            def t_cell(vals, mode=mode):
                refused = data.get("refused", {}).get(rate, {}).get(mode)
                if refused:
                    return f"not priced: {refused}"
                vals = list((vals or {}).values())
                return spread(vals) if vals and None not in vals else \
                    f"not reached in {sum(v is None for v in vals)} of {len(vals)}"
            lines.append(
                f"| {rate.replace('mbit', ' Mbit').replace('gbit', ' Gbit')} | {mode} | {prec} | "
                f"{spread([f['iter_ms'] for f in figs], '.0f')} | "
                f"{spread([f['sync_ms'] for f in figs], '.0f')} | "
                f"{spread([f['mib'] for f in figs], '.2f')} | "
                f"{spread([f['compress_ms'] for f in figs if f['compress_ms'] is not None])} | "
                f"{bypass} | {spread([v for v in finals if v is not None], '.4f')} | "
                f"{iters_cell(iters_to.get(mode, []))} | {t_cell(ttt.get(mode))} | {vs} | "
                f"{vs_static} | {t_cell(ttt_old.get(mode))} |")
    return "\n".join(lines), verdicts


LEVEL_FRACTIONS = (0.1, 0.25, 0.5, TARGET_FRACTION)


def levels_table(data: dict, fractions=LEVEL_FRACTIONS) -> str:
    """Time to each of several losses, the median (min–max) over seeds × repetitions:
    dense fp32's validation loss at each ``fraction`` of its run (the highest over the
    seeds; the last is the race's target), so a long race says which mode gets to a
    loose loss first and which to a tight one. At each loss and link, in bold the mode
    faster than every other that reached it on every seed by the one rule (every paired
    ratio below 1, :func:`ratio_verdict`), with its largest ratio; none where no mode is."""
    levels = [target_loss(data, f) for f in fractions]
    if None in levels:   # no dense fp32 loss run yet (a race's timing first)
        return "(no loss run of dense fp32 yet)"
    lines = ["| link | mode | " + " | ".join(
        f"s to {lv:.4f} (dense at {f:.0%})" for f, lv in zip(fractions, levels)) + " |",
        "|---" * (2 + len(levels)) + "|"]
    for rate in RATES:
        if rate not in data["time"]:
            continue
        per_level = [times_to_target(data, rate, lv) for lv in levels]
        best = []
        for ttt in per_level:
            done = {m: numpy.median(list(v.values())) for m, v in ttt.items()
                    if v and None not in v.values()}
            lead = min(done, key=done.get) if done else None
            ratios = [r for m in done if m != lead for r in (paired(ttt, lead, m) or [])]
            # a lead across runs of differing code is not named (issue 93)
            refused = lead is not None and any(pair_refusal(data, rate, lead, m)
                                               for m in done if m != lead)
            best.append((lead, ratio_verdict(ratios)) if ratios and max(ratios) < 1.0
                        and not refused else (None, None))
        for mode in modes():
            if mode not in per_level[0]:
                continue
            cells = []
            for ttt, (fastest, how) in zip(per_level, best):
                if mode not in ttt:   # its own runs differ in code: not priced
                    cells.append("not priced")
                    continue
                vals = list(ttt[mode].values())
                cell = spread(vals) if None not in vals else \
                    f"not reached in {sum(v is None for v in vals)} of {len(vals)}"
                cells.append(f"**{cell}**, against every other {how}" if mode == fastest
                             else cell)
            lines.append(f"| {rate.replace('mbit', ' Mbit').replace('gbit', ' Gbit')} | "
                         f"{mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_tuned(out: str) -> None:
    """The race runs the tuned DiLoCo beside the paper's once ``--phase tune-diloco`` has
    written ``out/diloco_tuning.json``."""
    tuning = os.path.join(out, "diloco_tuning.json")
    if os.path.exists(tuning):
        with open(tuning) as fh:
            TUNED.update(json.load(fh))


def main() -> int:
    default_out = os.path.join(ROOT, "bench", "results", "peers")
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--out", default=default_out)
    load_tuned(first.parse_known_args()[0].out)   # before --modes' choices are listed
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--loss-iters", type=int, default=200)
    p.add_argument("--time-iters", type=int, default=96,
                   help="each timing run: the loss run's config stopped after this many "
                        "iterations (whole outer rounds of every mode, EDGC's warm-up and "
                        "two windows)")
    p.add_argument("--modes", nargs="+", default=None, choices=list(modes()),
                   help="run only these modes (the report still reads every recorded run)")
    p.add_argument("--phase", choices=("all", "loss", "time", "tune-diloco"), default="all",
                   help="tune-diloco: DiLoCo's grid on the tuning seed, per H; the race "
                        "then runs the chosen settings")
    p.add_argument("--rates", nargs="+", default=RATES, choices=RATES,
                   help="time on these links only")
    p.add_argument("--repeats", type=int, default=REPEATS, help="timing repetitions")
    p.add_argument("--seeds", type=int, nargs="+", default=SEEDS,
                   help="loss curves of these seeds (the report reads every recorded one)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--out", default=default_out)
    p.add_argument("--time-from", default=None, metavar="DIR",
                   help="read the timing runs from DIR (a long race priced at the "
                        "200-iteration race's timing: --time-from bench/results/peers)")
    args = p.parse_args()
    if args.loss_iters < 2 * EVAL_EVERY:
        p.error(f"--loss-iters: must be >= {2 * EVAL_EVERY} (got {args.loss_iters})")
    try:
        check_time_iters(args.time_iters, args.loss_iters)
    except ValueError as exc:
        p.error(str(exc))
    if args.phase == "tune-diloco":
        tune_diloco(args.out, args.loss_iters)
        return 0
    if not args.report_only:
        # the timing first: the bypassing modes' loss runs declare the links it measured
        if args.phase in ("all", "time"):
            run_timing(args.out, args.loss_iters, args.time_iters, args.modes, args.rates,
                       args.repeats)
        if args.phase in ("all", "loss"):
            run_losses(args.out, args.loss_iters, args.modes, args.seeds, args.rates)
            if args.phase == "loss":   # curves only
                return 0
    data = collect(args.out, args.loss_iters, args.time_iters, args.time_from)
    table, verdicts = report(data)
    target, old = target_loss(data), old_target_loss(data)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"target": target, "old_target": old, "verdicts": verdicts,
                   "stamps": stamps_line(data), "refused": data.get("refused", {}),
                   "timing": data["time"],
                   "iterations_to_target": {rate: iterations_to(data, target, rate)
                                            for rate in data["time"]},
                   "final_val": {rate: {m: {s: final_val(r) for s, r in v.items()}
                                        for m, v in curves(data, rate).items()}
                                 for rate in data["time"]}}, fh, indent=1)
    fmt = lambda v: "—" if v is None else format(v, ".4f")  # noqa: E731
    # the repetitions recorded (the command line's count may not be the one on disk)
    repeats = max((len(f) for t in data["time"].values() for f in t.values()), default=0)
    seeds = sorted({s for runs in data["loss"].values() for s in runs}
                   | {s for at in data["loss_at"].values() for runs in at.values() for s in runs})
    long_run = args.loss_iters != 200   # a long race: its own section beside the race's
    mixed = [m for m in BF16_TRAINED if m not in BF16_MODEL]
    body = (f"`configs/tiny-cpu.yaml` at TP1·PP1·DP4; fp32 training for every mode but "
            f"{', '.join(mixed)} (bf16 mixed precision, bf16 gradient buffers) and "
            f"{', '.join(BF16_MODEL)} (a bf16 model without fp32 main weights; why: "
            f"bench/peers.py's docstring); r_max {R_MAX}. Loss curves: "
            f"{args.loss_iters} iterations, seeds {', '.join(map(str, seeds))}, an evaluation "
            f"every {eval_interval(args.loss_iters)} (a mode whose replicas meet every H "
            f"iterations: at the last round's end before each), on loopback (runs per "
            f"machine: {loss_machines(args.out)}); this product's "
            f"modes at their defaults, the bypass (auto) deciding per link: their loss runs "
            f"per link, with the link their timing runs measured declared (rate and "
            f"latency). Timing: the loss run's config stopped after {args.time_iters} "
            f"iterations (whole outer rounds of every mode) per link "
            f"(tbf-shaped veth per rank), {repeats} repetitions, every mode once per "
            f"repetition, in one timing session per precision "
            f"({sessions_text(data.get('session') or {})}); ms/iter, DP sync, "
            f"MiB/iter (whole job, payload) and compress ms are the median (min–max) over them, "
            f"after each run's warm-up. Time to target = the seed's loss curve priced at the "
            f"link's ms/iter, to dense fp32's val loss at {TARGET_FRACTION:.0%} of its run, the "
            f"highest over the seeds ({fmt(target)}); the old target, the worst final val loss "
            f"of dense fp32 and bf16 wire over the seeds ({fmt(old)}), in the last column. "
            f"Ratios pair seeds × repetitions against the fastest peer (a mode not this "
            f"product's) trained in the same precision, and EDGC against static PowerSGD at "
            f"r_max of its precision; faster or slower only where every paired ratio is "
            f"on one side of 1, not resolved otherwise. Code (issue 93): every record "
            f"carries the commit it ran and a hash of any uncommitted diff; no time or ratio "
            f"is priced across runs that differ in a file both execute (the package, and "
            f"the trainer or bench/torch_ddp_peers.py: \"not priced\" says which), and runs "
            f"recorded before stamps read as \"unstamped\", their code not checked. "
            f"Each mode's stamps: {stamps_line(data)}.\n\n"
            + table + "\n\nThe goal (issue 80): EDGC at its defaults to the target in at most "
            "0.85× the fastest peer's time of its precision at 100 and 300 Mbit, at most 1.0× "
            "at 1 Gbit; met only where every paired ratio is at or below the bound, missed "
            "only where every one is above, open otherwise:\n\n" + goal_table(verdicts) + ("\n\nTime to each loss on the way (dense fp32's at 10, 25, 50 and 75 % "
                       "of its run), priced the same way; in bold a mode faster than every "
                       "other, only where every paired ratio against each of them is below 1 "
                       "(their median and range against them all); none otherwise:\n\n"
                       + levels_table(data) if long_run else "")
            + diloco_section(args.out) + "\n\n<!-- notes -->")
    write_section("peers" if not long_run else f"peers_{args.loss_iters}",
                  "Against the peers a user would run instead: time to a target loss"
                  + (f", {args.loss_iters} iterations" if long_run else ""),
                  "sudo .venv/bin/python bench/peers.py" + (
                      f" --loss-iters {args.loss_iters} --seeds {' '.join(map(str, seeds))}"
                      f" --out {os.path.relpath(args.out, ROOT)}" if long_run else "") + (
                      f" --time-from {os.path.relpath(args.time_from, ROOT)}"
                      if args.time_from else ""), body)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
