"""What PowerSGD keeps per bucket between steps: the shape groups, their ranks, warm starts
and error-feedback residuals, their sizes on the wire, and their checkpoint.

:class:`LowRankState` is the common part of the flat compressor
(:class:`~megatron_edgc.compression.powersgd.BucketCompressor`) and the slow hop's
(:class:`~megatron_edgc.compression.shard_powersgd.ShardCompressor`). Both have one
contract: ``start(grads) -> (buffers, step)``, ``middle(step, reduced) -> buffers``,
``finish(step, reduced)``, each list of buffers one collective each, and
:meth:`wire_bytes`, the bytes of every collective on the compressed group in order.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_edgc.compression.kernels import (ErrorFeedback, ShapeGroup, Step, dtype_bytes,
                                               resized_warm_start, split_factors, to_device)
from megatron_edgc.compression.matrices import is_compressible


class LowRankState:
    """Shape groups, ranks, warm starts and residuals of one bucket (module docstring).

    ``entries`` lists the bucket's gradients as ``(name, (n, m))`` in a fixed order; every
    call then passes the gradients as matrix views in that order.
    """

    #: Bound on the fp32 temporaries of a step: the mixed-dtype error feedback and the
    #: slices of ``M`` formed from low-precision gradients (:class:`ErrorFeedback`).
    workspace_bytes = 64 << 20

    def __init__(self, entries: Sequence[tuple[str, tuple[int, int]]], rank: int, *,
                 min_compression_rate: float = 2.0, seed: int = 0,
                 compress_all: bool = False, device=None,
                 factor_dtype: torch.dtype = torch.float32,
                 ef_dtype: torch.dtype = torch.float32,
                 dense_dtype: torch.dtype = torch.float32):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.entries = [(name, (int(n), int(m))) for name, (n, m) in entries]
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self.compress_all = compress_all  # tests: compress every matrix, even at full rank
        self.device = device
        self.factor_dtype = factor_dtype  # factors on the wire; all math in fp32
        self.ef_dtype = ef_dtype          # the residual kept between steps
        self.dense_dtype = dense_dtype    # the uncompressed rest on the wire
        self.ef = ErrorFeedback(ef_dtype, self.workspace_bytes)
        self.rank = rank
        self.shape_ranks: dict[tuple[int, int], int] = {}  # per-shape overrides of ``rank``
        #: When set, ``finish`` adds each group's captured energy per basis column to
        #: :attr:`spectrum` (the budget controller's measured error curves): per shape
        #: ``[Σ‖M‖², Σ column energies, steps]`` as float64 / int64 tensors on the device.
        self.track_spectrum = False
        self.spectrum: dict[tuple[int, int], list] = {}
        self.groups: dict[tuple, ShapeGroup] = {}
        self.dense_indices: list[int] = []
        self._pending_flush: dict[str, torch.Tensor] = {}  # residuals of matrices gone dense
        #: every residual is zero (none kept since the last :meth:`absorb_residual`): a
        #: dense sync then has nothing to add, and scales and casts in one pass
        self.residual_clear = True
        #: float ``[1]`` on the device: the loss scale of the step about to run (the loss
        #: scaler's, fp16), set by the driver before each step; None without a scaler
        self.loss_scale: Optional[torch.Tensor] = None
        #: ``(group, bad, (A, B))`` of the last step's residuals ``E = M - A Bᵀ``, until
        #: :meth:`after_step` knows whether the optimizer applied the step
        self._sent: list = []
        #: the last dense sync added the residuals into its message; they are zeroed once
        #: the step is applied (:meth:`after_step`), kept where it was skipped
        self._absorb_pending = False
        self._plan()

    # ------------------------------------------------------------------ planning

    def rank_of_shape(self, n: int, m: int) -> int:
        return self.shape_ranks.get((n, m), self.rank)

    def _compressible(self, n: int, m: int) -> bool:
        if self.compress_all:
            return n > 1 and m > 1
        return n > 1 and is_compressible(n, m, self.rank_of_shape(n, m), self.min_compression_rate)

    def _rank_for(self, g: ShapeGroup) -> int:
        n = g.full_n or g.n
        return min(self.rank_of_shape(n, g.m), n, g.m)

    def _entry_group(self, i: int, name: str, n: int, m: int) -> Optional[tuple]:
        """``(group key, whole matrix rows, warm-start seed name)`` of entry ``i``, or None
        when it is sent dense. A subclass whose entries are row blocks overrides it."""
        if not self._compressible(n, m):
            return None
        return (n, m), n, name

    def _plan(self) -> None:
        old = {name: (g, j) for g in self.groups.values() for j, name in enumerate(g.names)}
        groups: dict[tuple, ShapeGroup] = {}
        dense = []
        for i, (name, (n, m)) in enumerate(self.entries):
            found = self._entry_group(i, name, n, m)
            if found is None:
                dense.append(i)
                continue
            key, full_n, seed_name = found
            g = groups.setdefault(key, ShapeGroup(n, m, [], [], full_n))
            g.indices.append(i)
            g.names.append(name)
            g.seed_names.append(seed_name)
        # Carry Q and residuals of matrices that stay compressed.
        previous = {tuple(g.names): g for g in self.groups.values()}
        for g in groups.values():
            same = previous.get(tuple(g.names))
            if same is not None:  # the same matrices in the same order: keep the tensors
                g.q, g.residual = same.q, same.residual
                continue
            if not g.names or not all(name in old for name in g.names):
                continue
            qs, es = [], []
            for name in g.names:
                og, j = old[name]
                if og.q is None:
                    break
                qs.append(og.q[j])
                es.append(og.residual[j])
            else:
                g.q = torch.stack(qs)
                g.residual = torch.stack(es)
        # Matrices that fall back to dense hand their residual back once (nothing is lost).
        for name, (og, j) in old.items():
            if og.residual is not None and not any(name in g.names for g in groups.values()):
                self._pending_flush[name] = og.residual[j].clone()
        self.groups = groups
        self.dense_indices = dense

    def set_rank(self, rank: int, shape_ranks: Optional[dict] = None) -> None:
        """Change the rank (``shape_ranks``: per matrix shape ``(n, m)``, overriding
        ``rank``): Q loses trailing columns or gains seeded ones; E is kept."""
        shape_ranks = {tuple(k): int(v) for k, v in (shape_ranks or {}).items()}
        if rank < 1 or any(v < 1 for v in shape_ranks.values()):
            raise ValueError(f"rank must be >= 1, got {rank}, {shape_ranks}")
        if rank == self.rank and shape_ranks == self.shape_ranks:
            return
        self.rank = rank
        self.shape_ranks = shape_ranks
        self._plan()
        for g in self.groups.values():
            if g.q is not None:
                g.q = resized_warm_start(g.q, self._rank_for(g),
                                         lambda tag, cols, g=g: self._seeded(g, tag, cols))

    def prepare(self, device=None) -> None:
        """Allocate the warm start and the residual of every group that has none, outside
        the step (the seeded ``Q`` is made on the host and copied pinned, non-blocking):
        the driver calls it before backward, so no step seeds inside backward."""
        device = device if device is not None else self.device
        for g in self.groups.values():
            if g.q is None:
                self._init_group(g, device)

    def matrix_shapes(self) -> list:
        """``(n, m)`` of the bucket's matrices (the budget controller's view)."""
        return [shape for _, shape in self.entries]

    def _settings(self) -> dict:
        return dict(min_compression_rate=self.min_compression_rate, seed=self.seed,
                    device=self.device, factor_dtype=self.factor_dtype,
                    ef_dtype=self.ef_dtype, dense_dtype=self.dense_dtype)

    def local_step(self, grads: Sequence[torch.Tensor]) -> None:
        """One step's math with every collective left out (what the bypass's cost model
        times): each phase's buffers stand for their sum."""
        bufs, step = self.start(grads)
        self.finish(step, self.middle(step, bufs))

    # ------------------------------------------------------------------ sizes

    def _factor_size(self) -> int:
        return dtype_bytes(self.factor_dtype)

    def wire_bytes(self) -> list:
        """Bytes of every collective on the compressed group (DP, or across instances),
        in the order the step issues them (the bypass prices each one's latency)."""
        return [b for phase in self.phase_bytes() for b in phase]

    def collective_bytes(self) -> tuple[int, int]:
        """Bytes of the two phases on the compressed group."""
        first, second = self.phase_bytes()
        return sum(first), sum(second)

    def state_bytes(self) -> int:
        """What stays between steps: residuals (``ef_dtype``) and warm-start Q (fp32)."""
        ef = dtype_bytes(self.ef_dtype)
        return sum(len(g.indices) * (g.n * g.m * ef + self._q_shape(g)[0] * self._rank_for(g) * 4)
                   for g in self.groups.values())

    def dense_numel(self) -> int:
        return sum(n * m for _, (n, m) in self.entries)

    def _dense_numel_sent(self) -> int:
        return sum(self.entries[i][1][0] * self.entries[i][1][1] for i in self.dense_indices)

    # ------------------------------------------------------------------ state of a step

    def _seeded(self, g: ShapeGroup, tag: str, cols: int) -> torch.Tensor:
        """``[k, rows, cols]`` seeded Gaussians of the group's warm start (per matrix, the
        same on every rank): the first ``Q``, or columns added when the rank grows."""
        raise NotImplementedError

    def _q_shape(self, g: ShapeGroup) -> tuple:
        """The shape of one matrix's warm start ``Q``."""
        raise NotImplementedError

    def _init_group(self, g: ShapeGroup, device) -> None:
        g.q = to_device(self._seeded(g, "init", self._rank_for(g)), device)
        g.residual = torch.zeros(len(g.names), g.n, g.m, dtype=self.ef_dtype, device=device)

    def _new_step(self, grads: Sequence[torch.Tensor]) -> Step:
        """A step over ``grads``, every group's state allocated (:meth:`prepare` did it,
        unless the caller drives the compressor itself)."""
        assert len(grads) == len(self.entries)
        self._settle()
        if any(g.q is None for g in self.groups.values()):
            self.prepare(grads[0].device if grads else self.device)
        self.residual_clear = False
        self.ef.begin(self.loss_scale)
        return Step(grads=list(grads))

    def _take_residuals(self, step: Step, bad: torch.Tensor, basis_rows: bool) -> list:
        """Every group's second product and residual, in one pass over its ``M``
        (:meth:`ErrorFeedback.project_and_take`; ``basis_rows``: the basis ``P^`` is on the
        rows' side, the product ``Mᵀ P^``), ``E`` kept where ``bad``; the residuals' units
        committed. Returns the local factors as sent, flat, for the wire."""
        wire = []
        for key, g in self.groups.items():
            p_hat = step.p_hat[key]
            step.q_local[key], sent, step.energy[key] = self.ef.project_and_take(
                g, step.views[key], p_hat, basis_rows, bad, self.factor_dtype,
                energy=self.track_spectrum)
            step.q_sent[key] = sent
            # the factors E = M - A Bᵀ was taken against, until after_step (their size)
            self._sent.append((g, bad, (p_hat, sent) if basis_rows else (sent, p_hat)))
            wire.append(sent.view(-1))
        self.ef.commit(bad)
        return wire

    def _write_results(self, step: Step, q_buf: torch.Tensor, bad: torch.Tensor,
                       basis_rows: bool) -> None:
        """After the second collective: every group's ``P^ (ΣQ)ᵀ`` (or ``ΣQ P^ᵀ``) written
        over its gradients and ``ΣQ`` into its warm start (kept where ``bad``: the summed
        factors are NaN there), the measured spectrum added."""
        shapes = [(len(g.indices), g.m if basis_rows else g.n, self._rank_for(g))
                  for g in self.groups.values()]
        for (key, g), q in zip(self.groups.items(), split_factors(q_buf, shapes, bad)):
            p_hat = step.p_hat[key]
            self.ef.write_result(g, step.views[key], (p_hat, q) if basis_rows else (q, p_hat))
            g.q = torch.where(bad, g.q, q)
            if self.track_spectrum:
                self._add_spectrum((g.full_n, g.m), step.energy[key], step.q_local[key], bad)
            step.views[key] = None

    def _settle(self) -> None:
        """A step begins with the last one's outcome unreported: it was applied (what a
        caller that reports no skips has)."""
        self._settle_absorb()
        self._sent = []

    def _settle_absorb(self) -> None:
        if self._absorb_pending:
            self.after_step(applied=True)

    def after_step(self, applied: bool) -> None:
        """The optimizer applied this step's gradients (``applied``), or skipped the step
        (an fp16 overflow, a non-finite gradient norm): a skip loses nothing
        (docs/reliability.md, "A skipped step").

        * A compressed bucket's residual takes back what it sent: ``E += A Bᵀ`` per group,
          so ``E = M = G + E_before`` (to rounding), in this step's loss-scale units; where
          the bucket's gradients were not finite (``bad``) ``E`` kept its value from
          before the step already (its ``G`` holds the NaN/Inf), and adds nothing.
        * A bucket synced dense keeps the residual it added into the message
          (:meth:`absorb_residual`): it is zeroed only when the step was applied.

        The warm-start ``Q`` keeps the step's (a basis, not a gradient: nothing to lose).
        One ``baddbmm`` per group on a skip, nothing otherwise; no host read (``bad`` is
        selected on the device)."""
        sent, self._sent = self._sent, []
        if self._absorb_pending:
            self._absorb_pending = False
            if applied:
                for g in self.groups.values():
                    if g.residual is not None:
                        g.residual.zero_()
                self._pending_flush = {}
                self.residual_clear = True
        if applied:
            return
        for g, bad, (a, b) in sent:
            a, b = torch.where(bad, 0.0, a), torch.where(bad, 0.0, b).transpose(1, 2)
            if g.residual.dtype == torch.float32:
                g.residual.baddbmm_(a, b)
                continue
            for lo, hi in self.ef.slices(0, len(g.indices), g, 2):
                e = g.residual[lo:hi].float().baddbmm_(a[lo:hi], b[lo:hi])
                g.residual[lo:hi].copy_(e)

    def _dense_parts(self, grads: Sequence[torch.Tensor]) -> list:
        """The uncompressed gradients, flat in the dense wire dtype, a matrix's residual
        handed back once when it fell back to dense (nothing is lost)."""
        parts = []
        for i in self.dense_indices:
            self._flush_into(i, grads[i])
            parts.append(grads[i].reshape(-1).to(self.dense_dtype))
        return parts

    def _flush_into(self, i: int, grad: torch.Tensor, scale: float = 1.0,
                    keep: bool = False) -> None:
        """A matrix's residual handed back once into its gradient, in this step's units
        (``scale``: a further factor; ``keep``: until :meth:`after_step`)."""
        name = self.entries[i][0]
        if name in self._pending_flush:
            flush = self._pending_flush[name] if keep else self._pending_flush.pop(name)
            flush = flush.view_as(grad) * scale
            if self.ef.ratio is not None:
                flush = flush * self.ef.ratio
            grad.add_(flush.to(grad.dtype))

    def _add_spectrum(self, key, total: torch.Tensor, q_local: torch.Tensor,
                      bad: torch.Tensor) -> None:
        """Accumulate ``[Σ‖M‖², Σ_k sorted column energies of the local factor, steps]``
        for one group, on the device (``total``: ``Σ‖M‖²`` in float64; a step whose
        ``bad`` flag is set adds 0).

        The shared factor is orthonormal, so column ``j`` of the local factor carries
        exactly the energy the step captures in direction ``j``, and ``‖M‖² − Σ_j`` of
        them is ``‖E‖²``. Sorted per matrix, the first ``r'`` of them are the energy the
        best ``r'`` columns of this basis would keep: a measured error curve for every
        rank up to the current one, at the cost of one pass over the factor.
        """
        cols = (q_local.float() ** 2).sum(dim=1).sort(dim=1, descending=True).values.sum(0)
        good = bad.logical_not().view(())
        total, cols = torch.where(good, total, 0.0), torch.where(good, cols.double(), 0.0)
        entry = self.spectrum.get(key)
        if entry is None or entry[1].numel() != cols.numel():
            self.spectrum[key] = [total, cols, good.long()]
        else:
            entry[0] = entry[0] + total
            entry[1] = entry[1] + cols
            entry[2] = entry[2] + good.long()

    def absorb_residual(self, grads: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        """Before a dense sync of this bucket: add every residual (and pending flush) into
        its gradient, in this step's loss-scale units — the dense message carries the
        whole error, nothing is lost. The residuals are zeroed once the step is applied
        (:meth:`after_step`; a skipped step keeps them). The warm-start Q is kept for the
        next compressed step. ``scale``: the residuals' factor into the gradients' units
        (theirs are the scaled gradients'; a sync that scales after this passes the
        inverse)."""
        assert len(grads) == len(self.entries)
        self._settle()
        if self.residual_clear and not self._pending_flush:
            return
        self.ef.begin(self.loss_scale)
        for g in self.groups.values():
            if g.residual is None:
                continue
            views = self.ef.views(g, grads)
            self.ef.form(g, views, alpha=scale)
            for _, _, m, target in self.ef.blocks(g, views, alpha=scale):
                if target is not None:
                    target.copy_(m)
        for i in range(len(self.entries)):
            self._flush_into(i, grads[i], scale, keep=True)
        self._absorb_pending = True   # E itself unchanged: in the units it had

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        self._settle_absorb()
        out = {"rank": self.rank, "matrices": {},
               # the loss scale the residuals are in (fp16's scaler; None without one)
               "residual_units": None if self.ef.units is None else float(self.ef.units),
               "shape_ranks": [[n, m, r] for (n, m), r in sorted(self.shape_ranks.items())]}
        for g in self.groups.values():
            if g.q is None:
                continue
            for j, name in enumerate(g.names):
                out["matrices"][name] = {"q": g.q[j].cpu().clone(),
                                         "residual": g.residual[j].cpu().clone()}
        out["pending_flush"] = {k: v.cpu().clone() for k, v in self._pending_flush.items()}
        # the window's measured column energies so far (a mid-window checkpoint resumes them)
        out["spectrum"] = [[n, m, float(total), cols.cpu().clone(), int(count)]
                           for (n, m), (total, cols, count) in sorted(self.spectrum.items())]
        return out

    def load_state_dict(self, state: dict, device=None) -> list:
        """Restore; returns the names whose saved state did not fit (reset to fresh)."""
        shape_ranks = {(n, m): r for n, m, r in state.get("shape_ranks", [])}
        self.set_rank(state["rank"], shape_ranks)
        self.residual_clear = False
        mismatched = []
        mats = state["matrices"]
        dev = device if device is not None else self.device
        for g in self.groups.values():
            ok = all(name in mats and tuple(mats[name]["q"].shape) == self._q_shape(g)
                     and tuple(mats[name]["residual"].shape) == (g.n, g.m) for name in g.names)
            if ok:
                g.q = torch.stack([mats[name]["q"] for name in g.names]).to(dev)
                g.residual = torch.stack([mats[name]["residual"] for name in g.names]).to(
                    dev, self.ef_dtype)
            else:
                mismatched += [name for name in g.names if name in mats]
                g.q = g.residual = None
        self._pending_flush = dict(state.get("pending_flush", {}))
        self._sent, self._absorb_pending = [], False
        units = state.get("residual_units")
        self.ef.units = None if units is None else \
            torch.tensor([units], dtype=torch.float32, device=dev)
        self.spectrum = {(n, m): [torch.tensor(total, dtype=torch.float64, device=dev),
                                  cols.to(dev, torch.float64, copy=True),
                                  torch.tensor(count, dtype=torch.int64, device=dev)]
                         for n, m, total, cols, count in state.get("spectrum", [])}
        return mismatched
