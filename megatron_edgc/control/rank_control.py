"""The controller interface the EDGC driver calls (:class:`RankControl`), the paper's
implementation of it (:class:`PaperControl`), and what attaches to it.

Both DP rank controllers — the paper's (CQM per stage, EDGC §3–5) and the budget
controller (:class:`~megatron_edgc.runtime.budget.BudgetControl`) — run
:class:`~megatron_edgc.control.controller.RankController`'s warm-up and window machinery;
they differ in what a table entry is (one rank, or ranks per matrix shape), how it
travels as ints, what it reports, and what it is fed besides entropy. Two things attach
to a control and follow its windows:

* ``alignment``, a :class:`TableAlignment` (DAC, EDGC §6:
  :class:`~megatron_edgc.runtime.dac.StageTimeFits`), which probes two ranks after the
  warm-up, is fed the measured stage times and reworks the table at each window end;
* ``pipeline``, a one-entry :class:`RankController` of the pipeline rank (EDGC §7), fed
  its own entropy stream; its entry travels with the DP table.

The driver calls, per iteration: :meth:`~RankControl.should_measure`,
:meth:`~RankControl.rank_in_force`, :meth:`~RankControl.observe`,
:meth:`~RankControl.observe_times`, :meth:`~RankControl.record`,
:meth:`~RankControl.end_iteration`; at a window end :meth:`~RankControl.window_end`; for
checkpoints the ``state_dict`` pair and :meth:`~RankControl.encode_table`. Pure: what
needs a process group (the budget's spectrum, the calibrated ``g``, the table's
broadcast) is handed in by the runtime.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional, Protocol, Sequence

from megatron_edgc.control.controller import RankController
from megatron_edgc.control.rank_model import RankModel


class TableAlignment(Protocol):
    """What reworks a control's table at each window end from measured times (DAC)."""

    def probe_rank(self, iteration: int, warmup_end_iter: Optional[int]) -> Optional[int]:
        """The rank every stage runs at ``iteration`` instead of the table, or None."""

    def observe(self, ranks: list, stage_times: dict) -> None:
        """One iteration: the rank in force per stage and the per-stage mean times."""

    def window_end(self, table: list) -> list:
        """The table to install for the next window (``table``: the controller's)."""

    def record(self) -> dict:
        """Telemetry of the alignment (empty before it has any)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Calibration(Protocol):
    """``--edgc-g calibrated``: the rank models' ``g`` from the real gradients (EDGC §4)."""

    def capture(self, key: str) -> None:
        """A measured warm-up iteration: bucket ``key``'s local gradient is ready."""

    def fit(self, rank_models: list) -> tuple[list, list]:
        """At warm-up end: ``(rank models, curves)``, a curve None where not measured."""


class RankControl(ABC):
    """A DP rank controller as the driver drives it (see the module's docstring).

    ``controller`` holds the warm-up and window state and the decided ``table`` (one
    entry per stage, None for dense); ``installed`` below is the table in force, as the
    driver received it from the broadcast.
    """

    def __init__(self, controller: RankController, *,
                 alignment: Optional[TableAlignment] = None,
                 pipeline: Optional[RankController] = None):
        self.controller, self.alignment, self.pipeline = controller, alignment, pipeline
        self.settings = controller.settings
        self.num_stages = controller.num_stages

    # ------------------------------------------------------------------ the schedule

    @property
    def in_warmup(self) -> bool:
        return self.controller.in_warmup

    @property
    def warmup_end_iter(self) -> Optional[int]:
        return self.controller.warmup_end_iter

    def should_measure(self, iteration: int) -> bool:
        return self.controller.should_measure(iteration)

    def window_of(self, iteration: int) -> int:
        return self.controller.window_of(iteration)

    def is_window_end(self, iteration: int) -> bool:
        return (iteration + 1) % self.settings.window == 0

    # ------------------------------------------------------------------ per iteration

    def probe_rank(self, iteration: int) -> Optional[int]:
        """The alignment's probe rank of every stage at ``iteration``, or None."""
        if self.alignment is None:
            return None
        return self.alignment.probe_rank(iteration, self.controller.warmup_end_iter)

    def rank_in_force(self, iteration: int, installed: list, stage: int):
        """What ``stage``'s DP compression runs at ``iteration`` (None: dense)."""
        probe = self.probe_rank(iteration)
        return probe if probe is not None else installed[stage]

    def see_gradient(self, key: str) -> None:
        """A measured iteration: bucket ``key``'s local gradient is ready (before its
        sync). Nothing by default."""

    def observe(self, iteration: int, entropies: Sequence[float],
                pp_entropy: Optional[float] = None) -> None:
        """A measured iteration's per-stage entropies (and the pipeline's)."""
        if self.pipeline is not None:
            self.pipeline.observe(iteration, [pp_entropy])
        self.controller.observe(iteration, entropies)

    def observe_times(self, iteration: int, installed: list,
                      stage_times: Optional[dict]) -> None:
        """The iteration's per-stage mean times, for the alignment."""
        if self.alignment is not None and stage_times is not None:
            self.alignment.observe(self.applied_ranks(iteration, installed), stage_times)

    @abstractmethod
    def applied_ranks(self, iteration: int, installed: list) -> list:
        """Telemetry: the rank in force per stage, as a number (None: dense)."""

    @abstractmethod
    def record(self, installed: list) -> dict:
        """Telemetry of the ranks in force this iteration."""

    def end_iteration(self, iteration: int) -> dict:
        """After every iteration: at a window end the controllers decide (the new tables
        apply once :meth:`window_end` installed them). Returns telemetry."""
        was_warmup = self.controller.in_warmup
        self._before_decision(iteration)
        self.controller.end_iteration(iteration)
        record = self._warmup_ended(iteration) \
            if was_warmup and not self.controller.in_warmup else {}
        if self.pipeline is not None:
            self.pipeline.end_iteration(iteration)
        return record

    def _before_decision(self, iteration: int) -> None:
        """Hook: feed the controller what it decides from besides entropy."""

    def _warmup_ended(self, iteration: int) -> dict:
        """Hook: the warm-up ended at this iteration's window end; returns telemetry."""
        return {}

    def status(self) -> dict:
        """Telemetry of the machinery: warm-up, and the alignment's fit."""
        record = {"edgc_warmup": self.controller.in_warmup}
        if self.controller.warmup_end_iter is not None:
            record["warmup_end_iter"] = self.controller.warmup_end_iter
        if self.controller.dense_end_iter is not None:   # compression from here on
            record["dense_end_iter"] = self.controller.dense_end_iter
        if self.alignment is not None:
            record.update(self.alignment.record())
        return record

    # ------------------------------------------------------------------ window end

    def window_end(self, broadcast: Callable[[list], list]) -> tuple[list, Optional[int]]:
        """Window end: the decided table (aligned), and the pipeline rank, as ints through
        ``broadcast`` (one list of ints, the same on every rank after it); returns the
        ``(DP table, pipeline rank)`` to install."""
        table = list(self.controller.table)
        if self.alignment is not None:
            table = self.alignment.window_end(table)
        pp = self.pipeline.table[0] if self.pipeline is not None else None
        shared = broadcast(self._to_ints(table) + [pp])
        return self._from_ints(shared[:-1], table), shared[-1]

    @abstractmethod
    def _to_ints(self, table: list) -> list:
        """The table as a flat list of ints (None: dense)."""

    @abstractmethod
    def _from_ints(self, values: list, like: list) -> list:
        """Inverse of :meth:`_to_ints`; ``like`` is the table that was flattened."""

    # ------------------------------------------------------------------ checkpoint

    def encode_table(self, table: list) -> list:
        """An installed table in its checkpoint form."""
        return list(table)

    def decode_table(self, saved: list) -> list:
        return list(saved)

    def table_hash(self) -> str:
        return self.controller.table_hash()

    def state_dict(self) -> dict:
        """This control's part of the driver's checkpoint state (its keys)."""
        state = {"controller": self.controller.state_dict(),
                 "pp_controller": self.pipeline.state_dict()
                 if self.pipeline is not None else None}
        if self.alignment is not None:
            state.update(self.alignment.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
        if self.pipeline is not None and state.get("pp_controller") is not None:
            self.pipeline.load_state_dict(state["pp_controller"])
        if self.alignment is not None:
            self.alignment.load_state_dict(state)


class PaperControl(RankControl):
    """The paper's controller (EDGC §3–5): per stage, the rank model turns the window's
    entropy change into a rank (:class:`~megatron_edgc.control.controller.RankController`
    with one :class:`RankModel` per stage); DAC may attach. With ``calibration`` the rank
    models' ``g`` is measured on the real gradients at warm-up end."""

    def __init__(self, controller: RankController, *,
                 alignment: Optional[TableAlignment] = None,
                 pipeline: Optional[RankController] = None,
                 calibration: Optional[Calibration] = None):
        super().__init__(controller, alignment=alignment, pipeline=pipeline)
        self.calibration = calibration
        self.calibrated_g: Optional[list] = None

    def see_gradient(self, key: str) -> None:
        if self.calibration is not None and self.controller.in_warmup:
            self.calibration.capture(key)

    def applied_ranks(self, iteration: int, installed: list) -> list:
        probe = self.probe_rank(iteration)
        return [probe] * self.num_stages if probe is not None else list(installed)

    def record(self, installed: list) -> dict:
        return {"rank_cqm": list(self.controller.table)}   # in force this iteration

    def _warmup_ended(self, iteration: int) -> dict:
        if self.calibration is None:
            return {}
        self.controller.rank_models, self.calibrated_g = self.calibration.fit(
            self.controller.rank_models)
        return {"g_calibrated": self.calibrated_g}

    def _to_ints(self, table: list) -> list:
        return list(table)

    def _from_ints(self, values: list, like: list) -> list:
        return list(values)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "calibrated_g": self.calibrated_g}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if state.get("calibrated_g"):
            self.calibrated_g = state["calibrated_g"]
            self.controller.rank_models = [
                RankModel(model.n, model.m, residuals=c) if c is not None else model
                for c, model in zip(self.calibrated_g, self.controller.rank_models)]
