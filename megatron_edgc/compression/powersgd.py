"""PowerSGD low-rank compression with error feedback (EDGC §1; Vogels et al., NeurIPS 2019).

Pure tensors in and out: a :class:`BucketCompressor` turns one gradient bucket into the
buffers a data-parallel all-reduce (SUM) must carry and rebuilds the gradient from the
reduced buffers. Whoever drives it owns the collectives (``patches/ddp.py`` on the real DP
group; the tests simulate DP ranks in one process).

One step for a bucket, on every DP rank ``i``::

    G_i += E_i                          error feedback, formed in place: the gradient
                                        buffer holds M_i = G_i + E_i for the step
    P_i  = M_i Q                        Q warm-started; first Q a seeded Gaussian, same on all
    [P | dense | flag]  --SUM-->        one collective: all P of the bucket, the
                                        uncompressed rest (biases, norms, small matrices)
                                        and a non-finite flag
    P^   = orth(sum P)                  batched CholeskyQR3 in fp32 (:func:`orthonormalize`)
    Q_i  = M_i^T P^
    [Q]  --SUM-->                       one collective: all Q of the bucket
    E_i  = M_i - P^ Q_i^T               what the shared basis missed of this rank's M_i
    G_i  = P^ (sum Q)^T                 ≈ sum_i M_i, identical on every rank
    Q    = sum Q                        warm start for the next step

Memory: the step makes no copy of the gradients. ``M`` is formed in the gradient buffer
(which the step overwrites anyway), ``E`` is only read until the end, where the new
residual is computed in the gradient buffer and selected into ``E``; then ``P^ Qᵀ`` is
written over it. The matrices of a shape group are addressed as strided ``[k, n, m]``
views of the gradient buffer (:func:`strided_runs`: equally spaced matrices, as in
Megatron's buffer where every layer has the same layout, make one view), so every product
is one batched call per shape group, with no ``[k, n, m]`` temporary. What a step
allocates is the factors (``P``, ``P^``, ``Q``: ``k (n + m) r`` each), the collective
buffers and ``[k, r, r]`` Gram matrices (``tests/test_powersgd.py`` measures it).

Gradients in bf16 (``--grad-reduce-in-bf16``) keep ``G`` in their buffer until the end:
each phase forms ``M = float(G) + E`` in fp32 slices of at most :attr:`workspace_bytes`,
so the products and the residual are the fp32 ones and only the result written back is
rounded to bf16. Conservation then holds to that one rounding: ``Σ_i E_i + Ĝ = Σ_i M_i``
up to ``|Ĝ - M^| <= 2⁻⁸ |M^|`` element-wise (bf16's unit roundoff; fp32 rounding apart).

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
the residual is kept in bf16 (half the state; its rounding is not fed back). A matrix is compressed at
rank ``r`` only when ``min(n, m) > r`` and ``(n + m) r · min_rate <= n m``; it then sends
``(n + m) r`` instead of ``n m`` elements.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

FLOAT_BYTES = 4  # P, Q and the packed dense part travel in fp32 (by default)
FACTOR_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def is_compressible(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """EDGC §1's rule: low rank really is lower, and pays at least ``min_compression_rate``."""
    return min(n, m) > rank and (n + m) * rank * min_compression_rate <= n * m


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix view of a gradient: ``(shape[0], numel / shape[0])``; vectors are 1 x n."""
    if len(shape) < 2:
        n = 1
        for s in shape:
            n *= s
        return (1, n)
    m = 1
    for s in shape[1:]:
        m *= s
    return (shape[0], m)


def seeded_gaussian(seed: int, name: str, tag: str, rows: int, cols: int) -> torch.Tensor:
    """A Gaussian (rows x cols) that depends only on (seed, name, tag): equal on all ranks."""
    digest = hashlib.sha256(f"{seed}/{name}/{tag}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randn(rows, cols, generator=gen, dtype=torch.float32)


#: The diagonal shift of the first two CholeskyQR passes, relative to a unit column.
GRAM_SHIFT = 1e-5
#: What :func:`orthonormalize` guarantees: ``max |P^ᵀ P^ - I| <= ORTHOGONALITY_BOUND`` for
#: every finite ``P`` (zero, rank-deficient, condition numbers up to 1e7; tested).
ORTHOGONALITY_BOUND = 1e-5

_FILLS: dict = {}


def orthonormal_fill(n: int, r: int, device) -> torch.Tensor:
    """A fixed ``[n, r]`` Gaussian with unit columns, the same on every rank (it depends
    only on ``(n, r)``); cached per device (``n r`` floats per shape)."""
    key = (n, r, str(device))
    fill = _FILLS.get(key)
    if fill is None:
        fill = seeded_gaussian(0, "orthonormal-fill", f"{n}x{r}", n, r)
        fill = (fill / torch.linalg.vector_norm(fill, dim=0, keepdim=True)).to(device)
        _FILLS[key] = fill
    return fill


class _IeeeFp32Matmul:
    """fp32 products without TF32 inside (a Gram matrix in TF32 loses the small singular
    values CholeskyQR depends on); restores the caller's setting. A host flag, no sync."""

    def __enter__(self):
        matmul = torch.backends.cuda.matmul
        self.new_api = hasattr(matmul, "fp32_precision")
        if self.new_api:
            self.saved = matmul.fp32_precision
            matmul.fp32_precision = "ieee"
        else:
            self.saved = matmul.allow_tf32
            matmul.allow_tf32 = False

    def __exit__(self, *exc):
        matmul = torch.backends.cuda.matmul
        if self.new_api:
            matmul.fp32_precision = self.saved
        else:
            matmul.allow_tf32 = self.saved


def _cholesky_qr_pass(x: torch.Tensor, eye: torch.Tensor, shift: float) -> torch.Tensor:
    """``x R⁻¹`` with ``RᵀR = xᵀx + shift·I``, batched: one Gram ``bmm``, a batched
    Cholesky (no error check: no host sync), ``R⁻¹`` from a triangular solve on
    ``[k, r, r]`` and one ``bmm`` to apply it."""
    gram = torch.bmm(x.transpose(1, 2), x)
    if shift:
        gram = gram + shift * eye
    lower = torch.linalg.cholesky_ex(gram).L
    lower_inv = torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False)
    return torch.bmm(x, lower_inv.transpose(1, 2))


def orthonormalize(p: torch.Tensor, fill: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` ([k, n, r] batched, or one [n, r]), in fp32.

    Batched shifted CholeskyQR3 (Fukaya et al., SISC 2020) with a null-space fill: no
    per-matrix loop, no ``torch.linalg.qr``, no host sync, no TF32, deterministic (every DP
    replica gets the same bits):

    1. each matrix is scaled by its largest element (no overflow in the norms), then each
       column to unit norm: a spectrum that decays from column to column (warm-started
       PowerSGD's ``P``) becomes well conditioned, and the span is unchanged;
    2. two CholeskyQR passes with a diagonal shift ``GRAM_SHIFT`` (the Cholesky succeeds
       whatever the conditioning): each maps a singular value ``σ`` to ``σ/√(σ²+s)``, so
       after two every direction of ``P`` above ~1e-5 of its norm has singular value
       ≈ 1 and the directions ``P`` lacks (zero columns, an all-zero ``P`` of a frozen
       weight, rank below ``r``) are near 0;
    3. the missing directions are filled: ``x += F (I - xᵀx)²`` with a fixed Gaussian
       ``F`` (:func:`orthonormal_fill`). ``(I - xᵀx)²`` is ~``s²`` on the directions ``P``
       has and ~1 on those it lacks, so the span is kept (to ~1e-10) and every missing
       direction gets a unit vector, as Householder QR gives zero columns;
    4. one unshifted CholeskyQR pass: orthogonal to ``ORTHOGONALITY_BOUND``.

    Flops: three Gram matrices and four ``[n, r] x [r, r]`` products, ``14 n r²`` per
    matrix against Householder's ``4 n r²``, small beside the step's ``8 n m r``.
    Non-finite input gives non-finite output (the step's non-finite flag handles it).
    """
    squeeze = p.dim() == 2
    x = p.float().unsqueeze(0) if squeeze else p.float()
    k, n, r = x.shape
    if fill is None:
        fill = orthonormal_fill(n, r, x.device)
    with _IeeeFp32Matmul():
        largest = x.abs().amax(dim=(1, 2), keepdim=True)
        x = x / largest.clamp_min(torch.finfo(torch.float32).tiny)
        columns = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        x = x / columns.clamp_min(1e-15)
        eye = torch.eye(r, device=x.device, dtype=x.dtype)
        x = _cholesky_qr_pass(x, eye, GRAM_SHIFT)
        x = _cholesky_qr_pass(x, eye, GRAM_SHIFT)
        missing = eye - torch.bmm(x.transpose(1, 2), x)
        missing = torch.bmm(missing, missing)  # ~s² on the directions P has, ~1 off them
        x = torch.baddbmm(x, fill.expand(k, n, r), missing)
        x = _cholesky_qr_pass(x, eye, 0.0)
    return x.squeeze(0) if squeeze else x


def strided_runs(mats: Sequence[torch.Tensor], n: int, m: int) -> list:
    """``[(lo, hi, step)]``: maximal runs of ``mats`` (fp32, contiguous ``n x m`` views of
    one storage) that sit at equal, increasing distances ``step`` (elements), each run
    addressable as one ``[hi - lo, n, m]`` view (:func:`run_view`). Host arithmetic on
    pointers only. Megatron's buffer gives one run per shape for a stack of equal layers."""
    runs = []
    lo, step = 0, None
    size = mats[0].element_size()
    for j in range(1, len(mats) + 1):
        if j < len(mats):
            prev, this = mats[j - 1], mats[j]
            gap = (this.data_ptr() - prev.data_ptr()) // size
            if (this.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
                    and gap >= n * m and step in (None, gap)):
                step = gap
                continue
        runs.append((lo, j, n * m if step is None else step))
        lo, step = j, None
    return runs


def run_view(first: torch.Tensor, count: int, step: int, n: int, m: int) -> torch.Tensor:
    """``count`` matrices ``n x m`` from ``first`` on, ``step`` elements apart, as a view."""
    return first.as_strided((count, n, m), (step, m, 1), first.storage_offset())


@dataclass
class ShapeGroup:
    """All compressed matrices of one shape in a bucket, batched."""

    n: int
    m: int
    indices: list  # positions in the bucket's entry list
    names: list
    #: the rows of the whole matrix each entry is a row block of (a shard's row blocks,
    #: :mod:`megatron_edgc.compression.shard_powersgd`); ``n`` for whole matrices. The rank
    #: and the compressibility follow the whole matrix.
    full_n: int = 0
    #: the names the warm start is seeded by (the whole matrices'); ``names`` when empty
    seed_names: list = field(default_factory=list)
    q: Optional[torch.Tensor] = None          # [k, m, r] warm start ([k, n, r]: shard_powersgd)
    residual: Optional[torch.Tensor] = None   # [k, n, m] error feedback (ef_dtype)
    runs_key: Optional[tuple] = None          # the gradient addresses the runs were made for
    runs: Optional[list] = None               # strided_runs() of those addresses


@dataclass
class _Step:
    """What travels from :meth:`start` to :meth:`finish` within one step."""

    grads: list
    views: dict = field(default_factory=dict)  # group key -> [(lo, hi, gradients view), ...]
    p_hat: dict = field(default_factory=dict)  # group key -> orthonormal P [k, n, r]
    q_local: dict = field(default_factory=dict)  # group key -> M^T P^ [k, m, r]
    # (shard_powersgd, PowerSGD of Mᵀ: P^ is [k, m, r] and q_local M P^ [k, n, r])
    q_sent: dict = field(default_factory=dict)   # q_local as it went on the wire (rounded)
    nonfinite: Optional[torch.Tensor] = None     # bool [1] on the device: some rank's flag
    dense: list = field(default_factory=list)    # the dense rest, flat (the slow hop)


class BucketCompressor:
    """PowerSGD state and math for one gradient bucket.

    ``entries`` lists the bucket's gradients as ``(name, (n, m))`` in a fixed order; every
    call then passes the gradients as matrix views in that order.
    """

    def __init__(self, entries: Sequence[tuple[str, tuple[int, int]]], rank: int, *,
                 min_compression_rate: float = 2.0, seed: int = 0,
                 compress_all: bool = False, device=None,
                 factor_dtype: torch.dtype = torch.float32,
                 ef_dtype: torch.dtype = torch.float32):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.entries = [(name, (int(n), int(m))) for name, (n, m) in entries]
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self.compress_all = compress_all  # tests: compress every matrix, even at full rank
        self.device = device
        self.factor_dtype = factor_dtype  # P and Q on the wire; all math in fp32
        self.ef_dtype = ef_dtype          # the residual kept between steps
        self.rank = rank
        self.shape_ranks: dict[tuple[int, int], int] = {}  # per-shape overrides of ``rank``
        #: When set, :meth:`finish` adds each group's captured energy per basis column to
        #: :attr:`spectrum` (the budget controller's measured error curves): per shape
        #: ``[Σ‖M‖², Σ column energies, steps]`` as float64 / int64 tensors on the device.
        self.track_spectrum = False
        self.spectrum: dict[tuple[int, int], list] = {}
        self.groups: dict[tuple[int, int], ShapeGroup] = {}
        self.dense_indices: list[int] = []
        self._pending_flush: dict[str, torch.Tensor] = {}  # residuals of matrices gone dense
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
        groups: dict[tuple[int, int], ShapeGroup] = {}
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
        for key, g in self.groups.items():
            if g.q is None:
                continue
            r_new = self._rank_for(g)
            r_old = g.q.shape[2]
            if r_new < r_old:
                g.q = g.q[:, :, :r_new].contiguous()
            elif r_new > r_old:
                extra = self._seeded(g, f"grow{r_old}-{r_new}", r_new - r_old)
                g.q = torch.cat([g.q, extra.to(g.q.device)], dim=2)

    def matrix_shapes(self) -> list:
        """``(n, m)`` of the bucket's matrices (the budget controller's view)."""
        return [shape for _, shape in self.entries]

    def fresh(self, rank: int) -> "BucketCompressor":
        """A compressor of the same entries and settings at ``rank``, with no state (the
        bypass times one on scratch gradients)."""
        return BucketCompressor(self.entries, rank, min_compression_rate=self.min_compression_rate,
                                seed=self.seed, device=self.device,
                                factor_dtype=self.factor_dtype, ef_dtype=self.ef_dtype)

    def local_step(self, grads: Sequence[torch.Tensor]) -> None:
        """One step's math with every collective left out (the bypass's cost model)."""
        bufs, step = self.start(grads)
        self.finish(step, self.middle(step, bufs))

    # ------------------------------------------------------------------ sizes

    def collective_numels(self) -> tuple[int, int]:
        """Elements of the two collectives: ``[P | dense rest | flag]`` and ``Q``."""
        p = sum(len(g.indices) * g.n * self._rank_for(g) for g in self.groups.values())
        q = sum(len(g.indices) * g.m * self._rank_for(g) for g in self.groups.values())
        dense = sum(self.entries[i][1][0] * self.entries[i][1][1] for i in self.dense_indices)
        return p + dense + 1, q

    def compressed_numel(self) -> int:
        """Elements of the two collectives together."""
        return sum(self.collective_numels())

    def collective_bytes(self) -> tuple[int, int]:
        """Bytes of the two phases (first: P, the dense rest and the flag; second: Q)."""
        return sum(self.first_collectives()), self.collective_numels()[1] * self._factor_size()

    def first_collectives(self) -> list:
        """Bytes of each collective of the first phase, in the order :meth:`start` returns
        them: one buffer with fp32 factors; with bf16 factors ``[P]`` (bf16) and
        ``[dense | flag]`` (fp32), either absent when empty (the flag then rides with P)."""
        first, _ = self.collective_numels()
        if self.factor_dtype == torch.float32:
            return [first * FLOAT_BYTES]
        p = sum(len(g.indices) * g.n * self._rank_for(g) for g in self.groups.values())
        dense = first - 1 - p
        if not dense:
            return [(p + 1) * self._factor_size()]
        return ([p * self._factor_size()] if p else []) + [(dense + 1) * FLOAT_BYTES]

    def _factor_size(self) -> int:
        return torch.finfo(self.factor_dtype).bits // 8

    def state_bytes(self) -> int:
        """What stays between steps: residuals (``ef_dtype``) and warm-start Q (fp32)."""
        ef = torch.finfo(self.ef_dtype).bits // 8
        return sum(len(g.indices) * (g.n * g.m * ef + self._q_shape(g)[0] * self._rank_for(g) * 4)
                   for g in self.groups.values())

    def dense_numel(self) -> int:
        return sum(n * m for _, (n, m) in self.entries)

    # ------------------------------------------------------------------ one step

    def _seeded(self, g: ShapeGroup, tag: str, cols: int) -> torch.Tensor:
        """``[k, m, cols]`` seeded Gaussians of the group's warm start (per matrix, the
        same on every rank): the first ``Q``, or columns added when the rank grows."""
        return torch.stack([seeded_gaussian(self.seed, name, tag, g.m, cols)
                            for name in g.seed_names])

    def _q_shape(self, g: ShapeGroup) -> tuple:
        """The shape of one matrix's warm start ``Q``."""
        return (g.m, self._rank_for(g))

    def _init_group(self, g: ShapeGroup, device) -> None:
        r = self._rank_for(g)
        g.q = self._seeded(g, "init", r).to(device)
        g.residual = torch.zeros(len(g.names), g.n, g.m, dtype=self.ef_dtype, device=device)

    def _views(self, g: ShapeGroup, grads: Sequence[torch.Tensor]) -> list:
        """``[(lo, hi, view [hi - lo, n, m])...]``: the group's gradients as strided views
        of their buffer, in the gradients' dtype (:func:`strided_runs`; a matrix that is
        not contiguous is a run of its own, ``[1, n, m]``). No copy."""
        mats = [grads[i] for i in g.indices]
        if not all(t.is_contiguous() for t in mats):
            return [(j, j + 1, t.unsqueeze(0)) for j, t in enumerate(mats)]
        key = tuple(t.data_ptr() for t in mats)
        if key != g.runs_key:
            g.runs_key, g.runs = key, strided_runs(mats, g.n, g.m)
        return [(lo, hi, run_view(mats[lo], hi - lo, step, g.n, g.m))
                for lo, hi, step in g.runs]

    def _ef_slices(self, lo: int, hi: int, g: ShapeGroup, temporaries: int = 2) -> list:
        """``[(lo, hi)]`` covering a run: the whole run when nothing needs an fp32
        temporary (fp32 residual on fp32 gradients, ``temporaries=0``); otherwise slices
        whose ``temporaries`` fp32 copies of a slice (a cast residual, a selected result, a
        slice's ``M``) stay within :attr:`workspace_bytes` (mixed-dtype elementwise ops
        make a cast copy of their input on CPU; one matrix is the least a slice holds)."""
        if not temporaries:
            return [(lo, hi)]
        per = max(1, self.workspace_bytes // (temporaries * g.n * g.m * 4))
        return [(a, min(a + per, hi)) for a in range(lo, hi, per)]

    #: Bound on the fp32 temporaries of a step: the mixed-dtype error feedback
    #: (:meth:`_ef_slices`) and the slices of ``M`` formed from low-precision gradients.
    workspace_bytes = 64 << 20

    def _ef_temporaries(self) -> int:
        """fp32 temporaries the residual's dtype adds per slice (a cast copy, a result),
        counted twice: slices take half the workspace, the rest is the allocator's slack
        (at a full workspace the peak crossed the bound in 1 run of 6)."""
        return 0 if self.ef_dtype == torch.float32 else 4

    def _form_in_place(self, g: ShapeGroup, views: list) -> None:
        """``G += E`` in the fp32 runs (they hold ``M`` from here to :meth:`finish`); runs in
        another dtype keep ``G``, their ``M`` is formed slice by slice (:meth:`_m_blocks`)."""
        for lo, hi, view in views:
            if view.dtype == torch.float32:
                for a, b in self._ef_slices(lo, hi, g, self._ef_temporaries()):
                    view[a - lo:b - lo].add_(g.residual[a:b])

    def _m_blocks(self, g: ShapeGroup, views: list):
        """``(a, b, M, target)`` over the group's matrices: ``M`` ([b - a, n, m], fp32) of
        matrices ``a..b``. An fp32 run holds ``M`` itself (``target`` None: results go in
        place). A run in another dtype (bf16 gradient buffers, ``--grad-reduce-in-bf16``)
        gives ``M = float(G) + E`` per slice within :attr:`workspace_bytes`, and ``target``,
        the gradients' slice that takes the result: ``M`` is never rounded to the
        gradients' dtype, so the products and the residual are the fp32 ones, and only the
        result written back is rounded. Each phase forms it again (one more read of ``G``
        and ``E`` per phase) instead of holding a copy of the gradients."""
        for lo, hi, view in views:
            if view.dtype == torch.float32:
                yield lo, hi, view, None
                continue
            # two slices of M live at once (the caller holds the last one while the next
            # forms), kept to half the workspace: the rest is the allocator's slack
            for a, b in self._ef_slices(lo, hi, g, 4 + self._ef_temporaries()):
                target = view[a - lo:b - lo]
                m = target.float()
                m.add_(g.residual[a:b])
                yield a, b, m, target

    def _form_m_and_p(self, key, g: ShapeGroup, grads, step: _Step) -> torch.Tensor:
        """``G += E`` in the group's gradients and ``P = M Q`` ([k, n, r], fp32); records
        the views ``M`` is held in for :meth:`middle` and :meth:`finish`."""
        views = step.views[key] = self._views(g, grads)
        self._form_in_place(g, views)
        p = torch.empty(len(g.indices), g.n, g.q.shape[2], device=g.q.device)
        for a, b, m, _ in self._m_blocks(g, views):
            torch.bmm(m, g.q[a:b], out=p[a:b])
        return p

    #: The orthonormalization of the summed P (``bench/step_before.py`` swaps in the old).
    orthonormalize = staticmethod(orthonormalize)

    def start(self, grads: Sequence[torch.Tensor]) -> tuple[list, _Step]:
        """Error feedback ``G += E`` in the gradients and ``P = M Q``; returns the buffers
        to SUM-reduce: ``[[P... | dense... | flag]]``, or with bf16 factors ``[[P...]
        (bf16), [dense... | flag]]`` (``[[P... | flag]]`` without a dense rest,
        ``[[dense... | flag]]`` without P).

        From here to :meth:`finish` the compressed gradients hold ``M = G + E``; the
        compressor's state is not changed. The flag is 1 where any element of P (in the
        factor dtype) or of the dense rest is non-finite, else 0, decided on the device."""
        assert len(grads) == len(self.entries)
        step = _Step(grads=list(grads))
        device = grads[0].device if grads else self.device
        p_parts = []
        for key, g in self.groups.items():
            if g.q is None:
                self._init_group(g, device)
            p_parts.append(self._form_m_and_p(key, g, grads, step).view(-1))
        return self._pack(p_parts, self._dense_parts(grads), device), step

    def _dense_parts(self, grads: Sequence[torch.Tensor]) -> list:
        """The uncompressed gradients, flat fp32, a matrix's residual handed back once
        when it fell back to dense (nothing is lost)."""
        parts = []
        for i in self.dense_indices:
            name = self.entries[i][0]
            if name in self._pending_flush:
                grads[i].add_(self._pending_flush.pop(name).view_as(grads[i]).to(grads[i].dtype))
            parts.append(grads[i].float().reshape(-1))
        return parts

    def _pack(self, factor_parts: list, dense_parts: list, device,
              also_nonfinite: Optional[torch.Tensor] = None) -> list:
        """The buffers of one phase: ``[factors | dense | flag]`` (fp32), or with bf16
        factors ``[factors]`` (bf16) and ``[dense | flag]`` (fp32), either absent when
        empty (the flag then rides with the factors). The flag is 1 where a payload (after
        the cast to the factor dtype) is non-finite, or ``also_nonfinite`` is set."""
        if self.factor_dtype != torch.float32:  # checked after the cast: it may overflow
            factor_parts = [part.to(self.factor_dtype) for part in factor_parts]
        flag = torch.zeros(1, device=device)
        if self.factor_dtype == torch.float32:
            bufs = [torch.cat(factor_parts + dense_parts + [flag])]
        elif not dense_parts:  # the flag rides with P (it sums exactly in bf16 up to 256)
            bufs = [torch.cat(factor_parts + [flag.to(self.factor_dtype)])]
        else:
            bufs = ([torch.cat(factor_parts)] if factor_parts else []) + \
                [torch.cat(dense_parts + [flag])]
        payloads = bufs[:-1] + [bufs[-1][:-1]]
        finite = torch.stack([torch.isfinite(b).all() for b in payloads]).all()
        if also_nonfinite is not None:
            finite = finite & also_nonfinite.logical_not()
        bufs[-1][-1] = finite.logical_not()
        return bufs

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
            p_hat = self.orthonormalize(p)
            step.p_hat[key] = p_hat
            q_local = torch.empty(k, g.m, r, device=p_hat.device)
            for a, b, m, _ in self._m_blocks(g, step.views[key]):
                torch.bmm(m.transpose(1, 2), p_hat[a:b], out=q_local[a:b])
            step.q_local[key] = q_local
            if self.factor_dtype == torch.float32:
                step.q_sent[key] = q_local
                qs.append(q_local.view(-1))
            else:
                sent = q_local.to(self.factor_dtype)
                step.q_sent[key] = sent.float()
                qs.append(sent.view(-1))
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
        """After the second SUM: the residual, then ``M^ = P^ Qᵀ`` into the gradients.

        Per run of matrices, in the gradient buffer (which holds ``M``): ``M -= P^ Q_iᵀ``
        (one in-place ``baddbmm``: the new residual), selected into ``E`` with one
        ``torch.where(bad, E, ·, out=E)``, then ``P^ Qᵀ`` written over it (``baddbmm``
        with ``beta=0``). No temporary of the gradients' size.

        Where some rank flagged a non-finite value (``step.nonfinite``, on the device) the
        summed Q is replaced by NaN, so every decompressed gradient is NaN, and ``E`` and
        the warm start keep their values from before the step, bit for bit.
        """
        bad = step.nonfinite
        for key, g, q in self._summed_qs(reduced_q, bad):
            p_hat = step.p_hat[key]
            self._finish_group(key, g, step, bad, (p_hat, step.q_sent[key]), (p_hat, q), key)
            g.q = torch.where(bad, g.q, q)

    def _finish_group(self, key, g: ShapeGroup, step: _Step, bad: torch.Tensor,
                      sent: tuple, result: tuple, spectrum_key) -> None:
        """One group's end of a step, in the gradient buffer (which holds ``M``), per run
        of matrices: ``M -= A Bᵀ`` with ``(A, B) = sent`` (the new residual), selected into
        ``E`` where ``bad`` is not set, then ``C Dᵀ`` with ``(C, D) = result`` written over
        it (in the gradients' dtype); the spectrum under ``spectrum_key``."""
        energy = None
        ef_temps = self._ef_temporaries()
        for lo, hi, m, target in self._m_blocks(g, step.views[key]):
            if self.track_spectrum:  # ‖M‖², before M becomes the residual
                part = torch.linalg.vector_norm(m).double() ** 2
                energy = part if energy is None else energy + part
            m.baddbmm_(sent[0][lo:hi], sent[1][lo:hi].transpose(1, 2), alpha=-1)
            for a, b in self._ef_slices(lo, hi, g, ef_temps if target is None else 0):
                if self.ef_dtype == torch.float32:
                    torch.where(bad, g.residual[a:b], m[a - lo:b - lo], out=g.residual[a:b])
                else:
                    g.residual[a:b].copy_(torch.where(bad, g.residual[a:b].float(),
                                                      m[a - lo:b - lo]))
            m.baddbmm_(result[0][lo:hi], result[1][lo:hi].transpose(1, 2), beta=0)
            if target is not None:  # the one rounding of a low-precision buffer
                target.copy_(m)
        if self.track_spectrum:
            self._add_spectrum(spectrum_key, energy, step.q_local[key], bad)
        step.views[key] = None

    def _summed_qs(self, reduced_q: torch.Tensor, bad: torch.Tensor):
        """``(key, group, Q [k, m, r] fp32)`` per group from the reduced Q buffer; ``Q`` is a
        new tensor (``reduced_q`` stays as it came), NaN where ``bad`` is set."""
        offset = 0
        for key, g in self.groups.items():
            k, r = len(g.indices), self._rank_for(g)
            q = reduced_q[offset:offset + k * g.m * r].view(k, g.m, r).float()
            offset += k * g.m * r
            yield key, g, q.masked_fill(bad, float("nan"))
        assert offset == reduced_q.numel()

    def _add_spectrum(self, key, total: torch.Tensor, q_local: torch.Tensor,
                      bad: torch.Tensor) -> None:
        """Accumulate ``[Σ‖M‖², Σ_k sorted column energies of Mᵀ P^, steps]`` for one
        group, on the device (``total``: ``Σ‖M‖²`` in float64; ``bad``: the step's
        non-finite flag; such a step adds 0).

        ``P^`` is orthonormal, so column ``j`` of ``Q_local = Mᵀ P^`` carries exactly the
        energy ``‖Mᵀ p_j‖²`` the step captures in direction ``p_j``, and ``‖M‖² − Σ_j`` of
        them is ``‖E‖²``. Sorted per matrix, the first ``r'`` of them are the energy the
        best ``r'`` columns of this basis would keep: a measured error curve for every
        rank up to the current one, at the cost of one pass over ``Q_local``.
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

    def absorb_residual(self, grads: Sequence[torch.Tensor]) -> None:
        """Before a dense sync of this bucket: add every residual (and pending flush) into
        its gradient and zero it — the dense message carries the whole error, nothing is
        lost. The warm-start Q is kept for the next compressed step."""
        assert len(grads) == len(self.entries)
        for g in self.groups.values():
            if g.residual is None:
                continue
            views = self._views(g, grads)
            self._form_in_place(g, views)
            for _, _, m, target in self._m_blocks(g, views):
                if target is not None:
                    target.copy_(m)
            g.residual.zero_()
        for i, (name, _) in enumerate(self.entries):
            if name in self._pending_flush:
                grads[i].add_(self._pending_flush.pop(name).view_as(grads[i]).to(grads[i].dtype))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        out = {"rank": self.rank, "matrices": {},
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
        mismatched = []
        mats = state["matrices"]
        for g in self.groups.values():
            r = self._rank_for(g)
            ok = all(name in mats and tuple(mats[name]["q"].shape) == self._q_shape(g)
                     and tuple(mats[name]["residual"].shape) == (g.n, g.m) for name in g.names)
            if ok:
                dev = device if device is not None else self.device
                g.q = torch.stack([mats[name]["q"] for name in g.names]).to(dev)
                g.residual = torch.stack([mats[name]["residual"] for name in g.names]).to(
                    dev, self.ef_dtype)
            else:
                mismatched += [name for name in g.names if name in mats]
                g.q = g.residual = None
        self._pending_flush = dict(state.get("pending_flush", {}))
        dev = device if device is not None else self.device
        self.spectrum = {(n, m): [torch.tensor(total, dtype=torch.float64, device=dev),
                                  cols.to(dev, torch.float64, copy=True),
                                  torch.tensor(count, dtype=torch.int64, device=dev)]
                         for n, m, total, cols, count in state.get("spectrum", [])}
        return mismatched
