"""The orthonormalization as it was before issue 56: the "before" of its before/after.

Batched shifted CholeskyQR3 with the Gram matrices and their Cholesky in fp32, the shift
``max(1e-5, 1e-6 ‖G‖_F)`` sized to the one failing Gram of an H200 (issue 50). At hidden
1024 on an H100 its factorizations failed within 25-40 iterations (issue 56): the fp32
Gram's rounding grows with the rows and the rank, the shift does not. Kept only for
``bench/gpu_kernels.py`` and ``bench/compression_math.py``, which time it beside today's in
the same run, and for the tests that show the GPU rounding model makes it fail.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_edgc.compression.orthonormal import _IeeeFp32Matmul, fixed_basis

#: The diagonal shift of the first two CholeskyQR passes: at least GRAM_SHIFT (relative
#: to a unit column), and at least GRAM_ROUNDING times the Gram matrix's Frobenius norm.
#: fp32 rounding perturbs a Gram in proportion to its norm, which nearly collinear columns
#: raise to ~r (``P`` of a gradient with one dominant direction, as early in training): on
#: the H200 a Gram of norm 61.6 came out with an eigenvalue of -1.35e-5 (2.2e-7 of its
#: norm), below the absolute 1e-5, and cuSOLVER's Cholesky gave NaN (issue 50).
GRAM_SHIFT = 1e-5
GRAM_ROUNDING = 1e-6


def _cholesky_qr_pass(x: torch.Tensor, eye: torch.Tensor, shifted: bool) -> torch.Tensor:
    """``x R⁻¹`` with ``RᵀR = xᵀx + s·I`` (``s = max(GRAM_SHIFT, GRAM_ROUNDING·‖xᵀx‖_F)``
    where ``shifted``, else 0), batched: one Gram ``bmm``, a batched Cholesky (no error
    check: no host sync), ``R⁻¹`` from a triangular solve on ``[k, r, r]`` and one ``bmm``
    to apply it. Seven operators: on a GPU the orthonormalization is bound by their
    launches, not by its flops."""
    gram = torch.bmm(x.transpose(1, 2), x)
    if shifted:
        norm = torch.linalg.vector_norm(gram, dim=(1, 2), keepdim=True)
        gram = torch.addcmul(gram, norm.clamp_min_(GRAM_SHIFT / GRAM_ROUNDING), eye,
                             value=GRAM_ROUNDING)
    lower = torch.linalg.cholesky_ex(gram).L
    lower_inv = torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False)
    return torch.bmm(x, lower_inv.transpose(1, 2))


def fp32_gram_orthonormalize(p: torch.Tensor, fill: Optional[torch.Tensor] = None,
                   trace: Optional[Callable[[str, torch.Tensor], None]] = None,
                   stood_in: Optional[list] = None) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` ([k, n, r] batched, or one [n, r]), in fp32.

    Batched shifted CholeskyQR3 (Fukaya et al., SISC 2020) with a null-space fill: no
    per-matrix loop, no ``torch.linalg.qr``, no host sync, no TF32, deterministic (every DP
    replica gets the same bits):

    1. each matrix is scaled by its largest element (no overflow in the norms), then each
       column to unit norm: a spectrum that decays from column to column (warm-started
       PowerSGD's ``P``) becomes well conditioned, and the span is unchanged;
    2. two CholeskyQR passes with a diagonal shift ``s`` above the Gram's rounding
       (``GRAM_SHIFT``, ``GRAM_ROUNDING``; the Cholesky succeeds whatever the
       conditioning, and where rounding defeats it all the same, step 5): each maps a
       singular value ``σ`` to ``σ/√(σ²+s)``, so after two every direction of ``P`` above
       ~1e-5 of its norm (above ~1e-4 where its columns are nearly collinear) has singular
       value ≈ 1 and the directions ``P`` lacks (zero columns, an all-zero ``P`` of a
       frozen weight, rank below ``r``) are near 0;
    3. the missing directions are filled: ``x += F (I - xᵀx)²`` with a fixed orthonormal
       ``F`` (:func:`fixed_basis`). ``(I - xᵀx)²`` is ~``s²`` on the directions ``P``
       has and ~1 on those it lacks, so the span is kept (to ~1e-10) and every missing
       direction gets a unit vector, as Householder QR gives zero columns;
    4. one unshifted CholeskyQR pass: orthogonal to ``ORTHOGONALITY_BOUND``;
    5. where a factorization failed all the same (rounding left a shifted Gram indefinite:
       cuSOLVER's Cholesky returns NaN there, LAPACK finite garbage; rare since the shift
       grows with the Gram's norm) the matrix's basis is a fixed orthonormal one
       (:func:`fixed_basis`): the error feedback keeps what it misses. Chosen on
       the device; ``stood_in``, when given, gets the bool ``[k]`` of those matrices.

    Flops: three Gram matrices and four ``[n, r] x [r, r]`` products, ``14 n r²`` per
    matrix against Householder's ``4 n r²``, small beside the step's ``8 n m r``.
    Non-finite input gives non-finite output (the step's non-finite flag handles it).
    ``trace(stage, x)``, when given, sees ``x`` after each of the five stages (a replay's
    view: ``scripts/replay_step.py``).
    """
    trace = trace or (lambda stage, x: None)
    squeeze = p.dim() == 2
    x = p.float().unsqueeze(0) if squeeze else p.float()
    k, n, r = x.shape
    if fill is None:
        fill = fixed_basis(n, r, x.device)
    given = torch.isfinite(x).all(dim=(1, 2), keepdim=True)
    with _IeeeFp32Matmul():
        largest = x.abs().amax(dim=(1, 2), keepdim=True)
        x = x / largest.clamp_min(torch.finfo(torch.float32).tiny)
        columns = torch.linalg.vector_norm(x, dim=1, keepdim=True)
        x = x / columns.clamp_min(1e-15)
        trace("1. scaled, unit columns", x)
        eye = torch.eye(r, device=x.device, dtype=x.dtype)
        x = _cholesky_qr_pass(x, eye, True)
        x = _cholesky_qr_pass(x, eye, True)
        trace("2. two shifted CholeskyQR passes", x)
        missing = eye - torch.bmm(x.transpose(1, 2), x)
        missing = torch.bmm(missing, missing)  # ~s² on the directions P has, ~1 off them
        x = torch.baddbmm(x, fill.expand(k, n, r), missing)
        trace("3. missing directions filled", x)
        x = _cholesky_qr_pass(x, eye, False)
        trace("4. unshifted CholeskyQR pass", x)
        failed = given & torch.isfinite(x).all(dim=(1, 2), keepdim=True).logical_not()
        x = torch.where(failed, fixed_basis(n, r, x.device), x)
        trace("5. a fixed basis where a factorization failed", x)
    if stood_in is not None:
        stood_in.append(failed.view(-1))
    return x.squeeze(0) if squeeze else x
