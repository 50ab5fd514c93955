"""What one compressed unit keeps across steps, and the one rule that settles a step
(docs/reliability.md, "One rule for a step's outcome": every decision on ``E`` and ``Q``
is a method here).

A unit is a DP bucket, a rank's shard of one on the slow hop, or a pipeline edge's
sender. Its :class:`UnitState` owns, per shape group, the warm start ``Q`` and the
residual ``E`` (in the gradients' units, net of any loss scale); the pending residuals of
matrices sent dense since a rank change; and what the step in flight carried.
Lifecycle: :meth:`UnitState.begin` → the compressor forms ``M``, sends, takes the
residuals and records what its message carried → :meth:`UnitState.settle`: applied only
where the optimizer reported it, otherwise what the message carried of ``E`` is given
back. The pipeline's sender settles each message at once and its iteration by the
outcome: not applied, it rolls back to :meth:`UnitState.mark`, which holds the iteration's
starting ``E`` and ``Q`` themselves, not copies (the first message takes its residual into
a spare one).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_edgc.compression.kernels import (ErrorFeedback, ShapeGroup, all_finite,
                                               resized_warm_start, select)


def from_before_issue_71(state: dict, name: str = "") -> dict:
    """A unit's checkpoint of before issue 71 in today's form, the one conversion: the
    pending residuals under their old key, a pipeline sender's one matrix (``q``,
    ``residual``) under ``name``; ``residual_units`` (the loss scale ``E`` was kept in)
    stays for :meth:`UnitState.load_state_dict` to divide out."""
    if "matrices" not in state:   # the pipeline's sender
        state = dict(state, matrices={} if state.get("q") is None else
                     {name: {"q": state["q"], "residual": state["residual"]}})
    if "pending" not in state:
        state = dict(state, pending=state.get("pending_flush", {}))
    return state


class UnitState:
    """The state of one compressed unit and its one lifecycle (module docstring)."""

    def __init__(self, ef: ErrorFeedback):
        self.ef = ef
        ef.rule = self   # the step's one pass over M applies keeps() and store() below
        self.groups: dict = {}                      # group key -> ShapeGroup (q, residual)
        self.pending: dict[str, torch.Tensor] = {}  # name -> residual of a matrix gone dense
        #: every residual is zero (none taken since the last applied dense message)
        self._zero = True
        # the step in flight: (group, kept [k,1,1], A, B) of each E = (M - A Bᵀ)/s taken;
        # whether a dense message carried every residual; the pending ones it carried
        self._factors: list = []
        self._residuals = False
        self._pending: list = []
        #: the pipeline's sender: its groups' ``(Q, E)`` at the iteration's start (mark),
        #: the tensors themselves: nothing writes into a marked one (:meth:`store`)
        self._mark: Optional[dict] = None
        #: group id -> the new residual a message takes into while its ``E`` is marked
        self._taking: dict = {}
        #: group names -> the residual an iteration left free (the mark's once applied, the
        #: iteration's once rolled back): the next marked iteration takes into it
        self._spare: dict = {}

    # ------------------------------------------------------------------ the lifecycle

    def begin(self, loss_scale: Optional[torch.Tensor], dense: bool = False) -> bool:
        """A step at ``loss_scale`` (float ``[1]`` on the device, None without a scaler)
        begins; a step still in flight was never reported: settled by the rule first.
        ``dense``: a dense message that will carry every residual; returns whether it has
        any to carry (none: the state stays :attr:`clear`)."""
        clear = self.clear
        self.settle(applied=False)
        self._taking = {}   # a pass that never reached carried_factors left E as it was
        self._zero = dense and clear
        self.ef.begin(loss_scale)
        return not clear

    @property
    def clear(self) -> bool:
        """The one "clear" rule: no residual and no pending one holds anything (none taken
        since the last applied dense message): a dense sync then has nothing to add, and
        scales in its cast."""
        return self._zero and not self.pending

    def next_warm_start(self, g: ShapeGroup, q: torch.Tensor, keep: torch.Tensor) -> None:
        """Group ``g``'s warm start for the next step: the step's ``q`` where it is finite,
        the one before where ``keep`` (``[k, 1, 1]`` or ``[1, 1, 1]``, on the device)."""
        g.q = select(keep, g.q, q)

    @staticmethod
    def keeps(sent: torch.Tensor, nonfinite: torch.Tensor, out: torch.Tensor) -> None:
        """The message's per-matrix rule, applied in the pass that takes ``E``: a matrix
        keeps its ``E`` and ``Q`` where what the step received is not finite
        (``nonfinite``) or its own factor as ``sent`` is not; ``out``: bool ``[k, 1, 1]``."""
        finite = all_finite(sent.reshape(sent.shape[0], -1), dim=1).view(-1, 1, 1)
        torch.logical_or(finite.logical_not(), nonfinite.view(1, 1, 1), out=out)

    def store(self, g: ShapeGroup, lo: int, hi: int, taken: torch.Tensor,
              keep: torch.Tensor) -> None:
        """A residual ``taken`` (fp32, then free) of group ``g``'s matrices ``lo..hi`` into
        ``E`` where the matrix does not keep it: in place, or, while ``E`` is the mark's
        (a marked iteration's first message), into the spare residual (the first time a
        new one) that becomes ``E`` at :meth:`carried_factors` (``E`` is read for ``M``
        until then)."""
        residual = g.residual
        out = self._taking.get(id(g))
        key = tuple(g.names)
        if out is None and self._mark is not None and \
                self._mark.get(key, (None, None))[1] is residual:
            out = self._spare.pop(key, None)
            if out is None or (out.shape, out.dtype, out.device) != \
                    (residual.shape, residual.dtype, residual.device):
                out = torch.empty_like(residual)
            self._taking[id(g)] = out
        old, out = residual[lo:hi], (residual if out is None else out)[lo:hi]
        if out.dtype == taken.dtype:
            select(keep, old, taken, out=out)   # torch.where's bits, faster on the host
            return
        torch.where(keep, old, taken, out=taken)
        out.copy_(taken)

    def carried_factors(self, g: ShapeGroup, kept: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor) -> None:
        """The message carried ``A Bᵀ`` of group ``g``'s ``M`` (its residual now
        ``(M - A Bᵀ)/s`` where ``kept`` is not set, taken into a new tensor where ``E``
        was marked: it becomes ``E``)."""
        g.residual = self._taking.pop(id(g), g.residual)
        self._factors.append((g, kept, a, b))

    def carried_residuals(self) -> None:
        """A dense message carried every residual and pending one (``E`` unchanged)."""
        self._residuals = True

    def carried_pending(self, name: str) -> None:
        """The message carried ``name``'s pending residual (still held)."""
        self._pending.append(name)

    def settle(self, applied: bool) -> None:
        """The step's outcome (module docstring): the one place a step's state is settled.
        Applied: what the message carried is gone from the state (a dense message's
        residuals zeroed, carried pending ones dropped). Not applied: the compressed
        matrices take back ``A Bᵀ`` in the gradients' units (one ``baddbmm`` per group,
        ``kept`` selected on the device, no host read), the rest kept as it was."""
        factors, self._factors = self._factors, []
        residuals, self._residuals = self._residuals, False
        pending, self._pending = self._pending, []
        if applied:
            if residuals:
                for g in self.groups.values():
                    if g.residual is not None:
                        g.residual.zero_()
                self.pending = {}
                self._zero = True
            for name in pending:
                self.pending.pop(name, None)
            return
        for g, kept, a, b in factors:
            self._give_back(g.residual, g, kept, a, b)

    def _give_back(self, residual: torch.Tensor, g: ShapeGroup, kept: torch.Tensor,
                   a: torch.Tensor, b: torch.Tensor) -> None:
        """``residual`` (group ``g``'s, or a copy) += ``A Bᵀ`` in the gradients' units,
        ``kept`` matrices left as they are (their factors may be NaN)."""
        inv = self.ef.inv_scale   # the settled step's: begin() sets the next one's after
        a = torch.where(kept, 0.0, a if inv is None else a * inv)
        b = torch.where(kept, 0.0, b).transpose(1, 2)
        if residual.dtype == torch.float32:
            residual.baddbmm_(a, b)
            return
        for lo, hi in self.ef.slices(0, len(g.indices), g, 2):
            residual[lo:hi].copy_(residual[lo:hi].float().baddbmm_(a[lo:hi], b[lo:hi]))

    def mark(self) -> None:
        """The pipeline's sender: its state at an iteration's start, before its first
        message (module docstring), held as it is: a step replaces ``Q`` and never writes
        it, and the first message takes its residual into the spare one (:meth:`store`).
        A mark still held (an outcome never reported, the schedule run again) is rolled
        back to first. Copies nothing; a unit that marks keeps two residuals per group
        (``E`` and the mark's or the spare), as many as a copy of ``E`` held from the first
        message to the outcome (across the step's peak) would. Only the pipeline's senders
        mark: they send no dense message (whose applied outcome zeroes ``E`` in place)."""
        self.settle_iteration(applied=False)
        self._mark = {tuple(g.names): (g.q, g.residual)
                      for g in self.groups.values() if g.q is not None}

    def settle_iteration(self, applied: bool) -> None:
        """The iteration's outcome for a unit that :meth:`mark` ed its start: applied, its
        messages stand; not applied, ``E`` and ``Q`` are the mark's again (``Q`` at the
        rank in force: :meth:`resize_warm_starts` resizes a held mark too). The residual
        left free is the next iteration's spare."""
        mark, self._mark = self._mark, None
        if mark is None:
            return
        for g in self.groups.values():
            key = tuple(g.names)
            if g.residual is None or key not in mark:
                continue
            q, e = mark[key]
            if e is not g.residual:      # a message took E into the spare
                self._spare[key] = e if applied else g.residual
            if not applied:
                g.q, g.residual = q, e

    # ------------------------------------------------------------------ groups

    def regroup(self, groups: dict) -> None:
        """New shape groups (a rank change): each matrix's ``Q`` and ``E`` move with it.
        A group of the same matrices keeps its tensors (groups are keyed by shape, and a
        shape is compressed all or nothing: no other group can form); a matrix no longer
        in a carried group hands its residual to :attr:`pending` (taken back by
        :meth:`init_group` if it is compressed again). A step in flight is settled first,
        by the rule."""
        self.settle(applied=False)
        old = {name: (g, j) for g in self.groups.values() for j, name in enumerate(g.names)}
        previous = {tuple(g.names): g for g in self.groups.values()}
        for g in groups.values():
            same = previous.get(tuple(g.names))
            if same is not None:
                g.q, g.residual = same.q, same.residual
        carried = {name for g in groups.values() if g.q is not None for name in g.names}
        for name, (og, j) in old.items():
            if og.residual is not None and name not in carried:
                self.pending[name] = og.residual[j].clone()
        self.groups = groups

    def resize_warm_starts(self, rank_of, seeded) -> None:
        """After a rank change: each group's ``Q`` at its rank ``rank_of(g)``, trailing
        columns dropped or ``seeded(g, tag, cols)`` ones appended, a held mark's too
        (``E`` is rank-free)."""
        for g in self.groups.values():
            if g.q is None:
                continue
            seed = lambda tag, cols, g=g: seeded(g, tag, cols)  # noqa: E731
            g.q = resized_warm_start(g.q, rank_of(g), seed)
            key = tuple(g.names)
            if key in (self._mark or {}):   # a held mark: the iteration's start, resized
                q, e = self._mark[key]
                self._mark[key] = (resized_warm_start(q, rank_of(g), seed), e)

    def init_group(self, g: ShapeGroup, q: torch.Tensor, dtype: torch.dtype) -> None:
        """A group's first state: warm start ``q``, residual zero but for the pending
        residuals of its matrices (a matrix compressed again takes its own back)."""
        g.q = q
        g.residual = torch.zeros(len(g.names), g.n, g.m, dtype=dtype, device=q.device)
        for j, name in enumerate(g.names):
            if name in self.pending:
                g.residual[j].copy_(self.pending.pop(name).view(g.n, g.m))

    def to(self, device, ef_dtype: torch.dtype) -> None:
        """Every tensor of the state on ``device`` (``Q`` fp32, ``E`` and pending ones in
        ``ef_dtype``, a held mark's likewise), wherever a checkpoint was mapped; nothing
        copied where they are."""
        def put(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(t.device if device is None else device, dtype)

        for g in self.groups.values():
            if g.q is not None:
                g.q = put(g.q, torch.float32)
            if g.residual is not None:
                g.residual = put(g.residual, ef_dtype)
        self.pending = {k: put(v, ef_dtype) for k, v in self.pending.items()}
        if self._mark is not None:
            self._mark = {k: (put(q, torch.float32), put(e, ef_dtype))
                          for k, (q, e) in self._mark.items()}
        self._spare = {k: put(e, ef_dtype) for k, e in self._spare.items()}

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """``{"matrices": {name: {"q", "residual"}}, "pending": {name: residual}}`` on the
        host, ``E`` in the gradients' units: the state as the rule leaves it if the step
        in flight is not applied (a save after a step the optimizer never reached), read
        without changing it (the outcome may still come)."""
        out: dict = {"matrices": {}, "pending": {k: v.cpu().clone()
                                                 for k, v in self.pending.items()}}
        given = {}   # group -> its residual with the step in flight given back, a copy
        for g, kept, a, b in self._factors:
            if id(g) not in given:
                given[id(g)] = g.residual.clone()
            self._give_back(given[id(g)], g, kept, a, b)
        for g in self.groups.values():
            if g.q is None:
                continue
            q, e = (self._mark or {}).get(tuple(g.names)) or \
                (g.q, given.get(id(g), g.residual))
            for j, name in enumerate(g.names):
                out["matrices"][name] = {"q": q[j].cpu().clone(), "residual": e[j].cpu().clone()}
        return out

    def load_state_dict(self, state: dict, q_shape, device, ef_dtype: torch.dtype) -> list:
        """Restore :meth:`state_dict`'s (``q_shape(g)``: one matrix's warm-start shape in
        group ``g``) on ``device``; returns the names whose saved state did not fit (their
        group starts fresh). A checkpoint of before issue 71 (:func:`from_before_issue_71`)
        kept ``E`` in the units of a loss scale (``residual_units``): divided out here."""
        state = from_before_issue_71(state)
        self._factors, self._residuals, self._pending, self._mark = [], False, [], None
        self._taking, self._spare = {}, {}
        self._zero = False
        units = state.get("residual_units")
        factor = None if units is None else 1.0 / float(units)

        def unscaled(t: torch.Tensor) -> torch.Tensor:
            return t if factor is None else t.float() * factor

        mats, mismatched = state["matrices"], []
        for g in self.groups.values():
            ok = all(name in mats and tuple(mats[name]["q"].shape) == q_shape(g)
                     and tuple(mats[name]["residual"].shape) == (g.n, g.m) for name in g.names)
            if ok:
                g.q = torch.stack([mats[name]["q"] for name in g.names])
                g.residual = torch.stack([unscaled(mats[name]["residual"]) for name in g.names])
            else:
                mismatched += [name for name in g.names if name in mats]
                g.q = g.residual = None
        self.pending = {k: unscaled(v) for k, v in state.get("pending", {}).items()}
        self.to(device, ef_dtype)
        return mismatched
