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
                                               flat_runs, split_factors, to_device)
from megatron_edgc.compression.matrices import is_compressible
from megatron_edgc.compression.unit_state import UnitState


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
        #: the one owner of what the bucket keeps across steps: ``Q``, ``E``, the pending
        #: residuals of matrices gone dense, and what the step in flight sent
        self.state = UnitState(self.ef)
        self.rank = rank
        self.shape_ranks: dict[tuple[int, int], int] = {}  # per-shape overrides of ``rank``
        #: When set, ``finish`` adds each group's captured energy per basis column to
        #: :attr:`spectrum` (the budget controller's measured error curves): per shape
        #: ``[Σ‖M‖², Σ column energies, steps]`` as float64 / int64 tensors on the device.
        self.track_spectrum = False
        self.spectrum: dict[tuple[int, int], list] = {}
        self.dense_indices: list[int] = []
        #: float ``[1]`` on the device: the loss scale of the step about to run (the loss
        #: scaler's, fp16), set by the driver before each step; None without a scaler
        self.loss_scale: Optional[torch.Tensor] = None
        self._plan()

    @property
    def groups(self) -> dict:
        """Group key -> :class:`ShapeGroup` (the state's)."""
        return self.state.groups

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
        self.state.regroup(groups)   # Q and E move with their matrices
        self.dense_indices = dense

    def set_rank(self, rank: int, shape_ranks: Optional[dict] = None) -> None:
        """Change the rank (``shape_ranks``: per matrix shape ``(n, m)``, overriding
        ``rank``): each matrix's ``E`` moves with it (to the pending residuals where it
        goes dense), ``Q`` loses trailing columns or gains seeded ones
        (:meth:`UnitState.regroup`, :meth:`UnitState.resize_warm_starts`)."""
        shape_ranks = {tuple(k): int(v) for k, v in (shape_ranks or {}).items()}
        if rank < 1 or any(v < 1 for v in shape_ranks.values()):
            raise ValueError(f"rank must be >= 1, got {rank}, {shape_ranks}")
        if rank == self.rank and shape_ranks == self.shape_ranks:
            return
        self.rank = rank
        self.shape_ranks = shape_ranks
        self._plan()
        self.state.resize_warm_starts(self._rank_for, self._seeded)

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
        self.after_step(applied=True)

    def local_factors(self, grads: Sequence[torch.Tensor]) -> Step:
        """One rank's step with no collective, up to its factors (the pipeline's sender:
        its receiver rebuilds the product): per group ``step.p_hat``, ``step.q_local`` and
        ``step.kept``, the residuals taken, the local factor the warm start where it was
        finite, the step settled as applied at once."""
        bufs, step = self.start(grads)
        self.middle(step, bufs, pack=False)
        for key, g in self.groups.items():
            self.state.next_warm_start(g, step.q_local[key], step.kept[key])
        self.after_step(applied=True)
        return step

    # ------------------------------------------------------------------ sizes

    def _factor_size(self) -> int:
        return dtype_bytes(self.factor_dtype)

    def wire_bytes(self) -> list:
        """Bytes of every collective on the compressed group (DP, or across instances),
        in the order the step issues them (the bypass prices each one's latency)."""
        return [b for phase in self.phase_bytes() for b in phase]

    def state_bytes(self) -> int:
        """What stays between steps: residuals (``ef_dtype``) and warm-start Q (fp32)."""
        ef = dtype_bytes(self.ef_dtype)
        return sum(len(g.indices) * (g.n * g.m * ef + self._q_shape(g)[0] * self._rank_for(g) * 4)
                   for g in self.groups.values())

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
        self.state.init_group(g, to_device(self._seeded(g, "init", self._rank_for(g)), device),
                              self.ef_dtype)

    def _new_step(self, grads: Sequence[torch.Tensor]) -> Step:
        """A step over ``grads``, every group's state allocated (:meth:`prepare` did it,
        unless the caller drives the compressor itself)."""
        assert len(grads) == len(self.entries)
        self.state.begin(self.loss_scale)
        if any(g.q is None for g in self.groups.values()):
            self.prepare(grads[0].device if grads else self.device)
        return Step(grads=list(grads))

    def _take_residuals(self, step: Step, nonfinite: torch.Tensor, transposed: bool) -> list:
        """Every group's second product and residual, in one pass over its ``M``
        (:meth:`ErrorFeedback.project_and_take`; ``transposed``: the basis ``P^`` is on the
        rows' side, the product ``Mᵀ P^``), ``E`` kept where ``nonfinite`` (what the step
        received) or the matrix's own factor as sent is not finite; what the message
        carries recorded with the state until the step's outcome. Returns the local
        factors as sent, flat, for the wire."""
        wire = []
        for key, g in self.groups.items():
            p_hat = step.p_hat[key]
            step.q_local[key], sent, step.kept[key], step.energy[key] = \
                self.ef.project_and_take(g, step.views[key], p_hat, transposed, nonfinite,
                                         self.factor_dtype, energy=self.track_spectrum)
            self.state.carried_factors(g, step.kept[key], *((p_hat, sent) if transposed
                                                            else (sent, p_hat)))
            wire.append(sent.view(-1))
        return wire

    def _write_results(self, step: Step, q_buf: torch.Tensor, nonfinite: torch.Tensor,
                       transposed: bool) -> None:
        """After the second collective: every group's ``P^ (ΣQ)ᵀ`` (or ``ΣQ P^ᵀ``) written
        over its gradients and ``ΣQ`` into its warm start (kept where ``nonfinite``: the summed
        factors are NaN there), the measured spectrum added."""
        shapes = [(len(g.indices), g.m if transposed else g.n, self._rank_for(g))
                  for g in self.groups.values()]
        for (key, g), q in zip(self.groups.items(), split_factors(q_buf, shapes, nonfinite)):
            p_hat = step.p_hat[key]
            self.ef.write_result(g, step.views[key], (p_hat, q) if transposed else (q, p_hat))
            self.state.next_warm_start(g, q, nonfinite)
            if self.track_spectrum:
                self._add_spectrum((g.full_n, g.m), step.energy[key], step.q_local[key], nonfinite)
            step.views[key] = None

    def after_step(self, applied: bool) -> None:
        """The optimizer applied this step's gradients (``applied``), or did not (a skip: an
        fp16 overflow, a non-finite gradient norm): :meth:`UnitState.settle`, the one rule
        (docs/reliability.md). A caller that drives the compressor without an optimizer
        reports ``applied=True`` itself; an outcome never reported is not applied."""
        self.state.settle(applied)

    def _dense_parts(self, grads: Sequence[torch.Tensor]) -> list:
        """The uncompressed gradients, flat in the dense wire dtype, a matrix's pending
        residual carried once it fell back to dense (kept until the step is applied)."""
        for i in self.dense_indices:
            self._carry_pending(i, grads[i])
        return [(run if run.dim() == 1 else run.reshape(-1)).to(self.dense_dtype)
                for run in flat_runs([grads[i] for i in self.dense_indices])]

    def _carry_pending(self, i: int, grad: torch.Tensor, scale: float = 1.0) -> None:
        """A matrix's pending residual added into its gradient in this step's units
        (``scale``: a further factor), recorded as carried by the message. Scaled in its
        own dtype and rounded once into the gradient's: ``E`` is kept net of the loss
        scale, so cast first into fp16 it would fall into subnormals (issue 81)."""
        name = self.entries[i][0]
        if name in self.state.pending:
            self.ef.add_residual(grad, self.state.pending[name].view_as(grad), alpha=scale)
            self.state.carried_pending(name)

    def _add_spectrum(self, key, total: torch.Tensor, q_local: torch.Tensor,
                      nonfinite: torch.Tensor) -> None:
        """Accumulate ``[Σ‖M‖², Σ_k sorted column energies of the local factor, steps]``
        for one group, on the device (``total``: ``Σ‖M‖²`` in float64; a step whose
        ``nonfinite`` flag is set adds 0).

        The shared factor is orthonormal, so column ``j`` of the local factor carries
        exactly the energy the step captures in direction ``j``, and ``‖M‖² − Σ_j`` of
        them is ``‖E‖²``. Sorted per matrix, the first ``r'`` of them are the energy the
        best ``r'`` columns of this basis would keep: a measured error curve for every
        rank up to the current one, at the cost of one pass over the factor.
        """
        cols = (q_local.float() ** 2).sum(dim=1).sort(dim=1, descending=True).values.sum(0)
        good = nonfinite.logical_not().view(())
        total, cols = torch.where(good, total, 0.0), torch.where(good, cols.double(), 0.0)
        entry = self.spectrum.get(key)
        if entry is None or entry[1].numel() != cols.numel():
            self.spectrum[key] = [total, cols, good.long()]
        else:
            entry[0] = entry[0] + total
            entry[1] = entry[1] + cols
            entry[2] = entry[2] + good.long()

    def absorb_residual(self, grads: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        """Before a dense sync of this bucket: add every residual (and pending one) into
        its gradient, in this step's loss-scale units — the dense message carries the
        whole error, nothing is lost; :meth:`UnitState.settle` zeroes them once the step
        is applied (otherwise they are kept). The warm-start Q is kept for the next
        compressed step. ``scale``: the residuals' factor into the gradients' units (a
        sync that scales after this passes the inverse)."""
        assert len(grads) == len(self.entries)
        if not self.state.begin(self.loss_scale, dense=True):
            return
        for g in self.groups.values():
            if g.residual is None:
                continue
            views = self.ef.views(g, grads)
            self.ef.form(g, views, alpha=scale)
            for _, _, m, target in self.ef.blocks(g, views, alpha=scale):
                if target is not None:
                    target.copy_(m)
        self.state.carried_residuals()
        for i in range(len(self.entries)):
            self._carry_pending(i, grads[i], scale)

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        out = {"rank": self.rank, **self.state.state_dict(),
               "shape_ranks": [[n, m, r] for (n, m), r in sorted(self.shape_ranks.items())]}
        # the window's measured column energies so far (a mid-window checkpoint resumes them)
        out["spectrum"] = [[n, m, float(total), cols.cpu().clone(), int(count)]
                           for (n, m), (total, cols, count) in sorted(self.spectrum.items())]
        return out

    def load_state_dict(self, state: dict, device=None) -> list:
        """Restore on ``device`` (default: the compressor's), whatever device the state
        was mapped to; returns the names whose saved state did not fit (reset to fresh)."""
        shape_ranks = {(n, m): r for n, m, r in state.get("shape_ranks", [])}
        self.set_rank(state["rank"], shape_ranks)
        dev = device if device is not None else self.device
        mismatched = self.state.load_state_dict(state, self._q_shape, dev, self.ef_dtype)
        self.spectrum = {(n, m): [torch.tensor(total, dtype=torch.float64, device=dev),
                                  cols.to(dev, torch.float64, copy=True),
                                  torch.tensor(count, dtype=torch.int64, device=dev)]
                         for n, m, total, cols, count in state.get("spectrum", [])}
        return mismatched
