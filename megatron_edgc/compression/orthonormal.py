"""Orthonormal columns of a batch of factors: batched shifted CholeskyQR3 in fp64 with a
null-space fill, deterministic and free of host syncs (EDGC §1's ``orth``)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Optional

import torch

from megatron_edgc.compression.kernels import select

#: The working dtype of the orthonormalization. In fp32 the Gram ``xᵀx`` of ``n`` rows is
#: off by up to ``r γ_n`` of its norm, which no shift can absorb at the widths users train
#: (:func:`cholesky_safe_shift` is 4.0 at ``n = 50304, r = 256``): GPT-2 medium's factors
#: failed on an H100 within 25-40 iterations (issue 56). In fp64 the same bound is 7.5e-9,
#: and fp64 products are never TF32, whatever ``NVIDIA_TF32_OVERRIDE`` says.
WORK_DTYPE = torch.float64
#: The dtype of the products that form the basis (steps 3-4 of :func:`orthonormalize`):
#: their transforms have entries up to ``1/√GRAM_SHIFT`` (~300), which amplify the
#: rounding of their operands. fp64, because NVIDIA's PyTorch containers force TF32 on
#: fp32 products (``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``, whatever
#: ``torch.backends.cuda.matmul`` says): TF32's 10-bit operands missed the orthogonality
#: bound by orders of magnitude there (issue 64, ``tests/test_orthonormal.py``).
PRODUCT_DTYPE = torch.float64
#: The span's threshold: the first two passes shift the Gram of unit columns by this, so a
#: direction of ``P`` below ~1e-5 of its norm counts as missing and is filled (step 3).
GRAM_SHIFT = 1e-5
#: Step 4's Cholesky factor ``L₃`` of the filled basis's Gram: a diagonal entry with
#: ``L_jj² < FILL_DEFICIENT · max_i G_ii`` means two columns coincide (a fill vector that
#: lies in ``P``'s span: every fixed fill has such a ``P``); a healthy fill keeps every
#: ``L_jj²`` above ~0.4 (a direction half in ``P``, half filled).
FILL_DEFICIENT = 1e-3
#: What :func:`orthonormalize` guarantees: ``max |P^ᵀ P^ - I| <= ORTHOGONALITY_BOUND`` for
#: every finite ``P`` (zero, rank-deficient, condition numbers up to 1e7; tested).
ORTHOGONALITY_BOUND = 1e-5

#: (rows, device) -> the fixed basis of that many rows for the widest rank asked so far
#: (:func:`fixed_basis`): one per row count, whatever the ranks a run reaches.
_BASES: dict = {}


def cholesky_safe_shift(n: int, r: int, dtype: torch.dtype = WORK_DTYPE) -> float:
    """The diagonal shift, relative to the Gram's largest diagonal entry ``d``, above which
    the Cholesky factorization of a Gram ``xᵀx`` of ``n`` rows and ``r`` columns computed
    in ``dtype`` succeeds by construction, whatever ``x`` (rank-deficient included).

    The computed Gram is off by ``|E_ij| <= γ_n ‖x_i‖ ‖x_j‖``, so its eigenvalues by at
    most ``r γ_n d`` (``γ_n = n u / (1 - n u)``, any summation order: cuBLAS's, LAPACK's);
    Cholesky completes where ``λ_min > 20 r^{3/2} u ‖A‖₂`` (Demmel 1989; Higham, *Accuracy
    and Stability*, Thm 10.7), ``‖A‖₂ <= r d``. Twice the sum of both."""
    u = torch.finfo(dtype).eps / 2
    gamma = n * u / (1 - n * u) if n * u < 1 else float("inf")
    return 2 * (r * gamma + 20 * r ** 2.5 * u)


def _row_signs(n: int, device) -> torch.Tensor:
    """``[n, 1]`` of ±1 from an integer hash of each row's index (a 64-bit mix, exact on
    every device: the same signs everywhere)."""
    h = torch.arange(n, device=device, dtype=torch.int64) * 0x9E3779B1 + 0x7F4A7C15
    h = (h ^ (h >> 16)) * 0x45D9F3B
    h = (h ^ (h >> 16)) * 0x45D9F3B
    h = h ^ (h >> 16)
    return ((h & 1) * 2 - 1).to(torch.float64).view(n, 1)


def fixed_basis(n: int, r: int, device) -> torch.Tensor:
    """A fixed ``[n, r]`` fp32 basis with orthonormal columns (to fp32's rounding), the
    same bits on every rank of a job: the DCT-II basis (``√(2/n) cos(π(2i+1)j / 2n)``,
    ``1/√n`` for ``j = 0``) with each row's sign flipped by a hash of its index, so that no
    column is a constant or smooth direction a gradient may share. Built on ``device``
    from indices (``arange``, integer arithmetic, ``cos`` in fp64): no host data, no copy,
    no sync, at any new shape (the rank changes of the budget controller, EDGC's windows,
    DAC). Its first ``r`` columns do not depend on ``r``: one basis per row count is kept,
    for the widest ``r`` asked so far, and sliced — the cache grows with the shapes, not
    with the ranks. The null-space fill of :func:`orthonormalize` and the basis that stands
    in where a factorization failed."""
    if not 1 <= r <= n:
        raise ValueError(f"a basis of {r} orthonormal columns needs 1 <= r <= n = {n}")
    key = (n, str(device))
    basis = _BASES.get(key)
    if basis is None or basis.shape[1] < r:
        i = torch.arange(n, device=device, dtype=torch.int64).view(n, 1)
        j = torch.arange(r, device=device, dtype=torch.int64).view(1, r)
        phase = ((2 * i + 1) * j) % (4 * n)        # exact: the angle reduced to [0, 2π)
        cols = torch.cos(phase.to(torch.float64) * (torch.pi / (2 * n)))
        cols = cols * torch.where(j == 0, (1.0 / n) ** 0.5, (2.0 / n) ** 0.5)
        basis = _BASES[key] = (cols * _row_signs(n, device)).float()
    return basis[:, :r]


class _IeeeFp32Matmul:
    """fp32 products without TF32 inside; restores the caller's setting. A host flag, no
    sync. (The Grams are fp64 and never TF32; this keeps the fp32 products that form the
    basis at fp32's rounding where PyTorch decides it.)"""

    def __init__(self, matmul=None):
        self.matmul = matmul

    def __enter__(self):
        matmul = self.matmul or torch.backends.cuda.matmul
        self.new_api = hasattr(matmul, "fp32_precision")
        if self.new_api:
            self.saved = matmul.fp32_precision
            matmul.fp32_precision = "ieee"
        else:
            self.saved = matmul.allow_tf32
            matmul.allow_tf32 = False

    def __exit__(self, *exc):
        matmul = self.matmul or torch.backends.cuda.matmul
        if self.new_api:
            matmul.fp32_precision = self.saved
        else:
            matmul.allow_tf32 = self.saved


def _host_ieee_matmul():
    """:class:`_IeeeFp32Matmul` for the host's fp32 products (oneDNN's setting), where this
    PyTorch has one."""
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return _IeeeFp32Matmul(matmul) if hasattr(matmul, "fp32_precision") else nullcontext()


def _gram(x: torch.Tensor) -> torch.Tensor:
    """``xᵀx`` in fp64 (fp32 products are exact in fp64: only the sums round)."""
    x = x.to(WORK_DTYPE)
    return torch.bmm(x.transpose(1, 2), x)


def _shifted_cholesky_inverse(gram: torch.Tensor, eye: torch.Tensor, span_shift: float,
                              safe_shift: float) -> tuple:
    """``(L⁻¹, s, failed)`` with ``L Lᵀ = gram + s·I``, ``s = span_shift + safe_shift·max_i
    gram_ii`` (``[k, 1, 1]``), ``failed`` the bool ``[k]`` of factorizations that reported
    failure: a batched Cholesky (no error check, no host sync; it succeeds by
    :func:`cholesky_safe_shift`) and a triangular solve, on ``[k, r, r]``."""
    shift = gram.diagonal(dim1=1, dim2=2).amax(dim=1).mul(safe_shift).add_(span_shift)
    shift = shift.view(-1, 1, 1)
    lower, info = torch.linalg.cholesky_ex(torch.addcmul(gram, shift, eye))
    inverse = torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False)
    return inverse, shift, info != 0


def orthonormalize(p: torch.Tensor, fill: Optional[torch.Tensor] = None,
                   trace: Optional[Callable[[str, torch.Tensor], None]] = None,
                   stood_in: Optional[list] = None) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` ([k, n, r] batched, or one [n, r]), in fp32,
    row-major.

    Shifted CholeskyQR3 (Fukaya et al., SISC 2020) with a null-space fill, batched, its
    Gram matrices, Cholesky factors and ``[r, r]`` algebra in fp64: no per-matrix loop, no
    ``torch.linalg.qr``, no host sync, deterministic (every DP replica gets the same
    bits). Every factorization succeeds by construction on finite input: each shift is
    above :func:`cholesky_safe_shift` of the Gram's rows and rank (in fp64; in fp32 no
    shift could be, at these widths: issue 56).

    1. each column to unit norm (a spectrum that decays from column to column, warm-started
       PowerSGD's ``P``, becomes well conditioned; the span is unchanged), ``x₀``, and its
       Gram ``G₀ = x₀ᵀx₀``: the first of two products over the ``n`` rows in fp64;
    2. two CholeskyQR passes shifted by ``GRAM_SHIFT``, on ``G₀`` alone: with ``L₁L₁ᵀ =
       G₀ + s₁I`` the first maps ``x₀`` to ``x₁ = x₀L₁⁻ᵀ``, whose Gram is ``I - s₁L₁⁻¹L₁⁻ᵀ``
       (no product over ``n``), and so the second, ``x₂ = x₀T``. Each maps a singular value
       ``σ`` to ``σ/√(σ²+s)``: after two every direction of ``P`` above ~1e-5 of its norm
       has singular value ≈ 1, and the directions ``P`` lacks (zero columns, an all-zero
       ``P`` of a frozen weight, rank below ``r``) are near 0;
    3. the missing directions are filled: ``x₃ = x₀T + F (I - x₂ᵀx₂)²`` with a fixed
       orthonormal ``F`` (:func:`fixed_basis`), formed in :data:`PRODUCT_DTYPE` (fp64:
       never TF32, whatever a container forces). ``I - x₂ᵀx₂ = s₂L₂⁻¹L₂⁻ᵀ``
       is ~``s`` on the directions ``P`` has and ~1 on those it lacks, so the span is kept
       (to ~1e-10) and every missing direction gets a unit vector, as Householder QR
       gives zero columns;
    4. a CholeskyQR pass on ``x₃`` with its own Gram (fp64), shifted only by the safe
       shift (~1e-9), its product in fp64 and rounded once to fp32: orthogonal to
       ``ORTHOGONALITY_BOUND`` (the Gram of ``x₃`` as formed, so the rounding of steps 1-3
       is corrected here);
    5. the last resort, should a factorization fail all the same (a device whose Cholesky
       breaks its error bound; cuSOLVER's gives NaN there, LAPACK's finite garbage), or
       the fill coincide with ``P``'s span (step 4's factor has a pivot below
       :data:`FILL_DEFICIENT`: two columns of ``x₃`` were one; any fixed fill has such a
       ``P``): that matrix's basis is the fixed orthonormal one (:func:`fixed_basis`) and
       the error feedback keeps what it misses. Chosen on the device; ``stood_in``, when given,
       gets the bool ``[k]`` of those matrices.

    Over the ``n`` rows: two Grams and three ``[n, r] x [r, r]`` products in fp64, small
    beside the step's ``8 n m r``; two ``[k, n, r]`` fp64 temporaries (docs/method.md §8,
    "The step at its floor", has their cost). Non-finite input gives non-finite output
    (the step's flag handles it). ``trace(stage, x)``, when given, sees ``x`` after each
    stage (``scripts/replay_step.py``).
    """
    squeeze = p.dim() == 2
    x = p.unsqueeze(0) if squeeze else p
    k, n, r = x.shape
    if fill is None:
        fill = fixed_basis(n, r, x.device)
    columns = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=WORK_DTYPE)
    given = torch.isfinite(columns).all(dim=2).view(-1)   # fp64 norms of fp32: exact test
    scale = columns.clamp_min(torch.finfo(WORK_DTYPE).tiny).reciprocal()
    # in fp32's range (a column of subnormals stays small: a direction P lacks)
    x = x.float() * scale.clamp_max(torch.finfo(torch.float32).max).float()
    if trace is not None:
        trace("1. unit columns", x)
    eye = torch.eye(r, device=x.device, dtype=WORK_DTYPE)
    safe = cholesky_safe_shift(n, r)
    x = x.to(PRODUCT_DTYPE)   # the unit columns, exact in fp64: the Gram's and products'
    inv1, s1, failed1 = _shifted_cholesky_inverse(_gram(x), eye, GRAM_SHIFT, safe)
    gram1 = eye - s1 * torch.bmm(inv1, inv1.transpose(1, 2))
    inv2, s2, failed2 = _shifted_cholesky_inverse(gram1, eye, GRAM_SHIFT, safe)
    transform = torch.bmm(inv2, inv1).transpose(1, 2)           # x₂ = x₀ T
    missing = s2 * torch.bmm(inv2, inv2.transpose(1, 2))         # I - x₂ᵀx₂
    missing = torch.bmm(missing, missing)  # ~s² on the directions P has, ~1 off them
    with _IeeeFp32Matmul():   # the products in PRODUCT_DTYPE (an fp32 one without TF32)
        p64 = PRODUCT_DTYPE
        if trace is not None:
            trace("2. two shifted CholeskyQR passes", torch.bmm(x, transform.to(p64)).float())
        x = torch.baddbmm(torch.matmul(fill.to(p64), missing.to(p64)), x, transform.to(p64))
        if trace is not None:
            trace("3. missing directions filled", x.float())
        gram3 = _gram(x)
        inv3, _, failed3 = _shifted_cholesky_inverse(gram3, eye, 0.0, safe)
        x = torch.bmm(x, inv3.transpose(1, 2).to(p64)).float()
    # L₃'s diagonal is 1 / inv3's: a fill that coincided with P's span (issue 64)
    pivots = inv3.diagonal(dim1=1, dim2=2).square().reciprocal()
    deficient = pivots.amin(dim=1) < FILL_DEFICIENT * gram3.diagonal(dim1=1, dim2=2).amax(dim=1)
    if trace is not None:
        trace("4. CholeskyQR pass", x)
    # a failure is seen in [k, r, r]: a factorization's report, or a non-finite factor
    # (cuSOLVER's NaN); the output is a product of finite factors otherwise
    factors = torch.cat([transform, missing, inv3], dim=2)
    failed = failed1 | failed2 | failed3 | deficient | \
        torch.isfinite(factors).all(dim=(1, 2)).logical_not()
    failed = (given & failed).view(-1, 1, 1)
    x = torch.where(failed, fixed_basis(n, r, x.device), x)
    if trace is not None:
        trace("5. a fixed basis where a factorization failed", x)
    if stood_in is not None:
        stood_in.append(failed.view(-1))
    return x.squeeze(0) if squeeze else x


#: :func:`orthonormalization`'s methods: :func:`orthonormalize` called on each shape
#: group's ``[k, n, r]`` (the GPU's, as tested under its rounding and forced TF32), or
#: :func:`orthonormalize_batched` over all of a step's groups at once (the host's).
PER_GROUP = "per-group"
BATCHED = "batched"
#: The dtype of :func:`orthonormalize_batched`'s products over the rows (steps 3-4; its
#: Grams are fp64, :data:`WORK_DTYPE`): fp32 at IEEE rounding, which the host keeps
#: whatever its matmul precision setting says (``torch.backends.mkldnn.matmul``); with no
#: TF32 there, the adversarial factors of ``tests/test_orthonormal.py`` stay 1.3e-7 from
#: orthonormal (the bound: 1e-5) and span ``P`` as in fp64.
HOST_PRODUCT_DTYPE = torch.float32


def orthonormalization(device, dtype: torch.dtype = torch.float32) -> str:
    """The method a step orthonormalizes its factors with on ``device`` in ``dtype``.

    On a GPU :data:`PER_GROUP`, :func:`orthonormalize` as issues 56 and 64 left it (its
    numerics tested under a GPU's rounding and TF32 forced on fp32 products). On the host
    (fp32 or fp64 factors) :data:`BATCHED`, :func:`orthonormalize_batched`: the same
    shifted CholeskyQR3 with its fill and its stand-in, fp64 Grams and products, its
    ``[r, r]`` algebra one batched call for every group of a rank, and two passes fewer over
    the rows (BENCHMARKS.md, "The compressed step against its floor": at the race's small
    shapes a CPU's time per call, not its arithmetic, sets the orthogonalization's)."""
    if torch.device(device).type == "cpu" and dtype in (torch.float32, torch.float64):
        return BATCHED
    return PER_GROUP


def orthonormalize_step(ps: list, stood_in: Optional[list] = None,
                        one: Callable = orthonormalize) -> list:
    """A step's factors (``[k_i, n_i, r_i]`` per shape group, fp32) orthonormalized by
    :func:`orthonormalization`'s method for their device, in order (``stood_in`` as
    :func:`orthonormalize`'s, per group). ``one``: the per-group function; another than
    :func:`orthonormalize` (a benchmark's, a test's failing one) is called per group
    whatever the device."""
    if ps and one is orthonormalize and orthonormalization(ps[0].device, ps[0].dtype) == BATCHED:
        return orthonormalize_batched(ps, stood_in)
    return [one(p, stood_in=stood_in) for p in ps]


def orthonormalize_batched(ps, stood_in: Optional[list] = None) -> list:
    """:func:`orthonormalize` of each ``[k_i, n_i, r]`` in ``ps`` (fp32 out, row-major),
    the host's way (:func:`orthonormalization`): one chain of ``[r, r]`` calls for all the
    factors of a rank, whatever their rows; over each factor's rows an fp64 copy, two
    Grams and three products in fp64 (:data:`PRODUCT_DTYPE` is fp64 for this reason too:
    a CPU's fp32 matmul may run in bf16 under a precision setting), as step 3-4 of
    :func:`orthonormalize` do.

    The same five steps, two of them formed otherwise: the column norms are the square
    roots of the first Gram's diagonal (of the fp64 copy of ``P``: squares of fp32 values
    neither overflow nor underflow there), and the unit columns are never formed: the
    first Gram is scaled by them, and the scaling is folded into the transform
    ``x₂ = x D T``. Every factorization is still a ``torch.linalg.cholesky_ex`` (three per
    rank), judged and stood in for as there; ``stood_in``, when given, gets the bool
    ``[k_i]`` of each factor, in order."""
    out: list = [None] * len(ps)
    failed: list = [None] * len(ps)
    by_rank: dict = {}
    for i, p in enumerate(ps):
        by_rank.setdefault(p.shape[2], []).append(i)
    for r, index in by_rank.items():
        hats, bad = _cholesky_qr3_batched([ps[i] for i in index], r)
        for i, hat, b in zip(index, hats, bad):
            out[i], failed[i] = hat, b
    if stood_in is not None:
        stood_in.extend(failed)
    return out


def _cholesky_qr3_batched(ps: list, r: int) -> tuple:
    """:func:`orthonormalize_batched` for factors of one rank ``r``: ``(bases, failed)``."""
    device = ps[0].device
    counts = [p.shape[0] for p in ps]
    eye = torch.eye(r, device=device, dtype=WORK_DTYPE)
    safe = max(cholesky_safe_shift(p.shape[1], r) for p in ps)   # the tallest's: above all
    xs = [p.float() for p in ps]
    gram = torch.cat([_gram(x) for x in xs])       # of P itself: fp32 squares can't overflow
    squares = gram.diagonal(dim1=1, dim2=2)                       # [K, r]
    given = torch.isfinite(squares).all(dim=1)
    scale = squares.sqrt().clamp_min(torch.finfo(WORK_DTYPE).tiny).reciprocal() \
        .clamp_max(torch.finfo(torch.float32).max)               # 1. unit columns
    gram0 = gram * scale.unsqueeze(2) * scale.unsqueeze(1)
    inv1, s1, failed1 = _shifted_cholesky_inverse(gram0, eye, GRAM_SHIFT, safe)   # 2.
    gram1 = eye - s1 * torch.bmm(inv1, inv1.transpose(1, 2))
    inv2, s2, failed2 = _shifted_cholesky_inverse(gram1, eye, GRAM_SHIFT, safe)
    transform = torch.bmm(inv2, inv1).transpose(1, 2)            # x₂ = x₀ T
    missing = s2 * torch.bmm(inv2, inv2.transpose(1, 2))
    missing = torch.bmm(missing, missing)
    fills = [fixed_basis(x.shape[1], r, device) for x in xs]
    h = HOST_PRODUCT_DTYPE
    # x₀ T = (P D) T = P (D T): the scale in the transform's rows, in fp32's range (a row
    # past it is a column of P below 1e-36 of a unit: a direction P lacks)
    top = torch.finfo(h).max
    folded = (scale.unsqueeze(2) * transform).clamp_(-top, top).to(h)
    with _host_ieee_matmul():
        for i, (x, t, w, f) in enumerate(zip(xs, folded.split(counts),
                                             missing.to(h).split(counts), fills)):
            # 3. the missing directions filled: x₃ = P (D T) + F W
            xs[i] = torch.baddbmm(torch.matmul(f, w), x.to(h), t)
        gram3 = torch.cat([_gram(x) for x in xs])
        inv3, _, failed3 = _shifted_cholesky_inverse(gram3, eye, 0.0, safe)   # 4.
        inv3t = inv3.transpose(1, 2).to(h)
        hats = [torch.bmm(x, t).float() for x, t in zip(xs, inv3t.split(counts))]
    pivots = inv3.diagonal(dim1=1, dim2=2).square().reciprocal()
    deficient = pivots.amin(dim=1) < FILL_DEFICIENT * gram3.diagonal(dim1=1, dim2=2).amax(dim=1)
    factors = torch.cat([transform, missing, inv3], dim=2)
    failed = failed1 | failed2 | failed3 | deficient | \
        torch.isfinite(factors).all(dim=(1, 2)).logical_not()
    failed = given & failed
    hats = [select(bad.view(-1, 1, 1), f, x)   # 5. a fixed basis where one failed
            for x, bad, f in zip(hats, failed.split(counts), fills)]
    return hats, list(failed.split(counts))
