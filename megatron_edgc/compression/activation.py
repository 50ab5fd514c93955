"""Low-rank compression of pipeline activation gradients (EDGC §7).

The backward send from stage s+1 to stage s carries ``[seq, micro_batch, hidden]``,
viewed as a ``(seq·micro_batch) x hidden`` matrix ``M``. The sender adds the previous
micro-batch's residual (lazy error propagation), does one warm-started power iteration::

    P = M Q;  P^ = orth(P);  Q = Mᵀ P^

sends ``P^`` and ``Q`` (``(n + m)·r`` elements instead of ``n·m``) and keeps
``M - P^ Qᵀ`` as the next residual; the receiver rebuilds ``P^ Qᵀ``. No collective is
involved: sender and receiver only have to agree on the rank (the caller's job).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_edgc.compression.powersgd import orthonormalize, seeded_gaussian


class ActivationGradSender:
    """Sender side for one pipeline edge: residual and warm-started Q persist."""

    def __init__(self, rank: int, seed: int = 0, name: str = "pp-edge"):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank, self.seed, self.name = rank, seed, name
        self.q: Optional[torch.Tensor] = None
        self.residual: Optional[torch.Tensor] = None

    def set_rank(self, rank: int) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if self.q is not None and rank != self.q.shape[1]:
            if rank < self.q.shape[1]:
                self.q = self.q[:, :rank].contiguous()
            else:
                extra = seeded_gaussian(self.seed, self.name, f"grow{self.q.shape[1]}-{rank}",
                                        self.q.shape[0], rank - self.q.shape[1])
                self.q = torch.cat([self.q, extra.to(self.q.device)], dim=1)
        self.rank = rank

    def compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``grad`` [..., hidden] → (P^ [n, r], Q [m, r]) in fp32; updates the residual.

        Where ``grad`` plus the residual holds a NaN/Inf, the factors come back NaN (the
        receiver's gradient becomes non-finite, as it would dense) and the residual and Q
        keep their last finite values — decided on the device, with no host sync: the
        power step always runs and ``torch.where`` selects (one pass over the residual).
        """
        m_dim = grad.shape[-1]
        mat = grad.reshape(-1, m_dim).float()
        owed = self.residual if self.residual is not None \
            and self.residual.shape == mat.shape else None
        if owed is not None:
            mat = mat + owed
        r = min(self.rank, *mat.shape)
        if self.q is None or self.q.shape != (m_dim, r):
            self.q = seeded_gaussian(self.seed, self.name, "init", m_dim, r).to(mat.device)
        bad = torch.isfinite(mat).all().logical_not()
        p_hat = orthonormalize(mat @ self.q)
        q = mat.T @ p_hat
        residual = mat - p_hat @ q.T
        if owed is None:
            self.residual = residual.masked_fill_(bad, 0.0)
        else:
            self.residual = torch.where(bad, owed, residual, out=residual)
        self.q = torch.where(bad, self.q, q)
        nan = float("nan")
        return p_hat.masked_fill(bad, nan), q.masked_fill(bad, nan)

    def state_dict(self) -> dict:
        return {"rank": self.rank, "q": self.q, "residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        self.rank, self.q, self.residual = state["rank"], state["q"], state["residual"]


def decompress(p_hat: torch.Tensor, q: torch.Tensor, shape, dtype) -> torch.Tensor:
    """Receiver side: ``P^ Qᵀ`` in the activation gradient's shape and dtype."""
    return (p_hat @ q.T).view(shape).to(dtype)


def compressed_numel(shape, rank: int) -> int:
    m = shape[-1]
    n = 1
    for d in shape[:-1]:
        n *= d
    r = min(rank, n, m)
    return (n + m) * r
