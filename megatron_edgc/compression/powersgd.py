"""PowerSGD low-rank compression with error feedback of one DP bucket (EDGC §1; Vogels et
al., NeurIPS 2019): the step and its reasons are in docs/method.md §1 ("One step, as the
code runs it", bf16 buffers and factors, the step at its floor).

Pure tensors in and out: a :class:`BucketCompressor` turns a bucket into the buffers its
two SUM collectives carry and rebuilds the gradient from the reduced ones; whoever drives
it issues the collectives (``patches/ddp.py``; the tests simulate DP ranks). No copy of
the gradients (``M`` is formed in the gradient buffer, or in fp32 slices of a bounded
workspace from bf16 buffers), one batched call per shape group and run of equally spaced
matrices, and no host sync: a non-finite value is a flag on the device.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_edgc.compression.kernels import (ShapeGroup, Step, WireLayout, all_finite,
                                               copy_dense_back, factor_failure, split_factors)
from megatron_edgc.compression.low_rank_state import LowRankState
from megatron_edgc.compression.matrices import seeded_gaussian
from megatron_edgc.compression.orthonormal import orthonormalize, orthonormalize_step


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

    def middle(self, step: Step, reduced: Sequence[torch.Tensor], pack: bool = True) -> list:
        """After the first SUM: orthonormalize P, ``Q = Mᵀ P^``, and the residual
        ``E = M - P^ Qᵀ`` against ``Q`` as it goes on the wire, selected into ``E`` where
        the summed flag is clear and the matrix's ``Q`` as sent is finite (a non-finite ``P^``
        gives a NaN ``Q``: :meth:`ErrorFeedback.project_and_take`); the dense rest
        into its gradients. Returns the buffers of the second SUM (``[Q]`` in the factor
        dtype, or none; none packed without ``pack``: a step with no collective). Runs
        whatever the summed flag says."""
        first, second = self.layouts()
        p_buf, dense, step.nonfinite = first.unpack(reduced)
        shapes = [(len(g.indices), g.n, self._rank_for(g))
                  for g in self.groups.values()]
        stood_in: list = []
        hats = orthonormalize_step(split_factors(p_buf, shapes), stood_in, self.orthonormalize)
        step.p_hat.update(zip(self.groups, hats))
        hats = list(step.p_hat.values())
        step.factor_failure = factor_failure(p_buf[:first.factors], hats, stood_in)
        wire = self._take_residuals(step, step.nonfinite, True)
        copy_dense_back(step.grads, self.dense_indices, dense)
        return second.pack(wire, [], p_buf.device) if pack else []

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
        step.nonfinite = step.nonfinite | all_finite(q_buf).logical_not()
        self._write_results(step, q_buf, step.nonfinite, True)
