"""Low-rank compression of pipeline activation gradients (EDGC §7): the backward send from
stage s+1 to stage s, ``[seq, micro_batch, hidden]`` viewed as a ``(seq·micro_batch) x
hidden`` matrix, is the flat PowerSGD step of one matrix with no collective
(:meth:`~megatron_edgc.compression.low_rank_state.LowRankState.local_factors`;
docs/method.md §1 and §7): the sender keeps the residual for the next micro-batch (lazy
error propagation) and sends ``P^`` and ``Q``, the receiver rebuilds ``P^ Qᵀ``; sender and
receiver only agree on the rank (the caller's job). The same kernels, state and rule as
a DP bucket: each message settled at once (its receiver used it in the same backward),
each iteration by its outcome, rolled back to its start where not applied
(:meth:`~megatron_edgc.compression.unit_state.UnitState.mark`, no copy). Memory of the
message's size: ``E`` and a second residual, kept (the iteration's start while it is
marked, else the spare its next first message takes into), and per message ``M`` in fp32,
a copy of an fp32 gradient (left as it was) or, from bf16, slices of the bounded workspace.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_edgc.compression.powersgd import BucketCompressor
from megatron_edgc.compression.unit_state import from_before_issue_71


class ActivationGradSender:
    """Sender side for one pipeline edge: a one-matrix compressor whose residual and
    warm-started Q persist across messages, made for the messages' shape."""

    def __init__(self, rank: int, seed: int = 0, name: str = "pp-edge"):
        self.seed, self.name = seed, name
        self.compressor: Optional[BucketCompressor] = None
        self.set_rank(rank)
        #: the loss scale of this iteration's messages (fp16's scaler, float ``[1]`` on the
        #: device; None without one): the residual is kept net of it
        self.loss_scale: Optional[torch.Tensor] = None
        #: the next message marks the state for the iteration's outcome (an iteration
        #: begun, :meth:`begin_iteration`; the communicator's senders from their first)
        self.marks = False

    def begin_iteration(self) -> None:
        """Before an iteration's schedule, again where it runs again (the first run
        discarded): a mark still held is rolled back to (an outcome never reported is
        not applied), and the iteration's first message marks the state anew."""
        if self.compressor is not None:
            self.compressor.state.settle_iteration(applied=False)
        self.marks = True

    def after_step(self, applied: bool) -> None:
        """The iteration's outcome: its messages stand, or the sender goes back to the
        iteration's start (:meth:`UnitState.settle_iteration`)."""
        if self.compressor is not None:
            self.compressor.state.settle_iteration(applied)

    def _group(self):
        groups = self.compressor.groups if self.compressor is not None else {}
        return next(iter(groups.values()), None)

    @property
    def q(self) -> Optional[torch.Tensor]:
        """The warm start ``[m, r]`` (None before the first message)."""
        g = self._group()
        return None if g is None or g.q is None else g.q[0]

    @property
    def residual(self) -> Optional[torch.Tensor]:
        """The residual ``[n, m]`` (fp32, net of the loss scale)."""
        g = self._group()
        return None if g is None or g.residual is None else g.residual[0]

    def set_rank(self, rank: int) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.rank = rank
        if self.compressor is not None:
            self.compressor.set_rank(rank)

    def prepare(self, n: int, m: int, device) -> None:
        """The warm start ``[m, r]`` and the residual ``[n, m]`` for messages of ``n x m``
        on ``device`` (a state loaded elsewhere is moved there; a message of another shape
        starts a fresh state): the runtime calls it before the schedule, :meth:`compress`
        again."""
        if self.compressor is None or self.compressor.entries[0][1] != (n, m):
            self.compressor = BucketCompressor([(self.name, (n, m))], self.rank, seed=self.seed,
                                               compress_all=True, device=device)
        self.compressor.state.to(device, torch.float32)
        self.compressor.prepare(device)

    def compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``grad`` [..., hidden] → (P^ [n, r], Q [m, r]) in fp32; updates the residual.

        The message's non-finite rule (docs/reliability.md): where ``grad`` plus the
        residual holds a NaN/Inf, or ``Q`` as sent is not finite, the factors come back
        NaN (the receiver's gradient becomes non-finite, as it would dense) and the
        residual and Q keep their values — decided on the device, with no host sync.
        """
        m_dim = grad.shape[-1]
        mat = grad.reshape(-1, m_dim)
        # M is formed in an fp32 copy (the caller's gradient stays as it was); a bf16
        # gradient is read slice by slice instead (ErrorFeedback.blocks)
        mat = mat.clone() if mat.dtype == torch.float32 else mat
        self.prepare(mat.shape[0], m_dim, mat.device)
        if self.marks:
            self.compressor.state.mark()
            self.marks = False
        self.compressor.loss_scale = self.loss_scale
        step = self.compressor.local_factors([mat])
        (key,) = step.p_hat
        nan, kept = float("nan"), step.kept[key][0]
        return step.p_hat[key][0].masked_fill(kept, nan), \
            step.q_local[key][0].masked_fill(kept, nan)

    def state_dict(self) -> dict:
        state = {} if self.compressor is None else self.compressor.state_dict()
        return dict(state, rank=self.rank)

    def load_state_dict(self, state: dict, device=None) -> None:
        """Restore on ``device`` (None: where the state was mapped; :meth:`prepare` moves
        it to the messages' device)."""
        self.rank, self.compressor = state["rank"], None
        state = from_before_issue_71(state, self.name)
        saved = state["matrices"].get(self.name)
        if saved is not None:
            self.compressor = BucketCompressor([(self.name, tuple(saved["residual"].shape))],
                                               self.rank, seed=self.seed, compress_all=True,
                                               device=device)
            self.compressor.load_state_dict(state)


def decompress(p_hat: torch.Tensor, q: torch.Tensor, shape, dtype) -> torch.Tensor:
    """Receiver side: ``P^ Qᵀ`` in the activation gradient's shape and dtype."""
    return (p_hat @ q.T).view(shape).to(dtype)
