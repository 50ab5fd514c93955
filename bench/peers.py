#!/usr/bin/env python
"""EDGC against what a user would run instead, by time to a target validation loss.

    .venv/bin/python bench/peers.py             # ~8 h on 2 cores (root: netns); finished runs reused
    .venv/bin/python bench/peers.py --report-only
    .venv/bin/python bench/peers.py --phase tune-diloco --loss-iters 2000   # first: DiLoCo's grid
    .venv/bin/python bench/peers.py --phase match-static [--match-from DIR]  # the control's rank

How long (issue 93's race; each run's ``wall_s`` in bench/results/peers-defaults, process
start-up not counted): a timing run takes 74 s at 100 Mbit, 43 s at 300 Mbit, 34 s at
1 Gbit (the mean over that race's modes); a 2000-iteration loss run 687 s (403-1160), a
200-iteration one about a tenth. The default race: 25 modes per link × 3 links × 5
repetitions = 375 timing runs ≈ 5.3 h, and 29 loss runs per seed × 5 seeds = 145 of 200
iterations ≈ 2.8 h: ≈ 8 h (a tuned DiLoCo adds 2 modes). The 2000-iteration race of
bench/results/peers-defaults (its 12 modes, 3 seeds: 108 timing runs ≈ 1.5 h and 60 loss
runs ≈ 11.4 h) with the pinned EDGCs, the matched-bytes static and ours dense bf16 wire
(21 modes per link) and 5 repetitions: 315 timing runs ≈ 4.2 h and 78 loss runs ≈ 14.7 h:
≈ 19 h.

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
  flags: dense warm-up bounded at the first window end from 2 % of the run, the residual's
  dtype ``auto``);
* **trained in bf16** (``--bf16 --grad-reduce-in-bf16``, Megatron-LM's bf16 mixed precision
  with bf16 gradient buffers): ``dense bf16`` (megatron-core's bf16 all-reduce, the peer),
  ``static r_max bf16``, ``EDGC bf16 grads``.

In each precision, two kinds of this product's modes beside them (issue 93):
``EDGC pinned r8`` / ``r16`` / ``r24`` (``EDGC bf16 grads pinned r…``: EDGC's flags with
``--edgc-rank-max r --edgc-rank-min r``, the warm-up's end setting r and the controller's
clamp holding it; timed only: they price the ranks EDGC's loss runs hold,
:func:`rank_prices`), and ``static matched@RATE`` / ``static matched bf16@RATE`` (static
r_max's flags at the rank whose DP bytes per compressed iteration match EDGC's on that
link: :func:`matched_rank`; the control an adaptive rank must beat; ``--phase
match-static`` chooses it from EDGC's loss runs, in ``--out`` or another race's
``--match-from``, into ``static_matched.json``; ``--phase all`` chooses it after the loss
runs where none is chosen yet, then times and trains it after the other modes, not among
their repetitions: choose it first from an earlier race to time it interleaved).

``hook r_max bf16 model`` (``powerSGD_hook`` with bf16 factors on a bf16 model: torch
DDP's parameters in bf16, stepped by its AdamW without fp32 main weights) is the
compressing bf16 peer.

This product's modes run as they ship (issue 80): the bypass at ``auto``, EDGC's windows,
sampling and warm-up from the config, the same flags in the loss and the timing runs.

Two kinds of runs, composed, the timing first:

1. **Timing** per link (100 Mbit, 300 Mbit, 1 Gbit; tbf-shaped veth, one namespace per
   rank, bench/netns.py): each mode's loss-run config stopped after ``--time-iters``
   iterations (96: whole outer rounds of every DiLoCo and local SGD, EDGC's dense warm-up
   and two windows), 5 repetitions interleaved (every mode once per repetition, the order
   rotated between them: :func:`time_order`), in one
   timing session per precision on one version of the timed code (``timing_session``:
   runs of other code are moved aside, never reused; bf16 on a CPU with bf16
   instructions, which the fp32 session's need not be; the section names each session's
   code, start and CPU), its steady ms/iter (after its warm-up, over whole outer rounds), DP sync, bytes
   and the bypass's decisions (:func:`dense_share`), the ms/iter at each DP rank it held
   (:func:`rank_costs`), of its dense warm-up (iterations 3 to its end) and of the
   iterations its bypass sent dense (``dense_ms``).
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
between evaluations (scripts/plot_run.py), each iteration at what it ran (:func:`priced`,
:func:`price_run`, issue 93): the dense warm-up at the mode's own measured warm-up; a
compressed iteration at its rank's cost, r8, r16 and r24 from the pinned EDGC's timing run
of the same repetition and r_max from EDGC's own, linear between them
(:func:`ms_at_rank`); an iteration the bypass sent dense (its decision, or an exploring
one sending the other way: the timing runs end before the first exploration, every 200
iterations at the config's link window 50 and ``--edgc-link-explore`` 4) at the
ms/iter of the timing run's own bypassed iterations, else of this product's dense sync of
its precision on the link (:data:`DENSE_OF`; EDGC and static priced alike), else its
steady ms/iter; a rank no timing run compressed at (1 Gbit, where the bypass sends
the pinned runs dense) at the nearest timed rank's, else the steady ms/iter. Ratios are
against the fastest peer of the same precision (peers: every mode that is not this
product's), and EDGC against static r_max of its precision and against the matched-bytes
static, paired per seed and repetition; a ratio range that spans 1 is not
resolved (the race's one rule: ``ratio_verdict``). Beside the main table the section
gives EDGC over static per iteration (the timing runs' steady ms/iter paired per
repetition, the priced time per iteration paired per seed × repetition:
:func:`per_iteration_table`), EDGC's share of its priced time and iterations at each rank
(:func:`share_table`), EDGC against the matched-bytes static with the final loss paired
per seed (:func:`matched_table`), validation loss against priced time per link and
precision (``race.png`` in ``--out``: :func:`race_figure`), and what the recorded runs lack
(:func:`missing`: a race recorded before a mode existed still reports). Every record carries its code stamp
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
#: issue 93: enough repetitions to resolve a 3 % difference, interleaved (every mode once per
#: repetition, in an order that rotates between them: :func:`time_order`)
REPEATS = 5
EVAL_EVERY = 20
OURS = ("ours dense bf16 wire", "static r_max", "EDGC", "static r_max bf16", "EDGC bf16 grads")
#: Issue 93: EDGC's loss runs hold ranks below r_max on many iterations; the timing prices
#: each rank with EDGC pinned there (``--edgc-rank-max r --edgc-rank-min r``, its flags
#: otherwise EDGC's), r_max by EDGC's own timing runs: :func:`pinned_name`.
PINNED_RANKS = (8, 16, 24)
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
EDGC_OF = {"fp32": "EDGC", "bf16": "EDGC bf16 grads"}
#: This product's dense sync on each precision's wire (bf16: the default dense wire), which
#: prices a bypassed iteration where a mode's own timing measured none (:func:`priced`).
DENSE_OF = {"fp32": "ours dense bf16 wire", "bf16": "dense bf16"}
#: The matched-bytes static per precision and link (``--phase match-static`` writes
#: ``static_matched.json``: :func:`match_static`; :func:`load_tuned` reads it):
#: ``{prec: {rate: {"rank", ...}}}``.
MATCHED: dict = {}
#: The target: dense fp32's val loss at this fraction of the run (the highest over seeds).
TARGET_FRACTION = 0.75
TRAINER, DDP = "pretrain_gpt2_edgc.py", "bench/torch_ddp_peers.py"


def pinned_name(edgc: str, rank: int) -> str:
    """The timing-only mode of ``edgc`` (EDGC or EDGC bf16 grads) pinned at ``rank``."""
    return f"{edgc} pinned r{rank}"


def matched_name(prec: str) -> str:
    """Static PowerSGD at the rank matching EDGC's DP bytes (issue 93), of ``prec``, before
    its link (the mode is ``matched_name(prec) + "@" + rate``: :data:`MATCHED`)."""
    return "static matched" + (" bf16" if prec == "bf16" else "")


def twin(mode: str) -> str:
    """The raced mode whose flags a derived mode shares but for its rank: a pinned EDGC's
    EDGC, a matched-bytes static's static r_max of its precision; any other mode, itself."""
    if " pinned r" in mode:
        return mode.split(" pinned r")[0]
    if mode.startswith("static matched"):
        return "static r_max" + mode.split("@")[0][len("static matched"):]
    return mode


def precision(mode: str) -> str:
    return "bf16" if twin(mode) in BF16_TRAINED else "fp32"


def ours(mode: str) -> bool:
    """Whether ``mode`` is this product's (not a peer): the fastest peer is another's."""
    return twin(mode) in OURS


def edgc_flags(controller: str, pinned: int | None = None) -> list:
    """EDGC as it ships on the race's config: its windows, sampling and warm-up bound
    (``configs/tiny-cpu.yaml``), the bypass at the product's default (auto), in the loss
    and the timing runs alike (issue 80); ``pinned``: its rank held there (r_max = r_min:
    the warm-up's end sets r_max, the controller's clamp keeps it), the timing-only modes
    that price each rank (issue 93)."""
    top, bottom = (R_MAX, R_MIN) if pinned is None else (pinned, pinned)
    return ["--edgc-mode", "edgc", "--edgc-controller", controller, "--edgc-bypass", "auto",
            "--edgc-rank-max", str(top), "--edgc-rank-min", str(bottom)]


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
        # timing only (issue 93): EDGC's flags with its rank pinned, which price the ranks
        # its loss runs hold (:func:`rank_prices`)
        **{pinned_name(edgc, r): (TRAINER, edgc_flags("paper", r)
                                  + (BF16_GRADS if prec == "bf16" else []))
           for prec, edgc in EDGC_OF.items() for r in PINNED_RANKS},
        # static at the rank matching EDGC's DP bytes per compressed iteration on the link
        # (issue 93; ``--phase match-static`` writes it: :func:`match_static`)
        **{f"{matched_name(prec)}@{rate}": (TRAINER, static + ["--edgc-rank", str(m["rank"])]
                                            + (BF16_GRADS if prec == "bf16" else []))
           for prec, at in MATCHED.items() for rate, m in at.items()
           if m.get("rank") is not None},
    }
    return {name: (script, flags + (FP32 if precision(name) == "fp32" else []))
            for name, (script, flags) in table.items()}


#: Timing-only modes: their loss curve is this mode's (the same math).
LOSS_OF = {"torch DDP fp32": "dense fp32", "ours dense bf16 wire": "bf16 wire"}


def timing_only(mode: str) -> bool:
    """A mode with no loss run of its own: a twin's curve (:data:`LOSS_OF`), or a pinned
    EDGC, which prices its EDGC's ranks."""
    return mode in LOSS_OF or " pinned r" in mode


def bypassing(mode: str) -> bool:
    """This product's modes whose bypass decides per link (:data:`BYPASSING`, and the
    matched-bytes static): their loss runs are per link."""
    return twin(mode) in BYPASSING


def loss_stem(mode: str, rate: str | None) -> str:
    """A loss run's name before ``_seed``: the mode's slug, ``@RATE`` for a per-link run (a
    mode named for one link carries it already)."""
    return slug(mode) + ("" if rate is None or "@" in mode else "@" + rate)




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
            if (only and name not in only) or timing_only(name):
                continue
            for rate in [r for r in rates if on_link(name, r)] if bypassing(name) else [None]:
                link = [] if rate is None else declared_link(out, rate, name)
                if link is None:
                    print(f"=== {name} @{rate}: no timing run measured the link yet "
                          f"(--phase time first)", flush=True)
                    continue
                run = f"{loss_stem(name, rate)}_seed{seed}"
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


def compressed_bytes(records) -> list:
    """``(rank, DP bytes of the job)`` of a run's compressed iterations after its warm-up
    (those the bypass sent dense, and the warm-up, left out)."""
    warm = warmup_end(records)
    return [(dp_rank(r), r["dp_bytes_sent_job"]) for r in records
            if r["iteration"] > warm and dp_rank(r) is not None
            and r.get("dp_bytes_sent_job") is not None]


def matched_rank(runs: list) -> dict:
    """The static rank whose DP bytes per compressed iteration match EDGC's (issue 93), from
    EDGC's loss runs ``runs`` (records per seed) on one link: its mean bytes over every
    compressed iteration of the seeds, and the product's byte accounting read off the
    same records, a line bytes = a + b × rank fitted over the ranks they hold (a rank's
    factors are (n + m) × r per matrix; a: what never compresses); the rank where the line
    meets the mean, rounded to the nearest integer in 1..r_max (a static rank is any
    rank some matrix compresses at, r_min's 8 and up here). The bypass decides for both:
    iterations it sends dense, and EDGC's warm-up, are left out of the match."""
    points = [p for records in runs for p in compressed_bytes(records)]
    if not points:
        return {"rank": None, "seeds": len(runs), "iterations": 0}
    ranks = numpy.array([float(r) for r, _ in points])
    sent = numpy.array([float(b) for _, b in points])
    mean = float(sent.mean())
    if len(set(ranks)) > 1:
        b, a = (float(v) for v in numpy.polyfit(ranks, sent, 1))
        rank = int(min(max(numpy.floor((mean - a) / b + 0.5), 1), R_MAX))
    else:   # one rank held throughout: that rank
        a, b, rank = None, None, int(ranks[0])
    return {"rank": rank, "seeds": len(runs), "iterations": len(points),
            "edgc_mib": mean / 2**20, "edgc_mean_rank": float(ranks.mean()),
            "fit_mib": None if b is None else [a / 2**20, b / 2**20],
            "matched_mib": None if b is None else (a + b * rank) / 2**20}


def match_static(out: str, source: str | None = None) -> dict:
    """``--phase match-static``: per precision and link, the matched-bytes static's rank
    (:func:`matched_rank`) from EDGC's loss runs in ``source`` (default ``out``: run after
    EDGC's loss runs; another race's to time the control interleaved from the start), into
    ``out/static_matched.json``; the race then runs ``static matched@RATE`` (and its bf16
    twin) as its other modes (:data:`MATCHED`)."""
    data = collect(source or out, 0, 0)
    result = {}
    for prec, edgc in EDGC_OF.items():
        for rate in RATES:
            runs = data["loss_at"].get(rate, {}).get(edgc)
            if runs:
                result.setdefault(prec, {})[rate] = dict(
                    matched_rank([runs[s] for s in sorted(runs)]),
                    source=os.path.relpath(source or out, ROOT))
    with open(os.path.join(out, "static_matched.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    MATCHED.clear()
    MATCHED.update(result)
    return result


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
    if bypassing(mode):   # its ranks and bypassed iterations priced by these modes' timing
        for other in [pinned_name(mode, r) for r in PINNED_RANKS] + [DENSE_OF[precision(mode)]]:
            runs += [(table.get(other, (script,))[0], fig.get("code"))
                     for fig in data["time"].get(rate, {}).get(other, [])]
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


def time_order(names: list, rep: int, repeats: int) -> list:
    """The order the modes run in repetition ``rep`` of ``repeats`` (issue 93): every mode
    once, the order rotated by ``rep`` × n / ``repeats`` places, so that over the
    repetitions each mode runs early and late (each first in one where there are no more
    modes than repetitions) and its neighbours stay its neighbours (a ratio of neighbours
    pairs runs minutes apart)."""
    names = list(names)
    if not names:
        return names
    shift = rep * len(names) // max(repeats, 1) % len(names)
    return names[shift:] + names[:shift]


def run_timing(out: str, iters: int, time_iters: int, only=None, rates=RATES,
               repeats=REPEATS) -> None:
    """Every mode on each shaped link, its loss run's config (``iters``) stopped after
    ``time_iters`` (``--exit-interval``), ``repeats`` times interleaved in a rotating order
    (:func:`time_order`), in its precision's timing session (:func:`timing_session`; a
    precision none of ``only`` trains in is not touched)."""
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
            here = [name for name in chosen if on_link(name, rate)]
            for rep in range(repeats):
                for name in time_order(here, rep, repeats):
                    script, flags = chosen[name]
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
    iterations; the ms/iter of its iterations the bypass sent dense after its start
    (``dense_ms``; None under 3), which prices the loss run's; and the bypass's decisions
    (:func:`dense_share`)."""
    end = warmup_end(records)
    start = -(-max(3, end + 2) // round_len) * round_len
    stop = max(r["iteration"] for r in records) // round_len * round_len
    if stop <= start:   # a run of before issue 80, shorter than a round after its start
        start, stop = max(3, end + 2), float("inf")
    warm = [r["iter_ms"] for r in records if 3 <= r["iteration"] <= end]
    bypassed = [r["iter_ms"] for r in records if r["iteration"] > start
                and r.get("dp_bypassed_buckets") and dp_rank(r) is None]
    return {"code": records[0].get("code") if records else None,   # None: unstamped
            "iter_ms": steady(records, "iter_ms", start, stop),
            "warmup_ms": float(numpy.mean(warm)) if len(warm) >= 3 else None,
            "dense_ms": float(numpy.mean(bypassed)) if len(bypassed) >= 3 else None,
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
        if mode in names and "@" in mode:   # a mode named for its link (static matched@RATE)
            rate = mode.partition("@")[2]
        else:
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


def priced(records, ms: float, warm_ms: float, rank_ms: dict | None = None,
           dense_ms: float | None = None) -> list:
    """The loss run's records with each iteration priced at the link's measured ms/iter:
    the dense warm-up at ``warm_ms``; after it, an iteration by what it sent: one the
    bypass sent dense (its decision, or an exploring iteration sending the other way) at
    ``dense_ms`` where given, a compressed one at its own rank's measured cost (``rank_ms``,
    :func:`ms_at_rank`), else ``ms``."""
    warm = warmup_end(records)

    def cost(r):
        if r["iteration"] <= warm:
            return warm_ms
        rank = dp_rank(r)
        if rank is None and r.get("dp_bypassed_buckets") and dense_ms is not None:
            return dense_ms
        return ms_at_rank(rank_ms, rank, ms)
    return [dict(r, iter_ms=cost(r)) for r in records]


def rank_prices(timing: dict, mode: str, rep: int) -> dict:
    """``{rank: ms/iter}`` that prices ``mode``'s compressed iterations in repetition
    ``rep`` on a link (``timing``: that link's figures): its own timing run's ranks (EDGC's:
    r_max, where its warm-up ends), and each pinned EDGC's rank from that one's run of the
    same repetition (issue 93: :data:`PINNED_RANKS`), which takes precedence (it holds the
    rank for the whole run)."""
    prices = {int(k): v for k, v in (timing[mode][rep].get("rank_ms") or {}).items()}
    for rank in PINNED_RANKS:
        figs = timing.get(pinned_name(mode, rank)) or []
        got = (figs[rep].get("rank_ms") or {}) if rep < len(figs) else {}
        got = {int(k): v for k, v in got.items()}
        if rank in got:
            prices[rank] = got[rank]
    return dict(sorted(prices.items()))


def dense_price(timing: dict, mode: str, rep: int):
    """The ms/iter of an iteration ``mode``'s bypass sent dense after its warm-up, on a link,
    in repetition ``rep``: its own timing run's bypassed iterations where it measured
    some; else this product's dense sync of its precision timed on the link
    (:data:`DENSE_OF`, the same repetition); else None (its steady ms/iter, as before issue
    93). Not the mode's own warm-up: static has none, and EDGC's and static's bypassed
    iterations are priced alike."""
    fig = timing[mode][rep]
    if fig.get("dense_ms") is not None:
        return fig["dense_ms"]
    base = timing.get(DENSE_OF[precision(mode)])
    return base[min(rep, len(base) - 1)]["iter_ms"] if base else None


def price_run(data: dict, rate: str, mode: str, records: list, rep: int) -> list:
    """Loss run ``records`` of ``mode`` priced at repetition ``rep`` of its timing on
    ``rate`` (:func:`priced`): the warm-up at the mode's own measured warm-up (its dense
    wire), else (runs recorded before it was kept) at dense fp32's; its ranks at
    :func:`rank_prices`; a bypassing mode's dense-sent iterations at :func:`dense_price`."""
    timing = data["time"][rate]
    fig, dense = timing[mode][rep], timing.get("dense fp32")
    warm_ms = fig.get("warmup_ms") or (dense[min(rep, len(dense) - 1)]["iter_ms"]
                                       if dense else fig["iter_ms"])
    return priced(records, fig["iter_ms"], warm_ms, rank_prices(timing, mode, rep),
                  dense_price(timing, mode, rep) if bypassing(mode) else None)


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
        out[mode] = {(seed, rep): time_to_loss(price_run(data, rate, mode, records, rep),
                                               target)
                     for seed, records in sorted(seeds.items())
                     for rep in range(len(timing[mode]))}
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
            best[prec] = fastest_peer({m: v for m, v in ttt.items() if not ours(m)
                                       and precision(m) == prec})
        verdicts[rate] = {"best_peer": best, "vs_peer": {}, "vs_static": {}, "split": {},
                          "refused": {}, "vs_matched": {}}
        for prec, edgc in EDGC_OF.items():   # issue 93: the control an adaptive rank must beat
            matched = f"{matched_name(prec)}@{rate}"
            if edgc in ttt and matched in ttt and not pair_refusal(data, rate, edgc, matched):
                verdicts[rate]["vs_matched"][edgc] = paired(ttt, edgc, matched)
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
            if ours(mode) and mode != static and "dense" not in mode:
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


def link_name(rate: str) -> str:
    return rate.replace("mbit", " Mbit").replace("gbit", " Gbit")


def missing(data: dict) -> list:
    """What the race's modes lack on each timed link (records of before a mode existed:
    the report says so rather than price without them): a mode with no timing runs, one
    without loss curves, a matched-bytes static not chosen yet."""
    said = []
    for rate in RATES:
        if rate not in data["time"]:
            continue
        timing, loss = data["time"][rate], curves(data, rate)
        for mode in modes():
            if not on_link(mode, rate):
                continue
            if mode not in timing:
                said.append(f"{link_name(rate)}: {mode} not timed")
            elif not timing_only(mode) and not loss.get(mode):
                said.append(f"{link_name(rate)}: {mode} has no loss run")
        for prec in EDGC_OF:
            if rate not in MATCHED.get(prec, {}):
                said.append(f"{link_name(rate)}: no {matched_name(prec)} (--phase match-static)")
    return said


#: The rank bins of EDGC's share table: the dense warm-up, iterations the bypass sent
#: dense after it, and compressed iterations by rank up to each pinned rank and r_max.
RANK_BINS = ("dense warm-up", "dense (bypass)",
             *(f"r{lo + 1}–{hi}" if lo else f"r ≤ {hi}"
               for lo, hi in zip((0,) + PINNED_RANKS, PINNED_RANKS + (R_MAX - 1,))),
             f"r{R_MAX}")


def rank_bin(record: dict, warm: int) -> str:
    """The :data:`RANK_BINS` bin of an EDGC loss run's iteration (``warm``: its warm-up's
    last iteration)."""
    if record["iteration"] <= warm:
        return RANK_BINS[0]
    rank = dp_rank(record)
    if rank is None:
        return RANK_BINS[1]
    for label, hi in zip(RANK_BINS[2:], PINNED_RANKS + (R_MAX - 1,)):
        if rank <= hi:
            return label
    return RANK_BINS[-1]


def rank_shares(records: list) -> dict:
    """``{bin: (share of the priced time, share of the iterations)}`` of a priced loss run
    (:func:`priced`), over the whole run, per :data:`RANK_BINS` bin."""
    warm = warmup_end(records)
    train = records
    total_ms = sum(r["iter_ms"] for r in train)
    shares = {}
    for label in RANK_BINS:
        got = [r for r in train if rank_bin(r, warm) == label]
        shares[label] = (sum(r["iter_ms"] for r in got) / total_ms, len(got) / len(train))
    return shares


def share_table(data: dict) -> str:
    """EDGC's share of its priced time (and of its iterations) at each rank (issue 93), per
    link and precision: the median over seeds × repetitions (iterations: over seeds), and
    the ranks the timing priced (the rest: linear between them, the nearest outside)."""
    lines = ["| link | trained in | ranks timed | " + " | ".join(
        f"{b}: time / iterations" for b in RANK_BINS) + " |", "|---" * (3 + len(RANK_BINS))
        + "|"]
    for rate in RATES:
        timing = data["time"].get(rate, {})
        for prec, edgc in EDGC_OF.items():
            runs = curves(data, rate).get(edgc)
            if not runs or edgc not in timing:
                continue
            cells = {b: ([], []) for b in RANK_BINS}
            timed = set()
            for seed, records in sorted(runs.items()):
                for rep in range(len(timing[edgc])):
                    timed.update(rank_prices(timing, edgc, rep))
                    for b, (t, i) in rank_shares(price_run(data, rate, edgc, records,
                                                           rep)).items():
                        cells[b][0].append(t)
                        if rep == 0:
                            cells[b][1].append(i)
            lines.append(f"| {link_name(rate)} | {prec} | "
                         f"{', '.join(f'r{r}' for r in sorted(timed)) or 'none'} | "
                         + " | ".join(f"{spread(t, '.1f', 100)} % / {spread(i, '.1f', 100)} %"
                                      for t, i in cells.values()) + " |")
    return "\n".join(lines)


def per_iteration_table(data: dict, verdicts: dict) -> str:
    """EDGC over static r_max of its precision per iteration (issue 93: the timing resolves
    a 3 % difference), per link: their timing runs' steady ms/iter paired per repetition
    (the same rank, r_max, where both compress: EDGC's machinery), and the loss runs' priced
    time per iteration to the target paired per seed × repetition, beside the iterations
    to it per seed (:func:`time_split`)."""
    lines = ["| link | trained in | steady ms/iter, EDGC over static, paired per repetition | "
             "priced time per iteration to target, paired | iterations to target, per seed |",
             "|---" * 5 + "|"]
    target = target_loss(data)
    for rate in RATES:
        timing = data["time"].get(rate, {})
        if not timing:
            continue
        ttt = times_to_target(data, rate, target)
        loss, iters_to = curves(data, rate), iterations_to(data, target, rate)
        for prec, edgc in EDGC_OF.items():
            static = STATIC_OF[prec]
            if edgc not in timing or static not in timing:
                continue
            steady_ratios = [a["iter_ms"] / b["iter_ms"]
                             for a, b in zip(timing[edgc], timing[static])]
            split = {}
            if edgc in ttt and static in ttt and paired(ttt, edgc, static):
                split = time_split(ttt, iters_to, loss, edgc, static)
            lines.append(f"| {link_name(rate)} | {prec} | {ratio_verdict(steady_ratios)} "
                         f"({len(steady_ratios)}) | "
                         f"{ratio_verdict(split.get('per_iteration', []))} | "
                         f"{spread(split.get('iterations', []), '.3f')} |")
    return "\n".join(lines)


def loss_difference(a: dict, b: dict) -> str:
    """Final validation loss of curves ``a`` minus ``b``'s, paired per seed, judged by the
    one rule: "lower" or "higher" only where every seed's difference is on one side of 0."""
    diffs = [final_val(a[s]) - final_val(b[s]) for s in sorted(set(a) & set(b))
             if final_val(a[s]) is not None and final_val(b[s]) is not None]
    if not diffs:
        return "—"
    word = "lower" if max(diffs) < 0 else "higher" if min(diffs) > 0 else "not resolved"
    return f"{spread(diffs, '+.4f')} {word}"


def matched_table(data: dict, verdicts: dict) -> str:
    """EDGC against static at the rank matching its DP bytes (issue 93), per link and
    precision: the rank and the bytes matched, EDGC's time to target over the control's
    paired per seed × repetition by the one rule, and their final validation losses."""
    lines = ["| link | trained in | matched rank (EDGC's MiB per compressed iteration, its "
             "mean rank; static's) | EDGC's time to target over matched static's, paired | "
             "final val loss, EDGC minus matched static, per seed |", "|---" * 5 + "|"]
    for rate in RATES:
        if rate not in data["time"]:
            continue
        loss = curves(data, rate)
        for prec, edgc in EDGC_OF.items():
            m = MATCHED.get(prec, {}).get(rate)
            mode = f"{matched_name(prec)}@{rate}"
            if not m or m.get("rank") is None:
                lines.append(f"| {link_name(rate)} | {prec} | not chosen (--phase "
                             f"match-static) | — | — |")
                continue
            own = [b for recs in loss.get(mode, {}).values() for _, b in compressed_bytes(recs)]
            theirs = f"{numpy.mean(own) / 2**20:.3f}" if own else "no loss run"
            ratios = verdicts.get(rate, {}).get("vs_matched", {}).get(edgc)
            why = pair_refusal(data, rate, edgc, mode) if mode in data["time"][rate] else None
            cell = f"not priced: {why}" if why else ratio_verdict(ratios) if ratios else \
                "not timed" if mode not in data["time"][rate] else "no pairs"
            lines.append(f"| {link_name(rate)} | {prec} | r{m['rank']} ({m['edgc_mib']:.3f}, "
                         f"r{m['edgc_mean_rank']:.1f}; {theirs}) | {cell} | "
                         f"{loss_difference(loss.get(edgc, {}), loss.get(mode, {}))} |")
    return "\n".join(lines)


def race_figure(data: dict, path: str) -> dict:
    """Validation loss against priced time (issue 93), a panel per link (columns) and
    precision (rows), a line per mode with a curve and a timing on the link: at each
    evaluation the median over seeds × repetitions of its priced seconds and of its loss,
    the band the loss's range; the target dashed. Written with matplotlib's Agg backend to
    ``path`` (PNG); returns ``{(rate, prec): [modes drawn]}``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plot_run import evaluations

    rates = [r for r in RATES if r in data["time"]]
    target = target_loss(data)
    fig, axes = plt.subplots(2, max(len(rates), 1), figsize=(6 * max(len(rates), 1), 9),
                             squeeze=False)
    drawn = {}
    for col, rate in enumerate(rates):
        timing, loss = data["time"][rate], curves(data, rate)
        for row, prec in enumerate(("fp32", "bf16")):
            ax, names = axes[row][col], []
            for mode in modes():
                if precision(mode) != prec or mode not in timing or not loss.get(mode) \
                        or code_conflict(mode_runs(data, rate, mode)):
                    continue
                runs = [evaluations(price_run(data, rate, mode, records, rep))
                        for _, records in sorted(loss[mode].items())
                        for rep in range(len(timing[mode]))]
                n = min(len(e) for e in runs)
                if not n:
                    continue
                t = numpy.median([[e[i][0] for i in range(n)] for e in runs], axis=0)
                v = numpy.array([[e[i][2] for i in range(n)] for e in runs])
                style = "-" if ours(mode) else "--"
                colour = plt.get_cmap("tab20")(list(modes()).index(mode) % 20)
                line, = ax.plot(t, numpy.median(v, axis=0), style, label=mode, lw=1.2,
                                color=colour)
                ax.fill_between(t, v.min(axis=0), v.max(axis=0), color=line.get_color(),
                                alpha=0.15, lw=0)
                names.append(mode)
            if target is not None:
                ax.axhline(target, color="k", ls=":", lw=0.8, label=f"target {target:.4f}")
                ax.set_ylim(target - 0.3, target + 1.2)
            ax.set(title=f"{link_name(rate)}, trained in {prec}", xlabel="priced time, s",
                   ylabel="validation loss")
            if names:
                ax.legend(fontsize=6, loc="upper right")
            drawn[(rate, prec)] = names
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


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


def issue93_text(data: dict, verdicts: dict, png: str) -> str:
    """The section's paragraphs of issue 93: EDGC over static per iteration, EDGC's time at
    each rank, EDGC against the matched-bytes static, the figure, and what the recorded
    runs lack."""
    lacks = {}
    for item in missing(data):
        link, what = item.split(": ", 1)
        lacks.setdefault(what, []).append(link)
    n_links = len([r for r in RATES if r in data["time"]])
    grouped = {}   # "not timed" -> ["mode (links)", ...]
    for what, links in lacks.items():
        where = "" if len(links) == n_links or "@" in what else f" ({', '.join(links)})"
        for kind in (" not timed", " has no loss run"):
            if what.endswith(kind):
                grouped.setdefault(kind.strip(), []).append(what[:-len(kind)] + where)
                break
        else:
            grouped.setdefault("", []).append(what + where)
    lacks_text = "; ".join(f"{kind}: {', '.join(v)}" if kind else "; ".join(v)
                           for kind, v in grouped.items())
    return ("\n\nEDGC over static r_max of its precision per iteration (issue 93): the timing "
            "runs' steady ms/iter paired per repetition (both at r_max where they compress; "
            "how many pairs in brackets), and the loss runs' priced time per iteration to "
            "the target paired per seed × repetition, beside their iterations to it:\n\n"
            + per_iteration_table(data, verdicts)
            + "\n\nEDGC's share of its priced time / of its iterations at each rank, over "
            "its whole loss run (median (min–max) over seeds × repetitions; the ranks timed: "
            "the ones priced at their own measured cost, the rest linear between them and "
            "at the nearest outside, or at the steady ms/iter where none was timed):\n\n"
            + share_table(data)
            + "\n\nEDGC against static at the rank matching its DP bytes per compressed "
            "iteration on the link (`--phase match-static`: the bypass decides for both, "
            "EDGC's warm-up left out), by the one rule; the final validation loss paired per "
            "seed:\n\n" + matched_table(data, verdicts)
            + f"\n\nValidation loss against priced time, per link and precision (median "
            f"over seeds × repetitions, the band the loss's range over them; this product's "
            f"modes solid, peers dashed):\n\n![the race: validation loss against priced "
            f"time]({os.path.relpath(png, ROOT)})"
            + (f"\n\nNot in the recorded runs: {lacks_text}." if lacks_text else ""))


def load_tuned(out: str) -> None:
    """The race runs the tuned DiLoCo beside the paper's once ``--phase tune-diloco`` has
    written ``out/diloco_tuning.json``, and the matched-bytes static once ``--phase
    match-static`` has written ``out/static_matched.json``."""
    tuning = os.path.join(out, "diloco_tuning.json")
    if os.path.exists(tuning):
        with open(tuning) as fh:
            TUNED.update(json.load(fh))
    matched = os.path.join(out, "static_matched.json")   # and the matched-bytes static
    if os.path.exists(matched):
        with open(matched) as fh:
            MATCHED.update(json.load(fh))


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
    p.add_argument("--phase", choices=("all", "loss", "time", "tune-diloco", "match-static"),
                   default="all",
                   help="tune-diloco: DiLoCo's grid on the tuning seed, per H; the race "
                        "then runs the chosen settings. match-static: the rank of static "
                        "matching EDGC's DP bytes per link and precision, from EDGC's loss "
                        "runs (--match-from DIR, default --out); the race then runs it")
    p.add_argument("--match-from", default=None, metavar="DIR",
                   help="--phase match-static: read EDGC's loss runs from DIR (another "
                        "race's: the control then times interleaved from the start)")
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
    if args.phase == "match-static":
        print(json.dumps(match_static(args.out, args.match_from), indent=1))
        return 0
    if not args.report_only:
        # the timing first: the bypassing modes' loss runs declare the links it measured
        if args.phase in ("all", "time"):
            run_timing(args.out, args.loss_iters, args.time_iters, args.modes, args.rates,
                       args.repeats)
        if args.phase in ("all", "loss"):
            run_losses(args.out, args.loss_iters, args.modes, args.seeds, args.rates)
        if args.phase == "all" and not MATCHED and (
                not args.modes or set(EDGC_OF.values()) & set(args.modes)):
            # the control needs EDGC's loss runs: chosen now, then timed (after the other
            # modes' repetitions, not among them) and trained
            match_static(args.out)
            chosen = [m for m in modes() if m.startswith("static matched")]
            if chosen:
                run_timing(args.out, args.loss_iters, args.time_iters, chosen, args.rates,
                           args.repeats)
                run_losses(args.out, args.loss_iters, chosen, args.seeds, args.rates)
        if args.phase == "loss":   # curves only
            return 0
    data = collect(args.out, args.loss_iters, args.time_iters, args.time_from)
    table, verdicts = report(data)
    target, old = target_loss(data), old_target_loss(data)
    png = os.path.join(args.out, "race.png")
    drawn = race_figure(data, png)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"target": target, "old_target": old, "verdicts": verdicts,
                   "matched": MATCHED, "missing": missing(data),
                   "figure": {f"{rate} {prec}": m for (rate, prec), m in drawn.items()},
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
            f"repetition in an order rotated between them, in one timing session per precision "
            f"({sessions_text(data.get('session') or {})}); ms/iter, DP sync, "
            f"MiB/iter (whole job, payload) and compress ms are the median (min–max) over them, "
            f"after each run's warm-up. Time to target = the seed's loss curve priced at the "
            f"link's ms/iter (EDGC's: each iteration at the rank it ran, timed with EDGC "
            f"pinned at r{', r'.join(map(str, PINNED_RANKS))} and at r_max, its dense warm-up "
            f"at its own measured cost, an iteration the bypass sent dense at the dense "
            f"sync's), to dense fp32's val loss at {TARGET_FRACTION:.0%} of its run, the "
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
            "only where every one is above, open otherwise:\n\n" + goal_table(verdicts)
            + issue93_text(data, verdicts, png) + ("\n\nTime to each loss on the way (dense fp32's at 10, 25, 50 and 75 % "
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
