"""The PowerSGD step's kernels, written once for the flat, the slow-hop and the pipeline
compressors (docs/method.md §1): the error feedback ``M = G + s E`` (:class:`ErrorFeedback`,
slice by slice in fp32 from a low-precision buffer), the products over a shape group's
strided runs, the second product with the residual taken in the same pass under the
message's non-finite rule (:meth:`ErrorFeedback.project_and_take`), the packing and
byte counts of a phase (:class:`WireLayout`), the decompression and the dense rest copied
back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_edgc.compression.matrices import run_view, strided_runs


@dataclass
class ShapeGroup:
    """All compressed matrices of one shape in a bucket, batched."""

    n: int
    m: int
    indices: list  # positions in the bucket's entry list
    names: list
    #: the rows of the whole matrix each entry is a row block of (a shard's row blocks);
    #: ``n`` for whole matrices. The rank and the compressibility follow the whole matrix.
    full_n: int = 0
    #: the names the warm start is seeded by (the whole matrices'); ``names`` when empty
    seed_names: list = field(default_factory=list)
    q: Optional[torch.Tensor] = None          # [k, m, r] warm start ([k, n, r] on a shard)
    residual: Optional[torch.Tensor] = None   # [k, n, m] error feedback (ef_dtype)
    runs_key: Optional[tuple] = None          # the gradient addresses the runs were made for
    runs: Optional[list] = None               # strided_runs() of those addresses


@dataclass
class Step:
    """What travels from a compressor's ``start`` to its ``finish`` within one step."""

    grads: list
    views: dict = field(default_factory=dict)  # group key -> [(lo, hi, gradients view), ...]
    p_hat: dict = field(default_factory=dict)  # group key -> orthonormal shared factor
    q_local: dict = field(default_factory=dict)  # group key -> this rank's other factor
    kept: dict = field(default_factory=dict)     # group key -> bool [k,1,1]: E kept as it was
    nonfinite: Optional[torch.Tensor] = None     # bool [1] on the device: some rank's flag
    #: float [1] on the device: the summed P finite, the matrices whose orthonormal basis
    #: stood in for a failed factorization or came out non-finite (the same on every
    #: rank: P^ is computed alike everywhere from the same sum)
    factor_failure: Optional[torch.Tensor] = None
    dense: list = field(default_factory=list)    # the dense rest, flat (the slow hop)
    energy: dict = field(default_factory=dict)   # group key -> Σ‖M‖² (the spectrum's)

    def flags(self) -> torch.Tensor:
        """float ``[2]`` on the device, after the step: whether it was left non-finite (1:
        its gradients NaN, the compressor's state kept), and how many matrices' factors
        failed from finite gradients (a stand-in basis, or a non-finite one)."""
        return torch.cat([self.nonfinite.view(1).float(), self.factor_failure.view(1)])


def all_finite(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """bool on the device: every element of ``x`` (floating point) is finite, or, with
    ``dim``, every element along it (``x.shape`` without ``dim``). One reduction: a NaN
    or an infinity reaches ``aminmax``'s minimum or maximum (on the host along ``dim``,
    ``amin`` and ``amax``: ``aminmax`` along a dimension ran 16x ``amax``'s time on
    this Xeon); ``isfinite(x).all()`` makes three elementwise passes and a bool
    temporary (on a CPU 12x the time on a [8192, 32] factor). The extremes are then
    tested by ``(lo - lo) + (hi - hi) == 0``: ``v - v`` is 0 for a finite ``v`` and NaN
    for an infinity or a NaN, and never overflows (four calls; ``isfinite`` of each is
    nine). Empty: True."""
    if x.numel() == 0:
        shape = () if dim is None else x.shape[:dim] + x.shape[dim + 1:]
        return torch.ones(shape, dtype=torch.bool, device=x.device)
    if dim is None:
        lo, hi = torch.aminmax(x)
    elif x.device.type == "cpu":
        lo, hi = torch.amin(x, dim=dim), torch.amax(x, dim=dim)
    else:
        lo, hi = torch.aminmax(x, dim=dim)
    return (lo - lo).add_(hi - hi).eq(0)


#: The widest element :func:`select` reads and writes a row of fp32 (or narrower) values
#: by: 16 bytes, the same bits (a selection copies, it does no arithmetic).
_WIDE = torch.complex128


def _as_wide(x: torch.Tensor) -> Optional[torch.Tensor]:
    """``x`` viewed as :data:`_WIDE` (its last dimension 16 bytes per element, the same
    memory), or None where its layout does not allow it."""
    q = 16 // x.element_size()
    if x.dim() == 0 or 16 % x.element_size() or x.size(-1) % q or x.stride(-1) != 1 or \
            x.storage_offset() % q or any(s % q for s in x.stride()[:-1]):
        return None
    return x.view(_WIDE)


def select(keep: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.where(keep, a, b)`` (into ``out`` when given), bit for bit, for a ``keep``
    that is one flag per row (its last dimension 1: a matrix's, ``[k, 1, 1]``). On the
    host the rows are selected as 16-byte elements (:data:`_WIDE` views of the same
    memory, where every layout allows): CPU ``where`` does not vectorize, and a quarter
    of the elements ran at a copy's speed (0.31 against 0.71 ms on 1 M fp32 elements on
    this Xeon). Elsewhere, or for other layouts, ``torch.where`` itself."""
    if a.device.type == "cpu" and keep.dim() and keep.size(-1) == 1 and a.dtype == b.dtype \
            and (out is None or out.dtype == a.dtype):
        in_place = out is not None and out.data_ptr() == a.data_ptr() and \
            out.shape == a.shape and out.stride() == a.stride()
        wide = [_as_wide(t) for t in (a, b) + (() if out is None or in_place else (out,))]
        if all(w is not None for w in wide):
            if out is None:
                return torch.where(keep, wide[0], wide[1]).view(a.dtype)
            torch.where(keep, wide[0], wide[1], out=wide[0] if in_place else wide[2])
            return out
    return torch.where(keep, a, b) if out is None else torch.where(keep, a, b, out=out)


def factor_failure(p: torch.Tensor, p_hats: Sequence[torch.Tensor],
                   stood_in: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """float ``[1]``, on the device: where ``p`` (the summed factor) is finite, how many
    matrices' orthonormal bases stood in for a failed factorization (``stood_in``:
    :func:`~megatron_edgc.compression.orthonormal.orthonormalize`'s), plus one per basis
    that came out non-finite all the same; 0 where ``p`` is not finite."""
    nonfinite = [all_finite(h).logical_not().float() for h in p_hats] + \
        [s.float().sum() for s in stood_in]
    if not nonfinite:
        return torch.zeros(1, device=p.device)
    return (all_finite(p).float() * torch.stack(nonfinite).sum()).view(1)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``: pinned and non-blocking to a GPU (the copy does not
    wait for the host)."""
    if device is None or torch.device(device).type != "cuda":
        return host if device is None else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


#: the host's reusable fp32 workspace per device (see :func:`scratch`)
_HOST_SCRATCH: dict = {}


def scratch(numel: int, device: torch.device) -> torch.Tensor:
    """An fp32 ``[numel]`` workspace whose contents are the caller's until its next call.
    On a GPU a new tensor: the caching allocator hands back the block freed by the last
    slice, on the right stream. On the host one buffer per device, kept: glibc returns a
    large freed block to the kernel, so each new slice would fault its pages in again
    (a 64 MiB cast cost 12x the cast into a kept buffer on an AMD EPYC). A step runs on
    one host thread, so one buffer serves every compressor of the process."""
    if device.type == "cuda":
        return torch.empty(numel, device=device)
    buf = _HOST_SCRATCH.get(device)
    if buf is None or buf.numel() < numel:
        buf = _HOST_SCRATCH[device] = torch.empty(numel, device=device)
    return buf[:numel]


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


@dataclass(frozen=True)
class WireLayout:
    """The buffers of one phase: ``[factors | dense | flag]`` in one collective where the
    factors and the dense rest travel in one dtype, else ``[factors]`` (factor dtype) and
    ``[dense | flag]`` (dense dtype), either absent when empty (the flag then rides with
    the factors: it sums exactly in bf16 up to 256, and stays above 0 beyond). ``flag=False``:
    no flag slot (the flat step's ``Q`` phase)."""

    factors: int
    dense: int
    factor_dtype: torch.dtype
    flag: bool = True
    dense_dtype: torch.dtype = torch.float32

    @property
    def _one_buffer(self) -> bool:
        return self.factor_dtype == self.dense_dtype or not self.dense

    def buffers(self) -> list:
        """``[(numel, dtype)]`` of each buffer, in the order :meth:`pack` returns them."""
        f = int(self.flag)
        if self._one_buffer:
            total = self.factors + self.dense + f
            dtype = self.factor_dtype if self.factors or not self.dense else self.dense_dtype
            return [(total, dtype)] if total else []
        return ([(self.factors, self.factor_dtype)] if self.factors else []) + \
            [(self.dense + f, self.dense_dtype)]

    def bytes(self) -> list:
        """Bytes of each collective of the phase (what :meth:`pack` puts on the wire)."""
        return [numel * dtype_bytes(dtype) for numel, dtype in self.buffers()]

    def pack(self, factor_parts: list, dense_parts: list, device,
             also_nonfinite: Optional[torch.Tensor] = None) -> list:
        """The phase's buffers from flat parts; the flag is 1 where a payload (after the
        cast to its wire dtype, which may overflow) is non-finite, or where
        ``also_nonfinite`` is set. Decided on the device."""
        factor_parts = [part.to(self.factor_dtype) for part in factor_parts]
        if not self.flag:
            return [torch.cat(factor_parts)] if self.factors else []
        shapes = self.buffers()
        flag = torch.zeros(1, device=device, dtype=shapes[-1][1])
        dense_parts = [part.to(self.dense_dtype) for part in dense_parts]
        if self._one_buffer:
            dtype = shapes[0][1]
            bufs = [torch.cat([p.to(dtype) for p in factor_parts + dense_parts] + [flag])]
        else:
            bufs = ([torch.cat(factor_parts)] if factor_parts else []) + \
                [torch.cat(dense_parts + [flag])]
        payloads = bufs[:-1] + [bufs[-1][:-1]]
        finite = torch.stack([all_finite(b) for b in payloads]).all()
        if also_nonfinite is not None:
            finite = finite & also_nonfinite.logical_not()
        bufs[-1][-1] = finite.logical_not()
        return bufs

    def unpack(self, reduced: Sequence[torch.Tensor]) -> tuple:
        """``(factors, dense, nonfinite)`` of the summed buffers: flat views (``dense``
        empty where there is none) and a bool ``[1]`` (None without a flag slot)."""
        assert [b.numel() for b in reduced] == [n for n, _ in self.buffers()]
        if not reduced:
            return torch.empty(0), torch.empty(0), None
        first, last = reduced[0], reduced[-1]
        factors = first[:self.factors]
        if self._one_buffer:
            dense = first[self.factors:self.factors + self.dense]
        else:
            dense = last[:self.dense]
        return factors, dense, (last[-1:] > 0) if self.flag else None


def split_factors(buf: torch.Tensor, shapes: Sequence[tuple],
                  nonfinite: Optional[torch.Tensor] = None) -> list:
    """The per-group ``[k, rows, r]`` fp32 factors of a summed flat buffer (``shapes``:
    ``(k, rows, r)`` in order); where ``nonfinite`` is set each is a new tensor of NaN."""
    out, offset = [], 0
    for k, rows, r in shapes:
        x = buf[offset:offset + k * rows * r].view(k, rows, r).float()
        offset += k * rows * r
        out.append(x if nonfinite is None else x.masked_fill(nonfinite, float("nan")))
    assert offset == buf.numel()
    return out


def flat_runs(tensors: Sequence[torch.Tensor]) -> list:
    """``tensors`` in order, each run of them that lies back to back in one buffer
    (contiguous, one dtype, each starting where the one before ends: megatron-core's
    bucket lays a layer's biases and norms so) as one flat view: one call per run where
    each tensor was one (the race's bucket: 34 dense tensors in 17 runs). A tensor that is
    not contiguous is a run of its own, as it is (not flat). Host arithmetic on
    addresses, no copy, no sync."""
    runs: list = []
    for t in tensors:
        contiguous = t.is_contiguous()
        if runs and contiguous:
            head, numel = runs[-1]
            if head.is_contiguous() and t.dtype == head.dtype and t.device == head.device \
                    and t.data_ptr() == head.data_ptr() + numel * head.element_size() and \
                    t.untyped_storage().data_ptr() == head.untyped_storage().data_ptr():
                runs[-1] = (head, numel + t.numel())
                continue
        runs.append((t, t.numel()))
    return [head if not head.is_contiguous() else head.view(-1) if numel == head.numel()
            else head.as_strided((numel,), (1,), head.storage_offset()) for head, numel in runs]


def copy_dense_back(grads: Sequence[torch.Tensor], dense_indices: Sequence[int],
                    dense: torch.Tensor) -> None:
    """The summed dense rest into its gradients, in order (one copy per :func:`flat_runs`
    run)."""
    offset = 0
    for run in flat_runs([grads[i] for i in dense_indices]):
        part = dense[offset:offset + run.numel()]
        run.copy_(part if run.dim() == 1 else part.view_as(run))
        offset += run.numel()
    assert offset == dense.numel()


class ErrorFeedback:
    """Error feedback in the gradient buffer, and the products and the end of a step that
    read ``M`` through it: ``M = G + s·E`` read, ``E = (M - A Bᵀ) / s`` taken (``E`` net
    of the loss scale ``s``; docs/method.md §1). fp32 buffers hold ``M`` from :meth:`form`
    to :meth:`project_and_take`, then the residual until :meth:`write_result`; bf16 and
    fp16 buffers keep ``G``, and :meth:`blocks` forms ``M`` in fp32 per slice of the kept
    workspace (:func:`scratch`), once per product; a residual in another dtype is cast
    per slice likewise.
    """

    def __init__(self, ef_dtype: torch.dtype, workspace_bytes: int):
        #: the unit whose rules this pass applies (its :class:`~megatron_edgc.compression.
        #: unit_state.UnitState` sets itself): which matrices keep ``E``, and how it is stored
        self.rule = None
        self.ef_dtype = ef_dtype
        self.workspace_bytes = workspace_bytes
        #: this step's loss scale, float ``[1]`` on the device (None: no scaler, 1), and
        #: its inverse, the factor a residual is taken with (set by the unit's ``begin``)
        self.scale: Optional[torch.Tensor] = None
        self.inv_scale: Optional[torch.Tensor] = None

    def begin(self, loss_scale: Optional[torch.Tensor]) -> None:
        """A step at ``loss_scale`` (float ``[1]`` on the device; None without a scaler):
        ``E`` is read as ``s·E`` and taken as ``(M - A Bᵀ)/s``. A device division, no host
        read."""
        self.scale = loss_scale
        self.inv_scale = None if loss_scale is None else loss_scale.reciprocal()

    def add_residual(self, out: torch.Tensor, residual: torch.Tensor,
                     alpha: float = 1.0) -> None:
        """``out += alpha · s · E`` in this step's units: one pass, no temporary
        (``addcmul`` with the device scale)."""
        if self.scale is None:
            out.add_(residual, alpha=alpha)
        else:
            out.addcmul_(residual, self.scale if alpha == 1.0 else self.scale * alpha)

    @staticmethod
    def views(g: ShapeGroup, grads: Sequence[torch.Tensor]) -> list:
        """``[(lo, hi, view [hi - lo, n, m])...]``: the group's gradients as strided views
        of their buffer, in the gradients' dtype (a matrix that is not contiguous is a run
        of its own, ``[1, n, m]``). No copy."""
        mats = [grads[i] for i in g.indices]
        if not all(t.is_contiguous() for t in mats):
            return [(j, j + 1, t.unsqueeze(0)) for j, t in enumerate(mats)]
        key = tuple(t.data_ptr() for t in mats)
        if key != g.runs_key:
            g.runs_key, g.runs = key, strided_runs(mats, g.n, g.m)
        return [(lo, hi, run_view(mats[lo], hi - lo, step, g.n, g.m))
                for lo, hi, step in g.runs]

    def temporaries(self, device: torch.device) -> int:
        """fp32 temporaries the residual's dtype adds per slice (a cast copy, a result),
        counted twice: slices take half the workspace, the rest is the allocator's slack
        (at a full workspace the peak crossed the bound in 1 run of 6). None for an fp32
        residual, nor on CUDA, whose elementwise kernels cast a bf16 input as they read it
        (CPU kernels cast it into a copy first): there a run is one slice, not a loop of
        slices (the H200's bf16 finish ran at 5.2x its floor, against 2.7x in fp32)."""
        return 0 if self.ef_dtype == torch.float32 or device.type == "cuda" else 4

    def slices(self, lo: int, hi: int, g: ShapeGroup, temporaries: int) -> list:
        """``[(lo, hi)]`` covering a run: the whole run when nothing needs an fp32
        temporary (``temporaries=0``); otherwise slices whose ``temporaries`` fp32 copies
        stay within the workspace (one matrix is the least a slice holds)."""
        if not temporaries:
            return [(lo, hi)]
        per = max(1, self.workspace_bytes // (temporaries * g.n * g.m * 4))
        return [(a, min(a + per, hi)) for a in range(lo, hi, per)]

    def form(self, g: ShapeGroup, views: list, alpha: float = 1.0) -> None:
        """``G += alpha · E`` in the fp32 runs; runs in another dtype keep ``G``."""
        for lo, hi, view in views:
            if view.dtype == torch.float32:
                for a, b in self.slices(lo, hi, g, self.temporaries(view.device)):
                    self.add_residual(view[a - lo:b - lo], g.residual[a:b], alpha)

    def _fp32_blocks(self, g: ShapeGroup, views: list, temporaries: int):
        """``(a, b, out, target)`` over the group: an fp32 run is its own ``out`` (``target``
        None); a run in another dtype gives fp32 slices of :func:`scratch` (``out``,
        uninitialized, valid until the next block) beside ``target``, its slice of the
        gradients, with ``temporaries`` fp32 copies of a slice within the workspace."""
        for lo, hi, view in views:
            if view.dtype == torch.float32:
                yield lo, hi, view, None
                continue
            for a, b in self.slices(lo, hi, g, temporaries):
                target = view[a - lo:b - lo]
                yield a, b, scratch(target.numel(), view.device).view(target.shape), target

    def blocks(self, g: ShapeGroup, views: list, alpha: float = 1.0):
        """``(a, b, M, target)``: ``M`` ([b - a, n, m], fp32) of matrices ``a..b``; an fp32
        run holds ``M`` itself (``target`` None), another dtype gives ``M = float(G) + E``
        per slice (in :func:`scratch`, valid until the next block) and ``target``, its
        slice of the gradients. Each product forms it again instead of holding a copy of
        the gradients."""
        temporaries = 4 + self.temporaries(g.residual.device)
        for a, b, m, target in self._fp32_blocks(g, views, temporaries):
            if target is not None:
                self.add_residual(m.copy_(target), g.residual[a:b], alpha)
            yield a, b, m, target

    def project(self, g: ShapeGroup, views: list, basis: torch.Tensor,
                transposed: bool) -> torch.Tensor:
        """``M B`` (``transposed=False``, ``[k, n, r]``) or ``Mᵀ B`` (``[k, m, r]``) of
        every matrix of the group, one ``bmm`` per run into one output."""
        rows = g.m if transposed else g.n
        out = torch.empty(len(g.indices), rows, basis.shape[2], device=basis.device)
        for a, b, m, _ in self.blocks(g, views):
            torch.bmm(m.transpose(1, 2) if transposed else m, basis[a:b], out=out[a:b])
        return out

    def project_and_take(self, g: ShapeGroup, views: list, basis: torch.Tensor,
                         transposed: bool, nonfinite: torch.Tensor, factor_dtype: torch.dtype,
                         energy: bool = False) -> tuple:
        """The second product and the residual in one pass over ``M``: per block the local
        factor ``L`` (``Mᵀ B``, ``[k, m, r]``, where ``transposed``; else ``M B``), ``L``
        rounded to ``factor_dtype`` as it goes on the wire, then the residual against the
        rounded factor (``E = (M - B Lᵀ)/s``, or ``(M - L Bᵀ)/s``). ``M`` is read for the
        last time here: a low-precision buffer forms it twice per step, not three times,
        and its end (:meth:`write_result`) forms it no more.

        The message's non-finite rule is the unit's (:attr:`rule`,
        :meth:`~megatron_edgc.compression.unit_state.UnitState.keeps`), applied in this
        pass. Returns ``(L, L as sent (fp32, rounded),
        kept, Σ‖M‖²)``: ``kept`` bool ``[k, 1, 1]`` on the device, the energy in float64,
        read before ``M`` becomes the residual (None without ``energy``)."""
        rows = g.m if transposed else g.n
        k = len(g.indices)
        local = torch.empty(k, rows, basis.shape[2], device=basis.device)
        sent = local if factor_dtype == torch.float32 else torch.empty_like(local)
        kept = torch.empty(k, 1, 1, dtype=torch.bool, device=basis.device)
        total = None
        for a, b, m, target in self.blocks(g, views):
            if energy:
                part = torch.linalg.vector_norm(m).double() ** 2
                total = part if total is None else total + part
            torch.bmm(m.transpose(1, 2) if transposed else m, basis[a:b], out=local[a:b])
            if sent is not local:
                sent[a:b].copy_(local[a:b].to(factor_dtype))
            self.rule.keeps(sent[a:b], nonfinite, out=kept[a:b])
            outer = (basis[a:b], sent[a:b]) if transposed else (sent[a:b], basis[a:b])
            self._take_block(g, a, b, m, target, kept[a:b], outer)
        return local, sent, kept, total

    def _take_block(self, g: ShapeGroup, lo: int, hi: int, m: torch.Tensor, target,
                    kept: torch.Tensor, outer: tuple) -> None:
        """``M -= A Bᵀ`` (then ``/= s``) in the block's ``M`` (an fp32 buffer's run: the
        gradients then hold the residual until :meth:`write_result`), selected into
        ``E[lo:hi]`` by the unit's rule (:meth:`UnitState.store`) where ``kept`` is not set."""
        m.baddbmm_(outer[0], outer[1].transpose(1, 2), alpha=-1)
        if self.inv_scale is not None:
            m.mul_(self.inv_scale)
        temps = self.temporaries(m.device) if target is None else 0
        for a, b in self.slices(lo, hi, g, temps):
            self.rule.store(g, a, b, m[a - lo:b - lo], kept[a - lo:b - lo])

    def write_result(self, g: ShapeGroup, views: list, result: tuple) -> None:
        """``C Dᵀ`` (``(C, D) = result``) written over the group's gradients: in place in an
        fp32 run, through fp32 slices of the workspace into another dtype (its one
        rounding). ``M`` is not formed: the residual was taken in
        :meth:`project_and_take`."""
        c, d = result
        for a, b, out, target in self._fp32_blocks(g, views, 4):
            out.baddbmm_(c[a:b], d[a:b].transpose(1, 2), beta=0)
            if target is not None:
                target.copy_(out)


def resized_warm_start(q: torch.Tensor, rank: int, seeded) -> torch.Tensor:
    """A warm start ``[k, rows, r]`` at another rank: trailing columns dropped, or seeded
    ones appended (``seeded(tag, cols)`` gives ``[k, rows, cols]`` on the host, the same on
    every rank; tag ``grow{r}-{rank}``), so a rank change keeps what was learnt."""
    r_old = q.shape[2]
    if rank < r_old:
        return q[:, :, :rank].contiguous()
    if rank > r_old:
        extra = to_device(seeded(f"grow{r_old}-{rank}", rank - r_old), q.device)
        return torch.cat([q, extra], dim=2)
    return q
