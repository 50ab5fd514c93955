"""What one compressed unit keeps across steps, and the one rule that settles a step
(docs/reliability.md, "One rule for a step's outcome").

A unit is a DP bucket, a rank's shard of one on the slow hop, or a pipeline edge's
sender. Its :class:`UnitState` owns, per shape group, the warm start ``Q`` and the
residual ``E`` (in the gradients' units, net of any loss scale: the same in every
precision, scale and device); the pending residuals of matrices sent dense since a rank
change (a residual moves with its matrix); and what the step in flight carried.

Lifecycle: :meth:`UnitState.begin` → the compressor forms ``M``, sends, takes the
residuals and records what its message carried → :meth:`UnitState.settle`. The rule: a
step is applied only where the optimizer reported it; otherwise (a skip, a non-finite
step, an outcome never reported before a save or the next step) what the message carried
of ``E`` is given back. A matrix whose part of the message was not finite never changed
its ``E``. The pipeline's sender settles each message as applied at once (its receiver
used it in the same backward).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_edgc.compression.kernels import ErrorFeedback, ShapeGroup


class UnitState:
    """The state of one compressed unit and its one lifecycle (module docstring)."""

    def __init__(self, ef: ErrorFeedback):
        self.ef = ef
        self.groups: dict = {}                      # group key -> ShapeGroup (q, residual)
        self.pending: dict[str, torch.Tensor] = {}  # name -> residual of a matrix gone dense
        #: every residual and pending one is zero (none taken since the last applied dense
        #: message): a dense sync then has nothing to add, and scales in its cast
        self.clear = True
        # the step in flight: (group, kept [k,1,1], A, B) of each E = (M - A Bᵀ)/s taken;
        # whether a dense message carried every residual; the pending ones it carried
        self._factors: list = []
        self._residuals = False
        self._pending: list = []

    # ------------------------------------------------------------------ the lifecycle

    def begin(self, loss_scale: Optional[torch.Tensor]) -> None:
        """A step at ``loss_scale`` (float ``[1]`` on the device, None without a scaler)
        begins; a step still in flight was never reported: settled by the rule."""
        self.settle(applied=False)
        self.clear = False
        self.ef.begin(loss_scale)

    def carried_factors(self, g: ShapeGroup, kept: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor) -> None:
        """The message carried ``A Bᵀ`` of group ``g``'s ``M`` (its residual now
        ``(M - A Bᵀ)/s`` where ``kept`` is not set)."""
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
                self.clear = True
            for name in pending:
                self.pending.pop(name, None)
            return
        inv = self.ef.inv_scale   # the settled step's: begin() sets the next one's after
        for g, kept, a, b in factors:
            a = torch.where(kept, 0.0, a if inv is None else a * inv)
            b = torch.where(kept, 0.0, b).transpose(1, 2)   # a kept matrix's may be NaN
            if g.residual.dtype == torch.float32:
                g.residual.baddbmm_(a, b)
                continue
            for lo, hi in self.ef.slices(0, len(g.indices), g, 2):
                e = g.residual[lo:hi].float().baddbmm_(a[lo:hi], b[lo:hi])
                g.residual[lo:hi].copy_(e)

    # ------------------------------------------------------------------ groups

    def regroup(self, groups: dict) -> None:
        """New shape groups (a rank change): each matrix's ``Q`` and ``E`` move with it.
        A group of the same matrices keeps its tensors; one whose matrices were all
        compressed is stacked from theirs; a matrix no longer in a carried group hands its
        residual to :attr:`pending` (taken back by :meth:`init_group` if it is compressed
        again). A step in flight is settled first, by the rule."""
        self.settle(applied=False)
        old = {name: (g, j) for g in self.groups.values() for j, name in enumerate(g.names)}
        previous = {tuple(g.names): g for g in self.groups.values()}
        for g in groups.values():
            same = previous.get(tuple(g.names))
            if same is not None:
                g.q, g.residual = same.q, same.residual
            elif g.names and all(name in old and old[name][0].q is not None
                                 for name in g.names):
                g.q = torch.stack([old[name][0].q[old[name][1]] for name in g.names])
                g.residual = torch.stack([old[name][0].residual[old[name][1]]
                                          for name in g.names])
        carried = {name for g in groups.values() if g.q is not None for name in g.names}
        for name, (og, j) in old.items():
            if og.residual is not None and name not in carried:
                self.pending[name] = og.residual[j].clone()
        self.groups = groups

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
        ``ef_dtype``), wherever a checkpoint was mapped; nothing copied where they are."""
        def put(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(t.device if device is None else device, dtype)

        for g in self.groups.values():
            if g.q is not None:
                g.q = put(g.q, torch.float32)
            if g.residual is not None:
                g.residual = put(g.residual, ef_dtype)
        self.pending = {k: put(v, ef_dtype) for k, v in self.pending.items()}

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """``{"matrices": {name: {"q", "residual"}}, "pending": {name: residual}}`` on the
        host, ``E`` in the gradients' units. An outcome not reported by now is settled by
        the rule first (a save after a step the optimizer never reached)."""
        self.settle(applied=False)
        out: dict = {"matrices": {}, "pending": {k: v.cpu().clone()
                                                 for k, v in self.pending.items()}}
        for g in self.groups.values():
            if g.q is None:
                continue
            for j, name in enumerate(g.names):
                out["matrices"][name] = {"q": g.q[j].cpu().clone(),
                                         "residual": g.residual[j].cpu().clone()}
        return out

    def load_state_dict(self, state: dict, q_shape, device, ef_dtype: torch.dtype) -> list:
        """Restore :meth:`state_dict`'s (``q_shape(g)``: one matrix's warm-start shape in
        group ``g``) on ``device``; returns the names whose saved state did not fit (their
        group starts fresh). A checkpoint of before issue 71 kept ``E`` in the units of a
        loss scale (``residual_units``): converted here."""
        self._factors, self._residuals, self._pending = [], False, []
        self.clear = False
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
