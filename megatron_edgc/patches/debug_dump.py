"""``--edgc-debug-dump DIR``: each compressed bucket step's inputs kept until its flags are
read, and written where a flag is set, at the first such iteration only (issue 50); where
a basis stood in for a failed factorization, also the summed factors of the matrices that
stood in, orthonormalized again on the device (``*.factors.pt``: megabytes where the whole
capture is gigabytes; issue 56).

A debug switch, slow on purpose: it copies every flat-compressed bucket's gradients and
state each step and reads the bucket's flags at its end (a host sync). The slow hop's
shards are not captured.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_edgc.compression.powersgd import BucketCompressor
from megatron_edgc.compression.step_capture import StepCapture


class DebugDump:
    """Captures into ``directory`` (``iter{I}-rank{R}-{bucket}.pt``, ``I`` 1-based); each
    written file is named in an event of the step's stats."""

    def __init__(self, directory: str, rank: int):
        self.directory, self.rank = directory, rank
        self.iteration = 0                      # 0-based, set by the DP compression
        self.dumped_at: Optional[int] = None    # the iteration written (the only one)

    def begin(self, plan, grads) -> Optional[StepCapture]:
        """A capture of ``plan``'s step over ``grads``, before it starts; None once another
        iteration was written, or for a shard of the slow hop."""
        if self.dumped_at not in (None, self.iteration):
            return None
        if not isinstance(plan.compressor, BucketCompressor):
            return None
        return StepCapture(plan.compressor, grads, iteration=self.iteration + 1,
                           bucket=plan.key, rank=self.rank)

    def end(self, capture: StepCapture, flags: torch.Tensor, events: list) -> None:
        """After the step: reads its flags (a host sync) and writes the capture where one
        is set."""
        bad, factors = flags.tolist()
        if not (bad or factors):
            return
        self.dumped_at = self.iteration
        rec = capture.record
        rec["cause"] = "a failed factorization, or non-finite factors, from finite " \
            "gradients" if factors else "non-finite gradient"
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory,
                            f"iter{rec['iteration']}-rank{self.rank}-{rec['bucket']}.pt")
        torch.save(rec, path)
        events.append(f"{rec['bucket']} ({rec['cause']}): step captured in {path} "
                      f"(python scripts/replay_step.py {path})")
        if factors:   # the failing factors alone: what a GPU run can bring back
            factors_path = path[:-len(".pt")] + ".factors.pt"
            torch.save(capture.stood_in_factors(), factors_path)
            events.append(f"{rec['bucket']}: the factors that stood in, in {factors_path}")
