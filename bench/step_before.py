"""The compressed step as it was before issue 33: the "before" of the before/after.

* ``start`` stacks every gradient of a shape group into a new fp32 ``[k, n, m]`` tensor
  ``M = G + E`` (a second copy of the gradients for the length of the step);
* ``middle`` orthonormalizes ``P`` with ``torch.linalg.qr`` (Householder; on CUDA one
  cuSOLVER geqrf/orgqr per matrix for more than 256 rows);
* ``finish`` writes ``P^ Qᵀ`` with one ``mm`` per matrix and selects the residual with a
  ``torch.where`` over ``E``.

Kept only for ``bench/compression_math.py`` and ``bench/gpu_kernels.py``, which time it
beside today's step in the same run. Its state layout equals today's, so the same
``BucketCompressor`` object's planning and state code serve both.
"""

from __future__ import annotations

import torch

from megatron_edgc.compression.powersgd import BucketCompressor, split_factors


def householder_orthonormalize(p: torch.Tensor, stood_in=None) -> torch.Tensor:
    """The old orthonormalization: Householder reduced QR of ``p`` ([k, n, r]), fp32 (no
    factorization to fail: ``stood_in`` gets nothing)."""
    q, _ = torch.linalg.qr(p.float(), mode="reduced")
    return q


class BeforeBucketCompressor(BucketCompressor):
    """:class:`BucketCompressor` with the step of before issue 33 (fp32 residual only)."""

    orthonormalize = staticmethod(householder_orthonormalize)

    def _form_m_and_p(self, key, g, grads, step) -> torch.Tensor:
        """``M = stack(G) + E``: a new fp32 ``[k, n, m]`` tensor (the second copy)."""
        m = torch.stack([grads[i].float() for i in g.indices])
        m += g.residual
        step.views[key] = [(0, len(g.indices), m)]
        return torch.bmm(m, g.q)

    def finish(self, step, reduced: list) -> None:
        """After the second SUM: ``M^ = P^ Q^T`` into the gradients; residual and warm start.

        ``M^`` into each gradient with one ``mm`` per matrix, the residual into ``M``'s
        own storage (``M -= P^ Q_i^T``, one ``baddbmm``), which then replaces ``E``.

        Where some rank flagged a non-finite value (``step.nonfinite``, on the device) the
        summed Q is replaced by NaN, so every decompressed gradient is NaN, and the residual
        and warm start keep their old values: one ``torch.where`` pass over ``E``, in
        place, on every step (the price of deciding on the device).
        """
        bad = step.nonfinite
        q_buf, _, _ = self.layouts()[1].unpack(reduced)
        shapes = [(len(g.indices), g.m, self._rank_for(g)) for g in self.groups.values()]
        for (key, g), q in zip(self.groups.items(), split_factors(q_buf, shapes, bad)):
            p_hat = step.p_hat[key]
            for j, i in enumerate(g.indices):
                grad = step.grads[i]
                if grad.dtype == torch.float32 and grad.is_contiguous():
                    torch.mm(p_hat[j], q[j].transpose(0, 1), out=grad)
                else:
                    grad.copy_(torch.mm(p_hat[j], q[j].transpose(0, 1)))
            if self.track_spectrum:  # reads M: before M becomes the residual
                total = (step.views[key][0][2] ** 2).sum().double()
                self._add_spectrum(key, total, step.q_local[key], bad)
            m = step.views[key][0][2]
            residual = m.baddbmm_(p_hat, step.q_sent[key].transpose(1, 2), alpha=-1)
            g.residual = torch.where(bad, g.residual, residual, out=residual)
            step.views[key] = None  # M is now the residual
            g.q = torch.where(bad, g.q, q)
