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

from typing import Sequence

import torch

from dataclasses import dataclass, field
from typing import Optional

from megatron_edgc.compression.powersgd import BucketCompressor


@dataclass
class _Step:
    grads: list
    m: dict = field(default_factory=dict)        # group key -> M [k, n, m] (the copy)
    p_hat: dict = field(default_factory=dict)
    q_local: dict = field(default_factory=dict)
    q_sent: dict = field(default_factory=dict)
    nonfinite: Optional[torch.Tensor] = None


def householder_orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """The old orthonormalization: Householder reduced QR of ``p`` ([k, n, r]), fp32."""
    q, _ = torch.linalg.qr(p.float(), mode="reduced")
    return q


class BeforeBucketCompressor(BucketCompressor):
    """:class:`BucketCompressor` with the step of before issue 33 (fp32 residual only)."""

    def start(self, grads: Sequence[torch.Tensor]) -> tuple[list, _Step]:
        """Error feedback and ``P = M Q``; returns the buffers to SUM-reduce: ``[[P... |
        dense... | flag]]``, or with bf16 factors ``[[P...] (bf16), [dense... | flag]]``
        (``[[P... | flag]]`` without a dense rest, ``[[dense... | flag]]`` without P).

        The flag is 1 where any element of P (in the factor dtype) or of the dense rest is
        non-finite, else 0; it is computed and written on the device."""
        assert len(grads) == len(self.entries)
        step = _Step(grads=list(grads))
        device = grads[0].device
        p_parts, dense_parts = [], []
        for key, g in self.groups.items():
            if g.q is None:
                self._init_group(g, device)
            m = torch.stack([grads[i].float() for i in g.indices])
            m += g.residual
            step.m[key] = m
            p_parts.append(torch.bmm(m, g.q).reshape(-1))
        for i in self.dense_indices:
            name = self.entries[i][0]
            if name in self._pending_flush:
                grads[i].add_(self._pending_flush.pop(name).view_as(grads[i]).to(grads[i].dtype))
            dense_parts.append(grads[i].float().reshape(-1))
        if self.factor_dtype != torch.float32:  # checked after the cast: it may overflow
            p_parts = [part.to(self.factor_dtype) for part in p_parts]
        flag = torch.zeros(1, device=device)
        if self.factor_dtype == torch.float32:
            bufs = [torch.cat(p_parts + dense_parts + [flag])]
        elif not dense_parts:  # the flag rides with P (it sums exactly in bf16 up to 256)
            bufs = [torch.cat(p_parts + [flag.to(self.factor_dtype)])]
        else:
            bufs = ([torch.cat(p_parts)] if p_parts else []) + [torch.cat(dense_parts + [flag])]
        payloads = bufs[:-1] + [bufs[-1][:-1]]
        nonfinite = torch.stack([torch.isfinite(b).all() for b in payloads]).all().logical_not()
        bufs[-1][-1] = nonfinite
        return bufs, step

    def middle(self, step: _Step, reduced: Sequence[torch.Tensor]) -> torch.Tensor:
        """After the first SUM (the buffers of :meth:`start`, reduced): orthonormalize P,
        ``Q = M^T P``, the dense rest into its gradients; returns Q to SUM-reduce (in the
        factor dtype). Runs whatever the summed flag says (see :meth:`finish`)."""
        # the flag ends the last buffer: [P... | dense... | flag], [P | flag] or [dense | flag]
        step.nonfinite = reduced[-1][-1:] > 0
        split = len(reduced) > 1 or (self.factor_dtype != torch.float32 and not self.groups)
        p_buf = reduced[0]
        offset = 0
        qs = []
        for key, g in self.groups.items():
            k, r = len(g.indices), self._rank_for(g)
            p = p_buf[offset:offset + k * g.n * r].view(k, g.n, r)
            offset += k * g.n * r
            p_hat = householder_orthonormalize(p)
            step.p_hat[key] = p_hat
            step.q_local[key] = torch.bmm(step.m[key].transpose(1, 2), p_hat)
            if self.factor_dtype == torch.float32:
                step.q_sent[key] = step.q_local[key]
                qs.append(step.q_local[key].reshape(-1))
            else:
                sent = step.q_local[key].to(self.factor_dtype)
                step.q_sent[key] = sent.float()
                qs.append(sent.reshape(-1))
        if split:  # bf16 factors: the dense rest (and the flag) came in their own buffer
            assert offset == (p_buf.numel() if len(reduced) > 1 else 0)
            dense_buf, offset = reduced[-1], 0
        else:
            dense_buf = p_buf
        for i in self.dense_indices:
            grad = step.grads[i]
            grad.copy_(dense_buf[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        assert offset == dense_buf.numel() - 1
        if not qs:
            return torch.empty(0, device=p_buf.device, dtype=self.factor_dtype)
        return torch.cat(qs)

    def finish(self, step: _Step, reduced_q: torch.Tensor) -> None:
        """After the second SUM: ``M^ = P^ Q^T`` into the gradients; residual and warm start.

        Both products write where their result lives, with no temporary: ``M^`` straight
        into each fp32 gradient (``mm(out=)``), and the residual into ``M``'s own storage
        (``M -= P^ Q_i^T`` as one ``baddbmm``), which this step owns. Bit-identical to the
        unfused ``bmm``, copy and subtraction on CPU (``tests/test_powersgd.py``);
        ``bench/compression_math.py`` times both forms.

        Where some rank flagged a non-finite value (``step.nonfinite``, on the device) the
        summed Q is replaced by NaN, so every decompressed gradient is NaN, and the residual
        and warm start keep their old values: one ``torch.where`` pass over ``E``, in
        place, on every step (the price of deciding on the device).
        """
        bad = step.nonfinite
        offset = 0
        for key, g in self.groups.items():
            k, r = len(g.indices), self._rank_for(g)
            q = reduced_q[offset:offset + k * g.m * r].view(k, g.m, r).float()
            offset += k * g.m * r
            q = q.masked_fill(bad, float("nan"))  # a new tensor: reduced_q stays as it came
            p_hat = step.p_hat[key]
            for j, i in enumerate(g.indices):
                grad = step.grads[i]
                if grad.dtype == torch.float32 and grad.is_contiguous():
                    torch.mm(p_hat[j], q[j].transpose(0, 1), out=grad)
                else:
                    grad.copy_(torch.mm(p_hat[j], q[j].transpose(0, 1)))
            if self.track_spectrum:  # reads M: before M becomes the residual
                self._add_spectrum_from_m(key, step.m[key], step.q_local[key], bad)
            residual = step.m[key].baddbmm_(p_hat, step.q_sent[key].transpose(1, 2), alpha=-1)
            g.residual = torch.where(bad, g.residual, residual, out=residual)
            step.m[key] = None  # now the residual
            g.q = torch.where(bad, g.q, q)
        assert offset == reduced_q.numel()

    def _add_spectrum_from_m(self, key, m: torch.Tensor, q_local: torch.Tensor,
                      bad: torch.Tensor) -> None:
        """Accumulate ``[Σ‖M‖², Σ_k sorted column energies of Mᵀ P^, steps]`` for one
        group, on the device (``bad``: the step's non-finite flag; such a step adds 0).

        ``P^`` is orthonormal, so column ``j`` of ``Q_local = Mᵀ P^`` carries exactly the
        energy ``‖Mᵀ p_j‖²`` the step captures in direction ``p_j``, and ``‖M‖² − Σ_j`` of
        them is ``‖E‖²``. Sorted per matrix, the first ``r'`` of them are the energy the
        best ``r'`` columns of this basis would keep: a measured error curve for every
        rank up to the current one, at the cost of one pass over ``Q_local``.
        """
        cols = (q_local.float() ** 2).sum(dim=1).sort(dim=1, descending=True).values.sum(0)
        total = (m.float() ** 2).sum().double()
        good = bad.logical_not().view(())
        total, cols = torch.where(good, total, 0.0), torch.where(good, cols.double(), 0.0)
        entry = self.spectrum.get(key)
        if entry is None or entry[1].numel() != cols.numel():
            self.spectrum[key] = [total, cols, good.long()]
        else:
            entry[0] = entry[0] + total
            entry[1] = entry[1] + cols
            entry[2] = entry[2] + good.long()

