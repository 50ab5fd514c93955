"""PowerSGD on one rank's shard of a bucket, across distributed-optimizer instances, with
one ``Q`` per matrix per instance on the slow hop (EDGC on the slow hop, issue 35).

With Megatron's partial distributed optimizer each bucket is reduce-scattered inside an
instance of ``s`` ranks (the fast hop); rank ``k`` then holds the rows ``b_k`` of every
matrix its shard cuts (:func:`~megatron_edgc.compression.shard.shard_pieces`), summed over
its instance ``t``: ``M_{b,t}``. PowerSGD of the whole matrix ``M = Σ_t Σ_b M_{b,t}`` is
linear in the row blocks, so one step is, per bucket (``L_P = Σ_j n_j r``,
``L_Q = Σ_j m_j r`` over the bucket's compressed matrices)::

    M_b   = G_b + E_b                    error feedback, in the gradient buffer
    P_b   = M_b Q                        Q: the whole matrix's warm start, same on all ranks
    [P_b | dense | flag] --SUM inter-->  the slow hop: this rank's rows only
    [P (L_P) | flag]     --SUM intra-->  each rank writes its rows, zeros elsewhere: an
                                         all-gather of the rows; the flag becomes the
                                         bucket's over the whole DP group
    P^    = orth(P)                      whole matrices this rank cuts (batched CholeskyQR3)
    Q_b   = M_b^T P^_b                   written at the matrix's place in ``[L_Q]``
    [L_Q] --reduce-scatter intra-->      Q_t, the instance's sum, 1/s of it per rank
    Q_t slice --SUM inter-->             the slow hop: L_Q / s per rank, one Q per instance
    [Q_t | Q] --all-gather intra-->      every rank: its instance's Q_t and the sum Q
    E_b   = M_b - P^_b Q_t^T             rows b of the instance's residual M_t - P^ Q_t^T
    G_b   = P^_b Q^T                     ≈ rows b of Σ_t M_t

The residual is Vogels et al.'s local one with the instance as the worker: ``Σ_t E_t =
M - P^ Q^T`` (nothing is lost) and at full rank every ``E`` is zero. Per rank the slow hop
carries ``Σ_b n_b r + L_Q / s`` elements against flat EDGC's ``L_P + L_Q``: one ``Q`` per
instance instead of one per rank, so the bytes across instances do not grow with ``s``.
The math (``P = M Q``, ``Mᵀ P^``, the residual) and the error feedback memory are this
rank's rows only, 1/s of the bucket's; only the orthonormalization is of the whole
matrices the shard cuts (``14 n r²`` beside ``8 n m r / s``).

A non-finite value anywhere in the bucket reaches every rank's flag (through the intra
SUM), so every rank keeps ``E`` and the warm start ``Q`` bit for bit, as a flat bucket
does, and the shared ``Q`` stays the same on every rank.

Pure tensors: :mod:`megatron_edgc.patches.ddp` issues the collectives, in this order.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_edgc.compression.powersgd import BucketCompressor, ShapeGroup, _Step


class ShardCompressor(BucketCompressor):
    """PowerSGD with error feedback on one rank's shard of a bucket, one ``Q`` per
    instance (module docstring).

    ``entries``: this rank's pieces ``(name, (rows, m))``; ``parents``: per entry
    ``(matrix name, matrix rows, first row)`` for a row block of a matrix, None for a piece
    sent dense; ``matrices``: ``(name, (n, m))`` of every matrix of the bucket, in bucket
    order, the same list on every rank of the instance; ``instance_size``: ``s``.
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

    def _layout(self) -> dict:
        """Where each compressed matrix sits in the bucket-wide ``[L_P]`` and ``[L_Q]``
        buffers, and per shape group the flat indices of its blocks' rows of ``P^`` and of
        their matrices' ``Q`` (host arithmetic once per rank change; indices on the device
        on first use)."""
        if self._layout_cache is not None:
            return self._layout_cache
        p_at, q_at = {}, {}
        lp = lq = 0
        for name, (n, m) in self.matrices:
            if n > 1 and self._compressible(n, m):
                r = min(self.rank_of_shape(n, m), n, m)
                p_at[name], q_at[name] = (lp, n, m, r), lq
                lp, lq = lp + n * r, lq + m * r
        s = self.instance_size
        lq_padded = -(-lq // s) * s
        # the whole matrices this rank cuts, batched per shape for the orthonormalization;
        # their P^ laid out one after the other in that order
        batches: dict = {}
        for g in self.groups.values():
            for matrix in g.seed_names:
                _, n, m, r = p_at[matrix]
                names = batches.setdefault((n, m, r), [])
                if matrix not in names:
                    names.append(matrix)
        hat_at, offset = {}, 0
        for (n, m, r), names in batches.items():
            for matrix in names:
                hat_at[matrix] = offset
                offset += n * r
        groups = {}
        for key, g in self.groups.items():
            r = self._rank_for(g)
            rows = [self.parents[i][2] for i in g.indices]
            groups[key] = ([hat_at[mx] + r0 * r for mx, r0 in zip(g.seed_names, rows)],
                           [q_at[mx] for mx in g.seed_names])
        self._layout_cache = {"p_at": p_at, "lp": lp, "lq": lq, "lq_padded": lq_padded,
                              "batches": [(n, m, r, [p_at[mx][0] for mx in names])
                                          for (n, m, r), names in batches.items()],
                              "groups": groups, "device_index": {}}
        return self._layout_cache

    def _index(self, name, starts: list, length: int, device) -> torch.Tensor:
        """``[len(starts) * length]`` flat indices ``start + arange(length)``, cached."""
        cache = self._layout()["device_index"]
        key = (name, str(device))
        if key not in cache:
            base = torch.tensor(starts, dtype=torch.long).unsqueeze(1)
            cache[key] = (base + torch.arange(length)).reshape(-1).to(device)
        return cache[key]

    def matrix_shapes(self) -> list:
        """``(n, m)`` of the bucket's whole matrices (the budget controller's view)."""
        return [shape for _, shape in self.matrices]

    def fresh(self, rank: int) -> "ShardCompressor":
        return ShardCompressor(self.entries, self.parents, self.matrices, self.instance_size,
                               rank, min_compression_rate=self.min_compression_rate,
                               seed=self.seed, device=self.device,
                               factor_dtype=self.factor_dtype, ef_dtype=self.ef_dtype)

    def local_step(self, grads: Sequence[torch.Tensor]) -> None:
        """One step's math, every collective left out (the fast hop's SUMs, the slow hop's
        all-reduces): what the bypass's cost model times."""
        bufs, step = self.start(grads)
        q_full = self.middle(step, bufs, self.spread_p(step, bufs))
        pair = q_full.view(self.instance_size, 1, -1)
        self.finish(step, torch.cat([pair, pair], dim=1))

    # ------------------------------------------------------------------ sizes

    def collective_numels(self) -> tuple[int, int]:
        """Elements on the slow hop: ``[P rows | dense rest | flag]`` and this rank's
        slice of the instance's ``Q``."""
        first, _ = super().collective_numels()
        return first, self._layout()["lq_padded"] // self.instance_size

    def fast_hop_numels(self) -> tuple[int, int, int]:
        """Elements of the fast hop's collectives per step: the ``P`` all-gather (as a SUM
        of ``[L_P | flag]``), the ``Q`` reduce-scatter's input and the all-gather's."""
        lay = self._layout()
        return lay["lp"] + 1, lay["lq_padded"], 2 * lay["lq_padded"] // self.instance_size

    # ------------------------------------------------------------------ one step

    def spread_p(self, step: _Step, reduced: Sequence[torch.Tensor]) -> torch.Tensor:
        """After the slow hop's SUM of :meth:`start`'s buffers: ``[L_P | flag]`` (fp32),
        this rank's rows of every matrix at their place, zeros elsewhere, and its flag,
        for a SUM over the instance."""
        lay = self._layout()
        device = reduced[-1].device
        out = torch.zeros(lay["lp"] + 1, device=device)
        p_buf, offset = reduced[0], 0
        for key, g in self.groups.items():
            k, r = len(g.indices), self._rank_for(g)
            p = p_buf[offset:offset + k * g.n * r]
            offset += k * g.n * r
            starts = [lay["p_at"][mx][0] + self.parents[i][2] * r
                      for mx, i in zip(g.seed_names, g.indices)]
            out.index_copy_(0, self._index(("p", key), starts, g.n * r, device), p.float())
        out[-1:] = reduced[-1][-1:]
        return out

    def middle(self, step: _Step, reduced: Sequence[torch.Tensor],
               p_full: torch.Tensor) -> torch.Tensor:
        """After the instance's SUM of :meth:`spread_p`: orthonormalize the whole matrices
        this rank cuts, ``Q_b = M_bᵀ P^_b`` at each matrix's place in ``[L_Q]`` (fp32,
        padded to a multiple of ``s``; zeros where this rank has no rows), the dense rest
        into its gradients. Returns that buffer, for the instance's reduce-scatter."""
        lay = self._layout()
        device = p_full.device
        step.nonfinite = p_full[-1:] > 0
        hats = []
        for n, m, r, starts in lay["batches"]:
            p = p_full[self._index(("batch", n, m, r), starts, n * r, device)]
            hats.append(self.orthonormalize(p.view(len(starts), n, r)).reshape(-1))
        p_hat_all = torch.cat(hats) if hats else p_full[:0]
        q_full = torch.zeros(lay["lq_padded"], device=device)
        for key, g in self.groups.items():
            k, r = len(g.indices), self._rank_for(g)
            hat_starts, q_starts = lay["groups"][key]
            p_hat = p_hat_all[self._index(("hat", key), hat_starts, g.n * r, device)]
            p_hat = p_hat.view(k, g.n, r)
            step.p_hat[key] = p_hat
            q_local = torch.empty(k, g.m, r, device=device)
            for lo, hi, view in step.views[key]:
                torch.bmm(view.transpose(1, 2), p_hat[lo:hi], out=q_local[lo:hi])
            q_full.index_copy_(0, self._index(("q", key), q_starts, g.m * r, device),
                               q_local.view(-1))
        # the dense rest: in the first buffer after P, or in its own with bf16 factors
        split = len(reduced) > 1 or (self.factor_dtype != torch.float32 and not self.groups)
        dense_buf = reduced[-1]
        offset = 0 if split else sum(len(g.indices) * g.n * self._rank_for(g)
                                     for g in self.groups.values())
        for i in self.dense_indices:
            grad = step.grads[i]
            grad.copy_(dense_buf[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        assert offset == dense_buf.numel() - 1
        return q_full

    def instance_q(self, own: torch.Tensor) -> torch.Tensor:
        """``own``: this rank's slice of its instance's ``Q_t`` (the reduce-scatter's
        output, row 0 of a ``[2, L_Q / s]`` fp32 pair). Rounds it to the factor dtype in
        place (the residual is taken against what was sent) and returns the copy to
        SUM across instances; its sum goes into row 1 of the pair before the all-gather."""
        sent = own.to(self.factor_dtype, copy=True)
        own.copy_(sent)
        return sent

    def finish(self, step: _Step, gathered: torch.Tensor) -> None:
        """After the instance's all-gather of ``[Q_t slice | Q slice]`` pairs (``[s, 2,
        L_Q / s]``): the residual ``E_b = M_b - P^_b Q_tᵀ`` selected into ``E``, then
        ``P^_b Qᵀ`` into the gradients and ``Q`` into the warm start; where the bucket's
        flag is set, ``Q`` is NaN (so are the gradients) and ``E``, the warm start keep
        their values."""
        lay = self._layout()
        bad = step.nonfinite
        q_inst = gathered[:, 0].reshape(-1)
        q_sum = gathered[:, 1].reshape(-1)
        for key, g in self.groups.items():
            k, r = len(g.indices), self._rank_for(g)
            index = self._index(("q", key), lay["groups"][key][1], g.m * r, q_sum.device)
            q_t = q_inst[index].view(k, g.m, r)
            q = q_sum[index].view(k, g.m, r).masked_fill(bad, float("nan"))
            p_hat = step.p_hat[key]
            energy = None
            for lo, hi, view in step.views[key]:
                if self.track_spectrum:
                    part = torch.linalg.vector_norm(view).double() ** 2
                    energy = part if energy is None else energy + part
                view.baddbmm_(p_hat[lo:hi], q_t[lo:hi].transpose(1, 2), alpha=-1)
                for a, b in self._ef_slices(lo, hi, g):
                    if self.ef_dtype == torch.float32:
                        torch.where(bad, g.residual[a:b], view[a - lo:b - lo],
                                    out=g.residual[a:b])
                    else:
                        g.residual[a:b].copy_(torch.where(bad, g.residual[a:b].float(),
                                                          view[a - lo:b - lo]))
                view.baddbmm_(p_hat[lo:hi], q[lo:hi].transpose(1, 2), beta=0)
            if step.copied[key]:
                (_, _, stacked), = step.views[key]
                for j, i in enumerate(g.indices):
                    step.grads[i].copy_(stacked[j])
            if self.track_spectrum:
                # the instance's column energies, each block weighted by its share of the
                # matrix's rows: summed over the blocks they are the whole matrix's
                weight = (g.n / g.full_n) ** 0.5
                self._add_spectrum((g.full_n, g.m), energy, q_t * weight, bad)
            g.q = torch.where(bad, g.q, q)
            step.views[key] = None


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
