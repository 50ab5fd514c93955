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

from megatron_edgc.compression.kernels import split_factors
from megatron_edgc.compression.powersgd import BucketCompressor


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
        """After the second SUM: ``M^ = P^ Q^T`` into the gradients with one ``mm`` per
        matrix, and the warm start (the residual was taken from the stacked ``M`` in the
        inherited ``middle``: a ``baddbmm`` and a ``torch.where`` over ``E``, the same
        work the step of before did here). Where some rank flagged a non-finite value the
        summed Q is NaN, so every decompressed gradient is NaN, and the warm start keeps
        its value."""
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
            if self.track_spectrum:
                self._add_spectrum(key, step.energy[key], step.q_local[key], bad)
            step.views[key] = None
            g.q = torch.where(bad, g.q, q)
