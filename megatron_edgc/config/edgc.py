"""EDGC's knobs as data: the method (what is compressed, how), the controller (how edgc
mode picks the rank) and diagnostics (study, debug, validation and benchmark switches),
declared in that order, each field tagged with its group. Attribute access stays flat
(``cfg.edgc.rank``); the groups order ``--help`` and the plug-in's flags."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_edgc.config.knobs import ConfigError, knob


@dataclass
class EdgcConfig:
    """Gradient compression of Megatron's DP gradient sync (EDGC §1).

    YAML section ``edgc:`` with keys ``mode``, ``rank``, ...; flags ``--edgc-mode``, ...
    """

    FLAG_PREFIX = "edgc_"
    #: ``group`` key of a field -> (argparse group title, description), in --help order.
    GROUPS = {
        "method": ("EDGC method", "what is compressed and how: PowerSGD on the DP gradient "
                                  "sync and on pipeline backward sends (megatron_edgc)"),
        "controller": ("EDGC controller", "how --edgc-mode edgc chooses the rank per window "
                                          "(defaults: the paper's, EDGC §8)"),
        "diagnostics": ("EDGC diagnostics", "study, debug, validation and benchmark switches; "
                                            "off by default"),
    }

    # The method: DP compression (EDGC §1), its wire format, and PP backward sends (§7).
    mode: str = knob("off", "off: plain megatron-core DP sync; static: PowerSGD at --edgc-rank; "
                            "edgc: rank chosen per stage by the entropy controller",
                     choices=("off", "static", "edgc"), group="method")
    rank: int = knob(8, "PowerSGD rank (static mode)", min=1, group="method")
    min_compression_rate: float = knob(
        2.0, "compress a matrix only if it shrinks at least this much: (n+m) r x rate <= n m",
        min=1.0, group="method")
    start_iter: int = knob(0, "iterations of dense DP sync before compression starts", min=0,
                           group="method")
    bypass: str = knob("auto", "auto: send a bucket dense when the communication time its "
                               "compression saves (alpha-beta link measured on the DP group) "
                               "is below the measured compress + decompress time; off: always "
                               "compress (force)", choices=("auto", "off"), group="method")
    link_gbps: Optional[float] = knob(None, "bypass: declare the DP all-reduce rate in Gbit/s "
                                            "instead of measuring it", min=0.0,
                                      min_exclusive=True, group="method")
    link_latency_ms: Optional[float] = knob(None, "bypass: the declared link's latency per "
                                                  "collective in ms (with --edgc-link-gbps; "
                                                  "default 0): a measured link's is in every "
                                                  "record, dp_link_alpha_ms", min=0.0,
                                            group="method")
    link_window: int = knob(50, "bypass: every this many iterations, refit each measured "
                                "link from the job's own collectives of the window (their "
                                "bytes and device-timed durations; no probes) and re-decide "
                                "which buckets go dense; 0: measure once at start-up",
                            min=0, group="method")
    link_explore: int = knob(4, "bypass: every this many link windows, one iteration sends "
                                "each bucket the other way (dense where it compresses, "
                                "compressed where it goes dense), so that the choice not "
                                "taken stays measured in the job (its transfers, its local "
                                "work): a compressed bucket's small transfers cannot tell "
                                "that the link got fast; 0: never", min=0, group="method")
    fallback_iters: int = knob(20, "a bucket whose factorizations keep failing from finite "
                                   "gradients is sent dense for this many iterations, then "
                                   "compressed again; the interval doubles while failures "
                                   "repeat (up to 64x) and resets after as many iterations "
                                   "compressed without one", min=1, group="method")
    factor_dtype: str = knob("bf16", "dtype of the PowerSGD factors P and Q on the wire: "
                                     "bf16 halves their bytes (all math and the error "
                                     "feedback stay fp32; the dense rest travels in fp32); "
                                     "paired against fp32 on three testbeds x 3 seeds the val "
                                     "loss differed inside the seed spread (BENCHMARKS.md)",
                             choices=("fp32", "bf16"), group="method")
    ef_dtype: str = knob("auto", "dtype of the PowerSGD error-feedback residual kept between "
                                 "steps: bf16 halves that state, its rounding not fed back "
                                 "(paired against fp32 on three testbeds x 3 seeds every "
                                 "val-loss difference was inside the seed spread, "
                                 "BENCHMARKS.md issue 33); auto: bf16 where the device's "
                                 "bf16 error-feedback kernels cost at most 2x fp32's on a "
                                 "GPU (its memory is worth it), timed at start-up; on the "
                                 "host fp32 (CPUs measured 1.24-1.81x); "
                                 "checkpointed with it",
                         choices=("auto", "fp32", "bf16"),
                         group="method")
    dense_wire: str = knob("bf16", "dtype on the wire of every dense sync of a compressed "
                                   "run (the warm-up, the bypass, the uncompressed rest of a "
                                   "compressed bucket): bf16: bf16 on fp32 buffers, half the "
                                   "bytes, its rounding not fed back (torch's "
                                   "bf16_compress_hook), and with bf16 factors the rest "
                                   "joins P's collective; 16-bit buffers keep their own; "
                                   "grad: the gradient buffer's dtype (megatron-core's own "
                                   "sync, bit for bit, until compression starts); "
                                   "--edgc-mode off always syncs as megatron-core does",
                           choices=("grad", "bf16"), group="method")
    pp_compression: str = knob("off", "pipeline backward sends: off: dense; static: "
                                      "rank --edgc-pp-rank; edgc: rank chosen by its own "
                                      "entropy controller (needs --edgc-mode edgc)",
                               choices=("off", "static", "edgc"), group="method")
    pp_rank: int = knob(8, "rank of compressed backward sends (static PP compression)", min=1,
                        group="method")
    pp_epilogue_only: bool = knob(False, "compress only the backward sends of the 1F1B "
                                         "cool-down, where they are on the critical path",
                                  group="method")

    # The controller (edgc mode), EDGC §2-6: windows, entropy sampling (GDS), the rank
    # model (CQM) or the time budget, warm-up, the PP controller, stage alignment (DAC).
    controller: str = knob("paper", "edgc mode's rank controller after the warm-up: paper: "
                                    "entropy change -> rank (CQM, EDGC §4, with DAC); budget: "
                                    "per-matrix-shape ranks that spend --edgc-time-budget where "
                                    "PowerSGD's measured residual falls most "
                                    "(megatron_edgc/control/rank_allocation.py)",
                           choices=("paper", "budget"), group="controller")
    window: int = knob(1000, "window w in iterations between rank decisions (paper: 1000)",
                       min=1, group="controller")
    iter_sample_rate: float = knob(0.1, "GDS iteration sampling rate α: entropy is measured on "
                                        "every round(1/α)-th iteration of a window",
                                   min=0.0, max=1.0, min_exclusive=True, group="controller")
    grad_sample_rate: float = knob(0.25, "GDS gradient sampling rate β: fraction of a stage's "
                                         "gradient elements in the entropy sample",
                                   min=0.0, max=1.0, min_exclusive=True, group="controller")
    rank_max: int = knob(64, "r_max: the rank when warm-up ends, and the upper clamp", min=1,
                         group="controller")
    rank_min: Optional[int] = knob(None, "r_min: the lower clamp (default r_max / 4)", min=1,
                                   group="controller")
    rank_step: int = knob(8, "s: the largest rank change per window", min=1, group="controller")
    warmup_eps: float = knob(0.01, "ε_H: warm-up ends when the window-mean entropy moves less "
                                   "than this (nats) ...", min=0.0, min_exclusive=True,
                             group="controller")
    warmup_windows: int = knob(2, "... for this many consecutive windows (K)", min=1,
                               group="controller")
    warmup_max_iters: Optional[int] = knob(None, "end warm-up here at the latest (default: "
                                                 "--edgc-warmup-max-fraction of the run)",
                                           min=1, group="controller")
    warmup_max_fraction: float = knob(0.02, "without --edgc-warmup-max-iters, the dense "
                                           "warm-up ends at the latest at the first window "
                                           "end from this fraction of --train-iters: "
                                           "compression runs at r_max from there, and the "
                                           "paper controller's rank decisions wait for the "
                                           "stability rule (1: no bound, the paper's setting)",
                                      min=0.0, max=1.0, min_exclusive=True,
                                      group="controller")
    entropy: str = knob("gaussian", "entropy estimator", choices=("gaussian", "histogram"),
                        group="controller")
    g: str = knob("marchenko-pastur", "g(r) of the rank model: Gaussian theory, or residuals "
                                      "measured on the real gradients at warm-up end",
                  choices=("marchenko-pastur", "calibrated"), group="controller")
    time_budget: float = knob(0.5, "budget controller: the DP sync's time per iteration "
                                   "(its collectives over the bypass's link model in force "
                                   "plus the timed compression math) as a fraction of its "
                                   "time with every shape at r_max", min=0.0, max=1.0,
                              min_exclusive=True, group="controller")
    budget_schedule: str = knob("constant", "budget controller over time: constant: the same "
                                            "budget every window; lr: the window's budget "
                                            "follows sqrt(LR) with the same mean over the "
                                            "compressed windows (an error costs more while the "
                                            "LR is high)", choices=("constant", "lr"),
                                group="controller")
    budget_step_limit: str = knob("off", "budget controller: on: each matrix shape's rank "
                                         "moves at most --edgc-rank-step per window (EDGC's "
                                         "step limit s); off: any change",
                                  choices=("off", "on"), group="controller")
    budget_weight: str = knob("elements", "budget controller: what a matrix shape's error "
                                          "costs: elements: its relative error times its "
                                          "element count; adam: its residual as Adam's "
                                          "update sees it (divided by the optimizer's second "
                                          "moment, read at each window end)",
                              choices=("elements", "adam"), group="controller")
    pp_rank_max: int = knob(64, "PP r_max: the PP rank when its warm-up ends, and the upper "
                                "clamp (edgc PP compression)", min=1, group="controller")
    pp_rank_min: Optional[int] = knob(None, "PP r_min: the lower clamp (default "
                                            "--edgc-pp-rank-max / 4)", min=1,
                                      group="controller")
    dac: str = knob("on", "DAC: later pipeline stages spend their slack on a higher DP rank "
                          "so that all stages finish their DP sync together (edgc mode, "
                          "PP > 1)", choices=("on", "off"), group="controller")

    # Diagnostics: none is needed to train.
    check_table: bool = knob(False, "debug: compare a hash of the rank table over all ranks "
                                    "at every window end and fail loudly on a mismatch",
                             group="diagnostics")
    check_replicas: bool = knob(False, "debug: every iteration, compare a digest of each "
                                       "DDP bucket's parameters over the group it is reduced "
                                       "on (JSONL dp_replica_mismatches: 0 when every "
                                       "replica is bit-identical)", group="diagnostics")
    compress_single_replica: bool = knob(
        False, "validation: compress buckets reduced over a single replica too (DP 1, "
               "expert-DP 1), which by default are left to megatron-core (nothing to send, "
               "nothing to approximate): exercises the compression path on one device",
        group="diagnostics")
    debug_dump: Optional[str] = knob(
        None, "debug: at the first iteration a compressed bucket is flagged (non-finite, or "
              "a basis stood in for a failed factorization), write each flagged bucket's "
              "step (its gradients, residual, warm start, rank, dtypes and summed factors) "
              "into this directory, one file per rank and bucket, and the summed factors "
              "that stood in (*.factors.pt), for scripts/replay_step.py; copies every "
              "compressed bucket's inputs and reads its flags each step (slow)",
        group="diagnostics")
    entropy_reference: bool = knob(False, "benchmark: also estimate the entropy of the full "
                                          "gradient every iteration (JSONL entropy_full, "
                                          "entropy_full_ms); changes no decision",
                                   group="diagnostics")
    grad_stats: bool = knob(False, "study: on measured iterations also record the sampled "
                                   "gradient's skewness and excess kurtosis per stage and the "
                                   "entropy per layer type (JSONL grad_skew, grad_kurt, "
                                   "entropy_by_type); changes no decision", group="diagnostics")

    def resolve(self) -> None:
        """Derived defaults and the rules among these flags (the rules against the rest of
        the run: :func:`~megatron_edgc.config.rules.validate_edgc`)."""
        if self.rank_min is None:
            self.rank_min = max(1, self.rank_max // 4)
        if self.rank_min > self.rank_max:
            raise ConfigError("--edgc-rank-min", f"must be <= --edgc-rank-max ({self.rank_max}),"
                                                 f" got {self.rank_min}")
        if self.pp_rank_min is None:
            self.pp_rank_min = max(1, self.pp_rank_max // 4)
        if self.pp_rank_min > self.pp_rank_max:
            raise ConfigError("--edgc-pp-rank-min", f"must be <= --edgc-pp-rank-max "
                                                    f"({self.pp_rank_max}), got {self.pp_rank_min}")
        if self.budget_weight == "adam" and (self.mode != "edgc" or self.controller != "budget"):
            raise ConfigError("--edgc-budget-weight", "adam weighs the budget controller's "
                                                      "allocation: needs --edgc-mode edgc "
                                                      "--edgc-controller budget")
        if self.g == "calibrated" and self.controller == "budget":
            raise ConfigError("--edgc-g", "calibrated fits the paper controller's rank model "
                                          "(--edgc-controller paper); the budget controller "
                                          "has no rank model")
        if self.pp_compression == "edgc" and self.mode != "edgc":
            raise ConfigError("--edgc-pp-compression", "edgc needs --edgc-mode edgc (the "
                                                       "window machinery); use static otherwise")

    def warmup_bounds(self, train_iters: int) -> tuple:
        """``(warmup_max_iters, dense_max_iters)`` of the controller: ``warmup_max_iters``
        where given ends the warm-up there; else ``warmup_max_fraction`` of the run bounds
        its dense part, and the paper controller's rank decisions still wait for the
        stability rule (the budget controller decides from measured residuals, not the
        entropy: its warm-up ends there). ``(None, None)``: the stability rule alone."""
        if self.warmup_max_iters is not None:
            return self.warmup_max_iters, None
        if self.warmup_max_fraction >= 1.0:
            return None, None
        bound = max(1, math.ceil(self.warmup_max_fraction * train_iters))
        return (bound, None) if self.controller == "budget" else (None, bound)

    @property
    def dac_active(self) -> bool:
        return self.mode == "edgc" and self.dac == "on" and self.controller == "paper"
