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


class ActivationGradSender:
    """Sender side for one pipeline edge: residual and warm-started Q persist."""

    def __init__(self, rank: int, seed: int = 0, name: str = "pp-edge"):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank, self.seed, self.name = rank, seed, name
        self.q: Optional[torch.Tensor] = None         # [m, r]
        self.residual: Optional[torch.Tensor] = None  # [n, m], fp32
        self._ef = ErrorFeedback(torch.float32, LowRankState.workspace_bytes)
        #: the loss scale of this iteration's messages (fp16's scaler, float ``[1]`` on the
        #: device; None without one): the residual is kept in the units it was formed at
        self.loss_scale: Optional[torch.Tensor] = None

    def _seeded(self, tag: str, rows: int, cols: int) -> torch.Tensor:
        return seeded_gaussian(self.seed, self.name, tag, rows, cols).unsqueeze(0)

    def set_rank(self, rank: int) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if self.q is not None:
            m = self.q.shape[0]
            self.q = resized_warm_start(self.q.unsqueeze(0), rank,
                                        lambda tag, cols: self._seeded(tag, m, cols))[0]
        self.rank = rank

    def prepare(self, n: int, m: int, device) -> None:
        """The warm start ``[m, r]`` and the residual ``[n, m]`` for messages of ``n x m``,
        where they are missing or of another shape (the runtime calls it before the
        schedule; :meth:`compress` again, for a message of another shape)."""
        r = min(self.rank, n, m)
        if self.q is None or self.q.shape != (m, r):
            self.q = to_device(self._seeded("init", m, r)[0], device)
        if self.residual is None or self.residual.shape != (n, m):
            self.residual = torch.zeros(n, m, device=device)

    def compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``grad`` [..., hidden] → (P^ [n, r], Q [m, r]) in fp32; updates the residual.

        Where ``grad`` plus the residual holds a NaN/Inf (``P`` is then non-finite), the
        factors come back NaN (the receiver's gradient becomes non-finite, as it would
        dense) and the residual and Q keep their last finite values — decided on the
        device, with no host sync: the power step always runs and ``torch.where`` selects.
        """
        m_dim = grad.shape[-1]
        mat = grad.reshape(-1, m_dim)
        # M is formed in an fp32 copy (the caller's gradient stays as it was); a bf16
        # gradient is read slice by slice instead (ErrorFeedback.blocks)
        mat = mat.clone() if mat.dtype == torch.float32 else mat
        n = mat.shape[0]
        self.prepare(n, m_dim, mat.device)
        g = ShapeGroup(n, m_dim, [0], [self.name], q=self.q.unsqueeze(0),
                       residual=self.residual.unsqueeze(0))
        views = self._ef.views(g, [mat])
        self._ef.begin(self.loss_scale)
        self._ef.form(g, views)
        p = self._ef.project(g, views, g.q, transposed=False)
        bad = torch.isfinite(p).all().logical_not().view(1)
        p_hat = orthonormalize(p)
        q, _, _ = self._ef.project_and_take(g, views, p_hat, True, bad, torch.float32)
        self._ef.commit(bad)
        self.q = torch.where(bad, self.q, q[0])
        nan = float("nan")
        return p_hat[0].masked_fill(bad, nan), q[0].masked_fill(bad, nan)

    def state_dict(self) -> dict:
        return {"rank": self.rank, "q": self.q, "residual": self.residual,
                "residual_units": self._ef.units}

    def load_state_dict(self, state: dict) -> None:
        self.rank, self.q, self.residual = state["rank"], state["q"], state["residual"]
        self._ef.units = state.get("residual_units")


def decompress(p_hat: torch.Tensor, q: torch.Tensor, shape, dtype) -> torch.Tensor:
    """Receiver side: ``P^ Qᵀ`` in the activation gradient's shape and dtype."""
    return (p_hat @ q.T).view(shape).to(dtype)
