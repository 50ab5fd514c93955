"""PowerSGD low-rank compression with error feedback (EDGC §1; Vogels et al., NeurIPS 2019).

Pure tensors in and out: a :class:`BucketCompressor` turns one gradient bucket into the
buffers a data-parallel all-reduce (SUM) must carry and rebuilds the gradient from the
reduced buffers. Whoever drives it owns the collectives (``patches/ddp.py`` on the real DP
group; the tests simulate DP ranks in one process).

One step for a bucket, on every DP rank ``i``::

    G_i += s E_i                        error feedback, formed in place: the gradient
                                        buffer holds M_i = G_i + s E_i for the step (s:
                                        the loss scale, 1 without one; E is net of it)
    P_i  = M_i Q                        Q warm-started; first Q a seeded Gaussian, same on all
    [P | dense | flag]  --SUM-->        one collective: all P of the bucket, the
                                        uncompressed rest (biases, norms, small matrices)
                                        and a non-finite flag
    P^   = orth(sum P)                  batched shifted CholeskyQR (:func:`orthonormalize`)
    Q_i  = M_i^T P^
    E_i  = (M_i - P^ Q_i^T)/s           what the shared basis missed of this rank's M_i,
                                        taken in the same pass over M_i (where the first
                                        SUM's flag is clear and Q_i finite); the step's
                                        outcome settles it (compression/unit_state.py)
    [Q]  --SUM-->                       one collective: all Q of the bucket
    G_i  = P^ (sum Q)^T                 ≈ sum_i M_i, identical on every rank
    Q    = sum Q                        warm start for the next step

Memory: the step makes no copy of the gradients. ``M`` is formed in the gradient buffer
(which the step overwrites anyway); ``E`` is read when ``M`` is formed and written once,
in the pass of the second product, where the new residual is computed in the gradient
buffer (or a workspace slice) and selected into ``E``; then ``P^ Qᵀ`` is written over
the buffer. The matrices of a shape group are addressed as strided ``[k, n, m]``
views of the gradient buffer (:func:`strided_runs`: equally spaced matrices, as in
Megatron's buffer where every layer has the same layout, make one view), so every product
is one batched call per shape group, with no ``[k, n, m]`` temporary. What a step
allocates is the factors (``P``, ``P^``, ``Q``: ``k (n + m) r`` each), the collective
buffers and ``[k, r, r]`` Gram matrices (``tests/test_powersgd.py`` measures it).

Gradients in bf16 (``--grad-reduce-in-bf16``) keep ``G`` in their buffer until the end:
the two products form ``M = float(G) + E`` in fp32 slices of a kept workspace of at most
:attr:`workspace_bytes` (the second takes the residual as it goes; the end writes
``P^ (sum Q)^T`` without forming ``M``), so the products and the residual are the fp32
ones and only the result written back is rounded to bf16. Conservation then holds to
that one rounding: ``Σ_i E_i + Ĝ = Σ_i M_i`` up to ``|Ĝ - M^| <= 2⁻⁸ |M^|`` element-wise
(bf16's unit roundoff; fp32 rounding apart).

With ``factor_dtype=torch.bfloat16`` the factors travel in bf16 (half the bytes): ``P``
and ``Q`` are bf16 collectives, the dense rest and the flag an fp32 one of their own (the
flag rides with ``P`` in a bucket without a dense rest), and all math stays fp32. Each
rank's residual is taken against the bf16-rounded ``Q_i`` it actually sent, so its own
rounding is fed back (only the rounding inside the SUM is not).

Nothing in a step waits for the device (no ``.item()``, no branch on a tensor): under
``overlap_grad_reduce`` the step runs inside backward, where a host sync would stall the
queueing of backward kernels. The non-finite flag (1 where this rank's ``P`` — after the
cast to the factor dtype, so a bf16 overflow counts — or dense rest holds a NaN/Inf) is
written into the buffer on the device, and after the SUM every rank holds the same count,
so every rank runs the same steps and issues the same collectives. Where the count is
non-zero the step still runs to the end, but the decompressed gradients are NaN (the
summed dense rest is non-finite already) — the non-finite gradient Megatron's optimizer
acts on, as it would without compression — and ``E`` and ``Q`` keep their values from
before the step (selected with ``torch.where``, one pass over ``E``).

The residual is the local one of Vogels et al. (Algorithm 1): ``sum_i E_i = sum_i M_i -
M^``, so nothing is lost, and at full rank every ``E_i`` is zero. (PyTorch's
``powerSGD_hook`` keeps ``M_i - mean``, whose per-rank part random-walks at full rank.)

Matrices of equal shape are batched (one call per shape and run of equally spaced
matrices; no per-matrix loop, no ``torch.linalg.qr``). With ``ef_dtype=torch.bfloat16``
the residual is kept in bf16 (half the state; its rounding is not fed back). A matrix is
compressed at rank ``r`` only when ``min(n, m) > r`` and ``(n + m) r · min_rate <= n m``; it then sends
``(n + m) r`` instead of ``n m`` elements.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_edgc.compression.kernels import (ShapeGroup, Step, WireLayout, copy_dense_back,
                                               factor_failure, split_factors)
from megatron_edgc.compression.low_rank_state import LowRankState
from megatron_edgc.compression.matrices import seeded_gaussian
from megatron_edgc.compression.orthonormal import orthonormalize


class BucketCompressor(LowRankState):
    """PowerSGD of a whole bucket (module docstring): ``start`` → SUM → ``middle`` → SUM →
    ``finish``; the shared factor ``P = M Q`` on the rows' side."""

    #: The orthonormalization of the summed P (``bench/step_before.py`` swaps in the old).
    orthonormalize = staticmethod(orthonormalize)

    def fresh(self, rank: int) -> "BucketCompressor":
        """A compressor of the same entries and settings at ``rank``, with no state (the
        bypass times one on scratch gradients)."""
        return BucketCompressor(self.entries, rank, **self._settings())

    # ------------------------------------------------------------------ sizes

    def _q_shape(self, g: ShapeGroup) -> tuple:
        return (g.m, self._rank_for(g))

    def _seeded(self, g: ShapeGroup, tag: str, cols: int) -> torch.Tensor:
        return torch.stack([seeded_gaussian(self.seed, name, tag, g.m, cols)
                            for name in g.seed_names])

    def _factor_numels(self) -> tuple[int, int]:
        p = sum(len(g.indices) * g.n * self._rank_for(g) for g in self.groups.values())
        q = sum(len(g.indices) * g.m * self._rank_for(g) for g in self.groups.values())
        return p, q

    def layouts(self) -> tuple[WireLayout, WireLayout]:
        """The two phases' buffers: ``[P | dense rest | flag]`` and ``[Q]``."""
        p, q = self._factor_numels()
        return (WireLayout(p, self._dense_numel_sent(), self.factor_dtype,
                           dense_dtype=self.dense_dtype),
                WireLayout(q, 0, self.factor_dtype, flag=False))

    def phase_bytes(self) -> tuple[list, list]:
        first, second = self.layouts()
        return first.bytes(), second.bytes()

    # ------------------------------------------------------------------ one step

    def _form_m_and_p(self, key, g: ShapeGroup, grads, step: Step) -> torch.Tensor:
        """``G += E`` in the group's gradients and ``P = M Q`` ([k, n, r], fp32); records
        the views ``M`` is held in for :meth:`middle` and :meth:`finish`."""
        views = step.views[key] = self.ef.views(g, grads)
        self.ef.form(g, views)
        return self.ef.project(g, views, g.q, transposed=False)

    def start(self, grads: Sequence[torch.Tensor]) -> tuple[list, Step]:
        """Error feedback ``G += E`` in the gradients and ``P = M Q``; returns the buffers
        to SUM-reduce (:meth:`layouts`' first). From here to :meth:`finish` the compressed
        gradients hold ``M = G + E``; the compressor's state is not changed. The flag is 1
        where any element of P (in the factor dtype) or of the dense rest is non-finite."""
        step = self._new_step(grads)
        device = grads[0].device if grads else self.device
        p_parts = [self._form_m_and_p(key, g, grads, step).view(-1)
                   for key, g in self.groups.items()]
        first, _ = self.layouts()
        return first.pack(p_parts, self._dense_parts(grads), device), step

    def middle(self, step: Step, reduced: Sequence[torch.Tensor]) -> list:
        """After the first SUM: orthonormalize P, ``Q = Mᵀ P^``, and the residual
        ``E = M - P^ Qᵀ`` against ``Q`` as it goes on the wire, selected into ``E`` where
        the summed flag is clear and the matrix's ``Q`` as sent is finite (a non-finite ``P^``
        gives a NaN ``Q``: :meth:`ErrorFeedback.project_and_take`); the dense rest
        into its gradients. Returns the buffers of the second SUM (``[Q]`` in the factor
        dtype, or none). Runs whatever the summed flag says."""
        first, second = self.layouts()
        p_buf, dense, step.nonfinite = first.unpack(reduced)
        shapes = [(len(g.indices), g.n, self._rank_for(g))
                  for g in self.groups.values()]
        stood_in: list = []
        for key, p in zip(self.groups, split_factors(p_buf, shapes)):
            step.p_hat[key] = self.orthonormalize(p, stood_in=stood_in)
        hats = list(step.p_hat.values())
        step.factor_failure = factor_failure(p_buf[:first.factors], hats, stood_in)
        wire = self._take_residuals(step, step.nonfinite, True)
        copy_dense_back(step.grads, self.dense_indices, dense)
        return second.pack(wire, [], p_buf.device)

    def finish(self, step: Step, reduced: Sequence[torch.Tensor]) -> None:
        """After the second SUM: ``M^ = P^ Qᵀ`` written over the gradients
        (:meth:`ErrorFeedback.write_result`: one ``baddbmm`` per run, no temporary of the
        gradients' size) and into the warm start. Where some rank flagged a non-finite
        value, or the summed Q is not finite (every rank sees it alike), the decompressed
        gradients are NaN and the warm start keeps its value bit for bit; ``E`` kept its
        own in :meth:`middle` where the first SUM's flag was set, and a step flagged only
        here is one the optimizer skips (:meth:`after_step` then gives the sent part back,
        ``E = M``)."""
        _, second = self.layouts()
        q_buf, _, _ = second.unpack(reduced)
        step.nonfinite = step.nonfinite | torch.isfinite(q_buf).all().logical_not()
        self._write_results(step, q_buf, step.nonfinite, True)
