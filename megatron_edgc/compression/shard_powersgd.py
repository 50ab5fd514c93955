"""PowerSGD on one rank's shard of a bucket across distributed-optimizer instances, the
shared factor on the columns' side (EDGC on the slow hop, issue 35): the step, its
residual and its flags are in docs/method.md §1 ("The slow hop").

Pure tensors, the contract of :class:`~megatron_edgc.compression.low_rank_state.LowRankState`:
``start`` gives ``[[L | flag]]`` for the instance's reduce-scatter, :meth:`ShardCompressor.to_send`
the slice that crosses, ``middle`` takes the all-gathered ``[P]`` and gives the second
phase's buffers, ``finish`` takes them summed. The DP patch issues the collectives.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_edgc.compression.kernels import (ShapeGroup, Step, WireLayout, copy_dense_back,
                                               factor_failure)
from megatron_edgc.compression.low_rank_state import LowRankState
from megatron_edgc.compression.matrices import seeded_gaussian
from megatron_edgc.compression.orthonormal import orthonormalize


class ShardCompressor(LowRankState):
    """PowerSGD with error feedback on one rank's shard of a bucket, the shared factor on
    the columns' side (module docstring).

    ``entries``: this rank's pieces ``(name, (rows, m))``; ``parents``: per entry
    ``(matrix name, matrix rows, first row)`` for a row block of a matrix, None for a piece
    sent dense; ``matrices``: ``(name, (n, m))`` of every matrix of the bucket, in bucket
    order, the same list on every rank; ``instance_size``: ``s``. The warm start ``Q`` of a
    group is ``[k, rows, r]``: this rank's rows of each matrix's.
    """

    def __init__(self, entries: Sequence[tuple[str, tuple[int, int]]],
                 parents: Sequence[Optional[tuple[str, int, int]]],
                 matrices: Sequence[tuple[str, tuple[int, int]]], instance_size: int,
                 rank: int, **kwargs):
        assert len(parents) == len(entries)
        self.parents = list(parents)
        self.matrices = [(name, (int(n), int(m))) for name, (n, m) in matrices]
        self.instance_size = instance_size
        self._layout_cache: Optional[dict] = None
        super().__init__(entries, rank, **kwargs)

    # ------------------------------------------------------------------ planning

    def _entry_group(self, i: int, name: str, n: int, m: int) -> Optional[tuple]:
        parent = self.parents[i]
        if parent is None:
            return None
        matrix, full_n, _ = parent
        if not self._compressible(full_n, m):
            return None
        return (n, m, full_n), full_n, matrix

    def _plan(self) -> None:
        super()._plan()
        self._layout_cache = None
        self._layout()   # and its device indices: built here, outside the step

    def _seeded(self, g: ShapeGroup, tag: str, cols: int) -> torch.Tensor:
        """This rank's rows of each matrix's seeded ``[n, cols]`` Gaussian (the same
        matrix on every rank that holds rows of it)."""
        return torch.stack([
            seeded_gaussian(self.seed, name, tag, g.full_n, cols)[r0:r0 + g.n]
            for name, r0 in zip(g.seed_names, (self.parents[i][2] for i in g.indices))])

    def _q_shape(self, g: ShapeGroup) -> tuple:
        return (g.n, self._rank_for(g))

    def _layout(self) -> dict:
        """Where each compressed matrix's ``P`` (``m × r``) sits in the bucket-wide
        ``[L]``; the matrices this rank cuts, batched per shape for the orthonormalization
        (their ``P^`` one after the other); per group the flat indices of its blocks'
        ``P`` in ``[L]`` and ``P^`` in that batch. Built with :meth:`_plan` (at a rank
        change, outside the step), the indices on the compressor's device."""
        if self._layout_cache is not None:
            return self._layout_cache
        p_at, length = {}, 0
        for name, (n, m) in self.matrices:
            if n > 1 and self._compressible(n, m):
                r = min(self.rank_of_shape(n, m), n, m)
                p_at[name] = (length, m, r)
                length += m * r
        s = self.instance_size
        # [L | flag], padded to s; nothing at all when no matrix of the bucket is compressed
        # (the same on every rank: the bucket's matrix list is): no factor is shared then
        padded = -(-(length + 1) // s) * s if length else 0
        batches: dict = {}
        for g in self.groups.values():
            for matrix in g.seed_names:
                names = batches.setdefault(p_at[matrix][1:], [])
                if matrix not in names:
                    names.append(matrix)
        hat_at, offset = {}, 0
        for (m, r), names in batches.items():
            for matrix in names:
                hat_at[matrix] = offset
                offset += m * r

        def index(starts: list, size: int) -> torch.Tensor:
            """``[len(starts) * size]`` flat indices ``start + arange(size)``."""
            base = torch.tensor(starts, dtype=torch.long).unsqueeze(1)
            flat = (base + torch.arange(size)).reshape(-1)
            return flat if self.device is None else flat.to(self.device)

        groups = {}
        for key, g in self.groups.items():
            k = g.m * self._rank_for(g)
            groups[key] = (index([p_at[mx][0] for mx in g.seed_names], k),
                           index([hat_at[mx] for mx in g.seed_names], k))
        self._layout_cache = {
            "flag_at": length,               # the bucket's non-finite count, after P
            "length": padded,
            "batches": [(m, r, index([p_at[mx][0] for mx in names], m * r))
                        for (m, r), names in batches.items()],
            "groups": groups}
        return self._layout_cache

    def matrix_shapes(self) -> list:
        """``(n, m)`` of the bucket's whole matrices (the budget controller's view)."""
        return [shape for _, shape in self.matrices]

    def fresh(self, rank: int) -> "ShardCompressor":
        return ShardCompressor(self.entries, self.parents, self.matrices, self.instance_size,
                               rank, **self._settings())

    # ------------------------------------------------------------------ sizes

    def shares_factor(self) -> bool:
        """Whether the bucket has a compressed matrix, so the first phase runs (the same
        answer on every rank)."""
        return self._layout()["length"] > 0

    def slice_numel(self) -> int:
        """Elements of this rank's slice of ``[L | flag]`` (the first phase across
        instances)."""
        return self._layout()["length"] // self.instance_size

    def second_layout(self) -> WireLayout:
        """The buffers across instances after the slice: ``[Q_b'... | dense | flag]``."""
        rows = sum(len(g.indices) * g.n * self._rank_for(g) for g in self.groups.values())
        return WireLayout(rows, self._dense_numel_sent(), self.factor_dtype,
                          dense_dtype=self.dense_dtype)

    def phase_bytes(self) -> tuple[list, list]:
        """Bytes across instances: the ``P`` slice (factor dtype), then the second phase."""
        first = [self.slice_numel() * self._factor_size()] if self.shares_factor() else []
        return first, self.second_layout().bytes()

    # ------------------------------------------------------------------ one step

    def start(self, grads: Sequence[torch.Tensor]) -> tuple[list, Step]:
        """``G += E`` in the gradients and ``P_b = M_bᵀ Q_b`` of every block, each at its
        matrix's place in ``[L | flag]`` (fp32, zeros where this rank holds no rows): the
        one buffer of the instance's reduce-scatter (none when :meth:`shares_factor` is
        false). The compressor's state is not changed until :meth:`finish`."""
        step = self._new_step(grads)
        device = grads[0].device if grads else self.device   # a shard of bucket padding
        lay = self._layout()
        p_full = torch.zeros(lay["length"], device=device)
        step.dense = self._dense_parts(grads)
        if step.dense and lay["length"]:   # a NaN in the dense rest: every rank knows
            p_full[lay["flag_at"]] = torch.isfinite(torch.cat(step.dense)).all().logical_not()
        for key, g in self.groups.items():
            views = step.views[key] = self.ef.views(g, grads)
            self.ef.form(g, views)
            p = self.ef.project(g, views, g.q, transposed=True)
            p_full.index_copy_(0, lay["groups"][key][0], p.view(-1))
        return ([p_full] if lay["length"] else []), step

    def to_send(self, own: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the instance's ``P`` (the reduce-scatter's output) as it
        goes across instances: in the factor dtype."""
        return own.to(self.factor_dtype, copy=True)

    def middle(self, step: Step, gathered: Sequence[torch.Tensor]) -> list:
        """After the all-gather of the summed slices (``gathered``: ``[[L]]``, every
        matrix's ``P``, or nothing): orthonormalize the matrices this rank cuts,
        ``Q_b' = M_b P^`` and the residual ``E_b = M_b - Q_b' P^ᵀ`` against ``Q_b'`` as
        sent, selected into ``E`` where ``P`` and the shards' flag are finite; returns
        the buffers to SUM across instances, ``[Q_b'... | dense | flag]``, the flag also
        set where ``P`` is non-finite."""
        lay = self._layout()
        device = gathered[0].device if gathered else self.device
        p_full = gathered[0].float() if gathered else torch.empty(0, device=device)
        stood_in: list = []
        hats = [orthonormalize(p_full[index].view(-1, m, r), stood_in=stood_in).reshape(-1)
                for m, r, index in lay["batches"]]
        p_hat_all = torch.cat(hats) if hats else p_full[:0]
        step.factor_failure = factor_failure(p_full, hats, stood_in)
        # a non-finite P, or a shard's flag (summed into its slot): every rank of the
        # instance sees both; the residual is taken where neither is set
        nonfinite = torch.zeros(1, dtype=torch.bool, device=device)
        if p_full.numel():
            nonfinite = torch.isfinite(p_full).all().logical_not() | (p_full[lay["flag_at"]] > 0)
        step.nonfinite = nonfinite.view(1)
        for key, g in self.groups.items():
            step.p_hat[key] = p_hat_all[lay["groups"][key][1]].view(
                len(g.indices), g.m, self._rank_for(g))
        wire = self._take_residuals(step, step.nonfinite, False)
        return self.second_layout().pack(wire, step.dense, device,
                                         also_nonfinite=step.nonfinite)

    def finish(self, step: Step, reduced: Sequence[torch.Tensor]) -> None:
        """After the SUM of :meth:`middle`'s buffers across instances: ``(Σ_t Q_b') P^ᵀ``
        into the gradients and into the warm start, the dense rest into its gradients
        (the residual ``E_b = M_b - Q_b' P^ᵀ`` was taken in :meth:`middle`). Where the
        flag is set the gradients are NaN and ``Q_b`` keeps its value; ``E`` kept its own
        where this instance's flag was set, and a step flagged by another instance only
        is one the optimizer skips (:meth:`after_step`: ``E = M``)."""
        q_buf, dense, step.nonfinite = self.second_layout().unpack(reduced)
        # the spectrum: column j of Q_b' = M_b p^_j, its energy summed over the blocks is
        # the instance's ‖M_t p^_j‖²
        self._write_results(step, q_buf, step.nonfinite, False)
        copy_dense_back(step.grads, self.dense_indices, dense)


def shard_compressor_inputs(pieces, matrices) -> tuple[list, list]:
    """``(entries, parents)`` of :class:`ShardCompressor` from
    :func:`~megatron_edgc.compression.shard.shard_pieces` (``matrices``: ``(name, (n, m),
    offset)`` of the bucket's matrices, the pieces' parents)."""
    rows = {name: shape[0] for name, shape, _ in matrices}
    entries, parents = [], []
    for pc in pieces:
        entries.append((pc.name, pc.shape))
        parents.append((pc.parent, rows[pc.parent], pc.row0) if pc.row_block else None)
    return entries, parents
