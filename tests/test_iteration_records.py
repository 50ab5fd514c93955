"""The timed iteration of both front-ends (runtime/frontend.py's IterationRecords): what
EDGC's runtime does after the optimizer step is inside it (issue 93, item 1), one
process, on a clock that reads the work charged to it."""

import pytest

from megatron_edgc.runtime.frontend import IterationRecords


class _WorkClock:
    """Reads the milliseconds of work charged to it, not the host's: exact beside any
    load."""

    use_cuda = False

    def __init__(self):
        self.now = 0.0

    def stamp(self) -> float:
        return self.now

    def ms_between(self, start, end) -> float:
        return end - start

    def wait(self) -> None:
        pass


class _Runtime:
    """EdgcRuntime's end_step and flush, the first charging ``controller_ms`` of work (the
    outcome settled, the telemetry taken, the controller's decision) to ``clock``."""

    def __init__(self, clock: _WorkClock, controller_ms: float):
        self.clock, self.controller_ms = clock, controller_ms
        self.ended = []

    def end_step(self, iteration: int, record: dict) -> dict:
        self.clock.now += self.controller_ms
        self.ended.append(iteration)
        record["rank_dp"] = [8]           # what the controller adds to the record
        return record

    def flush(self, wait: bool = True) -> None:
        pass


class _Writer:
    def __init__(self):
        self.rows = []

    def write(self, record: dict) -> None:
        self.rows.append(dict(record))

    def close(self) -> None:
        pass


def test_the_controller_work_after_the_step_is_inside_the_timed_iteration():
    """Issue 93: ``iter_ms`` runs from the iteration's first work to the end of the
    runtime's ``end_step``, not to the optimizer step only: 40 ms of step and 2.5 ms of
    controller work price an iteration at 42.5 ms (it read 40 before, the 2.5 in no
    iteration). ``end_step`` runs once per iteration with its 0-based number, and its
    additions are in the record written."""
    clock = _WorkClock()
    runtime = _Runtime(clock, controller_ms=2.5)
    writer = _Writer()
    records = IterationRecords([writer], runtime)
    records.clock = clock
    for it in range(1, 4):
        records.begin()
        clock.now += 40.0                 # forward, backward, sync, optimizer step
        record = records.end(it, loss=1.0, lr=1e-3, grad_norm=1.0, skipped=False,
                             tokens=1000)
        assert record["rank_dp"] == [8]
        clock.now += 7.0                  # between iterations: in no iteration
    done = records.flush()
    assert runtime.ended == [0, 1, 2]
    assert [r["iter_ms"] for r in done] == pytest.approx([42.5] * 3)
    assert [r["iter_ms"] for r in writer.rows] == pytest.approx([42.5] * 3)
    assert all(r["rank_dp"] == [8] for r in writer.rows)
    assert done[0]["tokens_per_s"] == pytest.approx(1000 / 0.0425)


def test_without_a_runtime_the_iteration_ends_at_the_step():
    """A front-end without EDGC's runtime (``runtime=None``) times its step alone."""
    clock = _WorkClock()
    records = IterationRecords([], None)
    records.clock = clock
    records.begin()
    clock.now += 40.0
    records.end(1, loss=1.0, lr=1e-3, grad_norm=None, skipped=False, tokens=10)
    clock.now += 3.0
    assert [r["iter_ms"] for r in records.flush()] == pytest.approx([40.0])
