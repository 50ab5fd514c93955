"""Low-rank compression of pipeline activation gradients (EDGC §7).

The backward send from stage s+1 to stage s carries ``[seq, micro_batch, hidden]``,
viewed as a ``(seq·micro_batch) x hidden`` matrix ``M``. The sender adds the previous
micro-batch's residual (lazy error propagation), does one warm-started power iteration::

    P = M Q;  P^ = orth(P);  Q = Mᵀ P^

sends ``P^`` and ``Q`` (``(n + m)·r`` elements instead of ``n·m``) and keeps
``M - P^ Qᵀ`` as the next residual; the receiver rebuilds ``P^ Qᵀ``. No collective is
involved: sender and receiver only have to agree on the rank (the caller's job).

It is the flat step of one matrix on one rank, written with the same kernels
(:mod:`megatron_edgc.compression.kernels`) and the same rank-growth rule
(:func:`~megatron_edgc.compression.kernels.resized_warm_start`); its one temporary of the
message's size is ``M`` in fp32 (the caller's gradient is left as it was).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_edgc.compression.kernels import (ErrorFeedback, ShapeGroup, resized_warm_start,
                                               to_device)
from megatron_edgc.compression.low_rank_state import LowRankState
from megatron_edgc.compression.matrices import seeded_gaussian
from megatron_edgc.compression.orthonormal import orthonormalize
from megatron_edgc.compression.unit_state import UnitState

_EDGE = "edge"   # the one shape group of a sender's state


class ActivationGradSender:
    """Sender side for one pipeline edge: its :class:`UnitState` (one group of one matrix:
    the residual and the warm-started Q) persists across messages, each message settled
    as applied at once (the receiver consumes it in the same backward)."""

    def __init__(self, rank: int, seed: int = 0, name: str = "pp-edge"):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank, self.seed, self.name = rank, seed, name
        self._ef = ErrorFeedback(torch.float32, LowRankState.workspace_bytes)
        self.state = UnitState(self._ef)
        #: the loss scale of this iteration's messages (fp16's scaler, float ``[1]`` on the
        #: device; None without one): the residual is kept net of it
        self.loss_scale: Optional[torch.Tensor] = None

    @property
    def _group(self) -> Optional[ShapeGroup]:
        return self.state.groups.get(_EDGE)

    @property
    def q(self) -> Optional[torch.Tensor]:
        """The warm start ``[m, r]`` (None before the first message)."""
        g = self._group
        return None if g is None or g.q is None else g.q[0]

    @property
    def residual(self) -> Optional[torch.Tensor]:
        """The residual ``[n, m]`` (fp32, net of the loss scale)."""
        g = self._group
        return None if g is None or g.residual is None else g.residual[0]

    @residual.setter
    def residual(self, value: Optional[torch.Tensor]) -> None:
        if self._group is not None:
            self._group.residual = None if value is None else value.unsqueeze(0)

    def _seeded(self, tag: str, rows: int, cols: int) -> torch.Tensor:
        return seeded_gaussian(self.seed, self.name, tag, rows, cols).unsqueeze(0)

    def set_rank(self, rank: int) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        g = self._group
        if g is not None and g.q is not None:
            m = g.q.shape[1]
            g.q = resized_warm_start(g.q, rank, lambda tag, cols: self._seeded(tag, m, cols))
        self.rank = rank

    def prepare(self, n: int, m: int, device) -> None:
        """The warm start ``[m, r]`` and the residual ``[n, m]`` for messages of ``n x m``
        on ``device`` (a state loaded elsewhere is moved there), where they are missing or
        of another shape (the runtime calls it before the schedule; :meth:`compress`
        again, for a message of another shape)."""
        r = min(self.rank, n, m)
        g = self._group
        if g is None or (g.n, g.m) != (n, m):
            old = g
            g = self.state.groups[_EDGE] = ShapeGroup(n, m, [0], [self.name])
            if old is not None:
                g.q, g.residual = old.q, old.residual
        self.state.to(device, torch.float32)
        if g.q is None or tuple(g.q.shape[1:]) != (m, r):
            g.q = to_device(self._seeded("init", m, r), device)
        if g.residual is None or tuple(g.residual.shape[1:]) != (n, m):
            g.residual = torch.zeros(1, n, m, device=device)

    def compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``grad`` [..., hidden] → (P^ [n, r], Q [m, r]) in fp32; updates the residual.

        The message's non-finite rule (docs/reliability.md): where ``grad`` plus the
        residual holds a NaN/Inf (``P`` is then non-finite), or ``Q`` as sent is not finite,
        the factors come back NaN (the receiver's gradient becomes non-finite, as it would
        dense) and the residual and Q keep their values — decided on the device, with no
        host sync: the power step always runs and ``torch.where`` selects.
        """
        m_dim = grad.shape[-1]
        mat = grad.reshape(-1, m_dim)
        # M is formed in an fp32 copy (the caller's gradient stays as it was); a bf16
        # gradient is read slice by slice instead (ErrorFeedback.blocks)
        mat = mat.clone() if mat.dtype == torch.float32 else mat
        self.prepare(mat.shape[0], m_dim, mat.device)
        g = self._group
        self.state.begin(self.loss_scale)
        views = self._ef.views(g, [mat])
        self._ef.form(g, views)
        p = self._ef.project(g, views, g.q, transposed=False)
        bad = torch.isfinite(p).all().logical_not().view(1)
        p_hat = orthonormalize(p)
        q, sent, kept, _ = self._ef.project_and_take(g, views, p_hat, True, bad, torch.float32)
        self.state.carried_factors(g, kept, p_hat, sent)
        self.state.settle(applied=True)
        g.q = torch.where(kept, g.q, q)
        nan, kept = float("nan"), kept[0]
        return p_hat[0].masked_fill(kept, nan), q[0].masked_fill(kept, nan)

    def state_dict(self) -> dict:
        return {"rank": self.rank, **self.state.state_dict()}

    def load_state_dict(self, state: dict, device=None) -> None:
        """Restore on ``device`` (None: where the state was mapped; :meth:`prepare` moves
        it to the messages' device)."""
        self.rank = state["rank"]
        if "matrices" not in state:   # a checkpoint of before issue 71
            units = state.get("residual_units")
            state = {"matrices": {} if state.get("q") is None else
                     {self.name: {"q": state["q"], "residual": state["residual"]}},
                     "residual_units": None if units is None else float(units)}
        self.state.groups = {}
        saved = state["matrices"].get(self.name)
        if saved is not None:
            n, m = saved["residual"].shape
            self.state.groups[_EDGE] = ShapeGroup(n, m, [0], [self.name])
        self.state.load_state_dict(state, lambda g: tuple(saved["q"].shape), device,
                                   torch.float32)


def decompress(p_hat: torch.Tensor, q: torch.Tensor, shape, dtype) -> torch.Tensor:
    """Receiver side: ``P^ Qᵀ`` in the activation gradient's shape and dtype."""
    return (p_hat @ q.T).view(shape).to(dtype)
