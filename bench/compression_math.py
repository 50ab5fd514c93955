#!/usr/bin/env python
"""The compression math alone, per iteration, on one process: ours against PyTorch's hook.

    python bench/compression_math.py [--configs tiny small] [--repeats 30] [--threads 1]

Issue 15, item 3: on the slow-link benchmark the hook wins at 1 Gbit, where the sync is
short and what is left is arithmetic. This isolates that arithmetic on the same gradient
shapes (the pure-DP layout of each config, every weight matrix at the slow-link benchmark's
r_max, one DP rank, so every collective is a no-op):

* ``ours``: one :class:`BucketCompressor` over the whole gradient, ``start`` → ``middle``
  → ``finish`` (error feedback, ``P = M Q``, QR, ``Q = Mᵀ P^``, ``M^ = P^ Qᵀ`` into the
  gradients, the local residual ``M − P^ Q_iᵀ``): four products per matrix.
* ``ours, before issue 33``: the step as it was (a stacked copy of the gradients,
  ``torch.linalg.qr``, one ``mm`` per matrix; ``bench/step_before.py``).
* ``hook``: ``torch.nn.parallel.DistributedDataParallel`` with PyTorch's
  ``powerSGD_hook`` (same rank, error feedback, warm start, same compression rule) on a
  world-1 gloo group, timed as one backward pass of a model whose parameters have the
  same shapes, minus the same backward with the plain all-reduce hook: the hook's
  arithmetic and bucket copies (three products per matrix; its residual is ``M − M^``).

Times are the process's CPU time (``time.process_time``, all its threads: the hook's
callbacks run on gloo's), so other work on the machine slows the clock less than it
would wall time; the arithmetic is the same either way. Variants alternate within each
repetition; each figure is the median over repetitions with its (min–max), each ratio
paired within a repetition. CPU times are for ratios only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.report import write_section  # noqa: E402
from bench.slow_links import CONFIGS, PURE_DP  # noqa: E402
from bench.roofline import PHASES, measure_peaks  # noqa: E402
from bench.step_before import BeforeBucketCompressor  # noqa: E402
from bench.step_phases import compare  # noqa: E402
from megatron_edgc.compression.matrices import is_compressible, matrix_shape  # noqa: E402
from megatron_edgc.compression.powersgd import BucketCompressor  # noqa: E402
from megatron_edgc.config import parse_config  # noqa: E402
from megatron_edgc.model_shapes import stage_param_shapes  # noqa: E402

MIN_COMPRESSION_RATE = 2.0


def config_shapes(config_file: str) -> list:
    cfg = parse_config(["--config", os.path.join(ROOT, config_file), *PURE_DP])
    return stage_param_shapes(cfg.model, cfg.parallel, cfg.data.tokenizer_vocab_size)[0]


class Ours:
    def __init__(self, shapes, rank, cls=BucketCompressor):
        self.entries = [(f"p{i}", matrix_shape(s)) for i, s in enumerate(shapes)]
        self.comp = cls(self.entries, rank, min_compression_rate=MIN_COMPRESSION_RATE, seed=1)
        gen = torch.Generator().manual_seed(0)
        self.sources = [[torch.randn(*s, generator=gen) for _, s in self.entries] for _ in range(2)]
        total = sum(n * m for _, (n, m) in self.entries)  # one flat buffer, as Megatron's
        flat, offsets = torch.empty(total), [0]
        for _, (n, m) in self.entries:
            offsets.append(offsets[-1] + n * m)
        self.grads = [flat[a:b].view(*s) for (_, s), a, b in
                      zip(self.entries, offsets, offsets[1:])]
        self.calls = 0

    def __call__(self) -> float:
        for g, s in zip(self.grads, self.sources[self.calls % 2]):
            g.copy_(s)  # a fresh gradient, as backward leaves it (outside the timing)
        self.calls += 1
        t = time.process_time()
        bufs, step = self.comp.start(self.grads)
        self.comp.finish(step, self.comp.middle(step, bufs))
        elapsed = (time.process_time() - t) * 1e3
        # applied, as the optimizer reports it (untimed): no give-back in the next start
        getattr(self.comp, "after_step", lambda applied: None)(True)
        return elapsed


class Hook:
    """One backward through DDP with a comm hook on a world-1 gloo group."""

    def __init__(self, shapes, rank, powersgd: bool):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        class Params(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(*s))
                                                  for s in shapes])

            def forward(self, coeffs):
                return sum((p * c).sum() for p, c in zip(self.ps, coeffs))

        # one bucket, as ours: two buckets' callbacks waiting on gloo collectives from
        # two threads deadlock on a world-1 group
        self.model = torch.nn.parallel.DistributedDataParallel(Params(), bucket_cap_mb=1024)
        if powersgd:
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                min_compression_rate=MIN_COMPRESSION_RATE, use_error_feedback=True,
                warm_start=True)
            self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            self.model.register_comm_hook(None, default_hooks.allreduce_hook)
        gen = torch.Generator().manual_seed(0)
        self.sources = [[torch.randn(*s, generator=gen) for s in shapes] for _ in range(2)]
        self.calls = 0

    def __call__(self) -> float:
        self.model.zero_grad(set_to_none=False)
        loss = self.model(self.sources[self.calls % 2])
        self.calls += 1
        t = time.process_time()
        loss.backward()
        return (time.process_time() - t) * 1e3


def spread(values, fmt="{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}–" \
           f"{fmt.format(max(values))}]"


def measure(config: str, repeats: int) -> dict:
    config_file, r_max, _ = CONFIGS[config]
    shapes = config_shapes(config_file)
    mats = [s for s in shapes if len(s) == 2]
    compressed = [s for s in mats if is_compressible(*s, r_max, MIN_COMPRESSION_RATE)]
    variants = {"ours": Ours(shapes, r_max), "ours, before issue 33": Ours(
                    shapes, r_max, BeforeBucketCompressor),
                "hook": Hook(shapes, r_max, True), "plain all-reduce hook": Hook(shapes, r_max,
                                                                                  False)}
    for fn in variants.values():  # warm-up: first Q, the hook's two plain iterations
        for _ in range(3):
            fn()
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(fn())
    hook_math = [h - p for h, p in zip(times["hook"], times["plain all-reduce hook"])]
    return {"config": config, "rank": r_max, "matrices": len(mats), "compressed": len(compressed),
            "times": times, "hook_math": hook_math,
            "after_vs_before": [a / b for a, b in zip(times["ours"],
                                                     times["ours, before issue 33"])],
            "ours_vs_hook": [a / b for a, b in zip(times["ours"], hook_math)]}


ROOFLINE_SHARDS = {"12.1b TP8·PP4 stage 0, hidden/4": ("gpt2-12.1b-h100x64", 4),
                   "2.5b TP4·PP2 stage 0, hidden/4": ("gpt2-2.5b-v100x32", 4)}
#: The race's model (bench/peers.py): its whole pure-DP bucket, in megatron-core's order
#: (the last parameter first), bf16 factors as the product ships (``--edgc-factor-dtype``).
RACE = "race: tiny-cpu TP1·PP1·DP4, bf16 factors"
#: The methods of each kind of row: the race's against the step of before issue 93; the
#: paper shards' against both befores.
RACE_METHODS = ("before-93", "after")
SHARD_METHODS = ("before", "before-93", "after")


def race_shapes() -> list:
    """The race's bucket: every gradient of ``configs/tiny-cpu.yaml`` at TP1·PP1·DP4 as a
    matrix (vectors ``1 x n``), the last parameter first, as megatron-core lays it out."""
    return [matrix_shape(s) for s in reversed(config_shapes(CONFIGS["tiny"][0]))]


def roofline(ranks, race_ranks, repeats: int, threads: int) -> str:
    """Each phase of the step against its floor, on this CPU: the race's bucket before and
    after issue 93, the paper shards before issue 33, before issue 93 and after."""
    from bench.gpu_kernels import shard_shapes

    peaks = measure_peaks("cpu", copy_mib=256, matmul_n=2048, repeats=5)
    cases = [(RACE, race_shapes(), rank, torch.bfloat16, RACE_METHODS) for rank in race_ranks]
    for label, (cluster, scale) in ROOFLINE_SHARDS.items():
        mats, rest, _ = shard_shapes(cluster, scale)
        cases += [(label, mats + [(1, rest)], rank, torch.float32, SHARD_METHODS)
                  for rank in ranks]
    rows = []
    for label, shapes, rank, factor_dtype, methods in cases:
        r = compare(shapes, rank, "cpu", peaks, repeats=repeats, warmup=1, methods=methods,
                    factor_dtype=factor_dtype)
        fl = r["floor_ms"]
        for method in methods:
            run = r["runs"][method]
            cells = [f"{run[p]:.1f} / {fl[p]:.1f} = **{run[p] / fl[p]:.1f}x**" for p in PHASES]
            tr = run.get("transient_bytes")
            rows.append(f"| {label} ({r['matrices']} matrices) | r{rank} | {method} | "
                        + " | ".join(cells)
                        + f" | {run['step']:.1f} [{run['step_min']:.1f}–{run['step_max']:.1f}]"
                        f" / {fl['step']:.1f} = **{run['step'] / fl['step']:.1f}x** | "
                        f"{run['ops']} | {run['ef_state_bytes'] / 2**20:.0f} | "
                        f"{'–' if tr is None else f'{tr / 2**20:.0f}'} |")
            print(rows[-1], flush=True)
    return "\n".join([
        f"This CPU, {threads} torch thread(s): copy {peaks['copy_bytes_per_s'] / 1e9:.1f} GB/s "
        f"(read + write, {peaks['copy_mib']} MiB fp32), matmul "
        f"{peaks['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s (fp32, {peaks['matmul_n']}³), "
        "measured in the same run. Floors from `bench/roofline.py` (bytes a step must move, "
        "flops it must do, per phase); each cell is measured ms / floor ms = ratio, median of "
        f"{repeats} steps (the step's min–max in brackets), the calling thread's CPU time "
        "(other work on the machine does not count; the step runs on that one thread). "
        "`before`: the step before issue 33 (stacked copy of the gradients, "
        "`torch.linalg.qr`); `before-93`: today's step with issue 93's changes undone (the "
        "orthogonalization per shape group, finiteness by `isfinite(x).all()`, the "
        "residual's and the warm start's selection by `torch.where`, one copy per dense "
        "tensor; `issue_93_undone` in `bench/step_phases.py`); `after`: "
        "today's. The race's rows: its model's whole bucket (`configs/tiny-cpu.yaml` at "
        "TP1·PP1·DP4), bf16 factors as the product ships; the shards' rows: fp32 factors. "
        "Orthogonalization: the step's method on this device (`orthonormalization()` in "
        "`megatron_edgc/compression/orthonormal.py`), timed alone on the step's factor "
        "shapes; middle: the middle phase without it. Ops: aten operations one step "
        "dispatches (views included; a `TorchDispatchMode` counts them). Gradients are views "
        "of one flat buffer in layer order, as megatron-core's bucket. Transient: peak RSS "
        "during one step minus the resident set before it, with every block of 1 MiB or more "
        "mapped on its own (glibc `M_MMAP_THRESHOLD`), so the resident set follows the live "
        "temporaries; timed with glibc as a training process runs in its steady state "
        "(blocks under 32 MiB from the heap, kept: `heap_as_in_training` in "
        "`bench/step_phases.py`).",
        "",
        "| shard | rank | step | start | orthogonalization | middle (without it) | finish "
        "| whole step | ops | EF state MiB | transient MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", "<!-- notes -->"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--roofline-ranks", type=int, nargs="*", default=[16, 64],
                   help="the paper shards' ranks in the roofline table")
    p.add_argument("--race-ranks", type=int, nargs="*", default=[8, 16, 24, 32],
                   help="the race's ranks in the roofline table (none of either: skip it)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: each of the benchmark's 4 ranks has half a core)")
    args = p.parse_args()
    if args.repeats < 3:
        p.error(f"--repeats must be >= 3, got {args.repeats}")
    torch.set_num_threads(args.threads)
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    for config in args.configs:
        m = measure(config, args.repeats)
        t = m["times"]
        rows.append(f"| {config} | r{m['rank']} ({m['compressed']} of {m['matrices']} matrices) "
                    f"| {spread(m['after_vs_before'])}x | {spread(m['ours_vs_hook'])}x "
                    f"| {spread(t['ours'], '{:.1f}')} | {spread(t['ours, before issue 33'], '{:.1f}')}"
                    f" | {spread(m['hook_math'], '{:.1f}')} |")
        print(rows[-1], flush=True)
    dist.destroy_process_group()
    if args.roofline_ranks or args.race_ranks:
        write_section("compression_floor", "The compressed step against its floor (issue 33)",
                      "python bench/compression_math.py " + " ".join(sys.argv[1:]),
                      roofline(args.roofline_ranks, args.race_ranks, args.repeats,
                               args.threads))
    body = "\n".join([
        f"One process, {args.threads} torch thread(s), {args.repeats} repetitions (variants "
        "alternating); the whole pure-DP gradient of each config, one DP rank (collectives "
        "are no-ops). CPU time of the process, median [min–max]; ratios paired within a "
        "repetition. The ms columns are context for the ratios, not absolute claims.",
        "",
        "| config | rank | ours / ours before issue 33 | ours / hook | ours ms | before ms "
        "| hook math ms (backward with powerSGD_hook − with the plain hook) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "<!-- notes -->"])
    write_section("compression_math", "Compression math alone: ours against PyTorch's hook",
                  "python bench/compression_math.py " + " ".join(sys.argv[1:]), body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
