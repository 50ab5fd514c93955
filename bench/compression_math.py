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
* ``ours, unfused finish``: the same with the finish as it was before this benchmark
  (``bmm`` into a temporary, a copy per gradient, ``M − bmm`` into a new tensor): the
  before/after of the fused finish, bit-identical results (tests/test_powersgd.py).
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
from megatron_edgc.compression.powersgd import (BucketCompressor, is_compressible,  # noqa: E402
                                                matrix_shape)
from megatron_edgc.config import parse_config  # noqa: E402
from megatron_edgc.model_shapes import stage_param_shapes  # noqa: E402

MIN_COMPRESSION_RATE = 2.0


class UnfusedFinish(BucketCompressor):
    """``finish`` as it was before the fused one (the before of the before/after)."""

    def finish(self, step, reduced_q):
        offset = 0
        for key, g in self.groups.items():
            k, r = len(g.indices), self._rank_for(g)
            q = reduced_q[offset:offset + k * g.m * r].view(k, g.m, r).float()
            offset += k * g.m * r
            approx = torch.bmm(step.p_hat[key], q.transpose(1, 2))
            for j, i in enumerate(g.indices):
                step.grads[i].copy_(approx[j])
            g.residual = step.m[key] - torch.bmm(step.p_hat[key], step.q_sent[key].transpose(1, 2))
            g.q = q.clone()


def config_shapes(config_file: str) -> list:
    cfg = parse_config(["--config", os.path.join(ROOT, config_file), *PURE_DP])
    return stage_param_shapes(cfg.model, cfg.parallel, cfg.data.tokenizer_vocab_size)[0]


class Ours:
    def __init__(self, shapes, rank, cls=BucketCompressor):
        self.entries = [(f"p{i}", matrix_shape(s)) for i, s in enumerate(shapes)]
        self.comp = cls(self.entries, rank, min_compression_rate=MIN_COMPRESSION_RATE, seed=1)
        gen = torch.Generator().manual_seed(0)
        self.sources = [[torch.randn(*s, generator=gen) for _, s in self.entries] for _ in range(2)]
        self.grads = [torch.empty(*s) for _, s in self.entries]
        self.calls = 0

    def __call__(self) -> float:
        for g, s in zip(self.grads, self.sources[self.calls % 2]):
            g.copy_(s)  # a fresh gradient, as backward leaves it (outside the timing)
        self.calls += 1
        t = time.process_time()
        bufs, step = self.comp.start(self.grads)
        self.comp.finish(step, self.comp.middle(step, bufs))
        return (time.process_time() - t) * 1e3


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
    variants = {"ours": Ours(shapes, r_max), "ours, unfused finish": Ours(shapes, r_max,
                                                                          UnfusedFinish),
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
            "fused_vs_unfused": [a / b for a, b in zip(times["ours"],
                                                      times["ours, unfused finish"])],
            "ours_vs_hook": [a / b for a, b in zip(times["ours"], hook_math)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--repeats", type=int, default=30)
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
                    f"| {spread(m['fused_vs_unfused'])}x | {spread(m['ours_vs_hook'])}x "
                    f"| {spread(t['ours'], '{:.1f}')} | {spread(t['ours, unfused finish'], '{:.1f}')}"
                    f" | {spread(m['hook_math'], '{:.1f}')} |")
        print(rows[-1], flush=True)
    dist.destroy_process_group()
    body = "\n".join([
        f"One process, {args.threads} torch thread(s), {args.repeats} repetitions (variants "
        "alternating); the whole pure-DP gradient of each config, one DP rank (collectives "
        "are no-ops). CPU time of the process, median [min–max]; ratios paired within a "
        "repetition. The ms columns are context for the ratios, not absolute claims.",
        "",
        "| config | rank | ours fused / ours unfused | ours / hook | ours ms | ours unfused ms "
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
