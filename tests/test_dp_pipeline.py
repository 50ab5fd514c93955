"""The bucket pipeline's accounting, in one process (megatron_edgc.patches.dp_pipeline):
what a bucket's local work holds, the figure the bypass prices its choice by."""

import time

import pytest

from megatron_edgc.patches.dp_pipeline import BucketPipeline, Phase
from megatron_edgc.patches.dp_stats import DPSyncStats


class _Sleeping:
    """A collective that takes ``seconds`` to complete: the pipeline's accounting alone."""

    group, slow_hop, nbytes = None, False, 4

    def __init__(self, seconds: float):
        self.seconds = seconds

    def issue(self):
        seconds = self.seconds

        class Handle:
            def wait(self):
                time.sleep(seconds)

        return Handle()


def test_a_buckets_local_work_holds_its_own_inline_collectives_but_not_the_common_ones():
    """Issue 80: on the slow hop a compressed bucket runs collectives inside the instance
    (inline) that the dense path does not; they are its local work, priced by the bypass.
    The fast hop's reduce-scatter, which both choices run (``common``), and the phases on
    the priced link are not."""
    common, own, math, on_link = 0.2, 0.05, 0.01, 0.2

    def strategy():
        yield Phase([_Sleeping(common)], inline=True, common=True)
        time.sleep(math)
        yield Phase([_Sleeping(own)], inline=True)
        yield Phase([_Sleeping(on_link)])
        return None

    stats = DPSyncStats()
    pipeline = BucketPipeline(stats)
    pipeline.start("b0", False, strategy(), dense=False)
    pipeline.finish()
    stats.resolve()
    assert own + math <= stats.local_s["b0"] < own + math + 0.15, stats.local_s
    assert stats.comm_s >= common + own + on_link
    assert stats.compress_s == pytest.approx(math, abs=0.15)
    assert stats.collectives == 3
