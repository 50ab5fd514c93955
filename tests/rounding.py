"""Comparisons of two code paths that compute the same mathematics with different kernels
(``docs/tests.md``): bit-equality holds only where the same code sees the same data; BLAS
picks kernels by CPU, shape, stride and alignment, so two paths agree to their rounding."""

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u`` of a floating dtype: half its machine epsilon (2^-24 for fp32, 2^-8 for bf16)."""
    return torch.finfo(dtype).eps / 2


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a - b‖_F / ‖b‖_F`` in float64 (0 for two zero tensors)."""
    a, b = a.double(), b.double()
    scale = torch.linalg.vector_norm(b).item()
    diff = torch.linalg.vector_norm(a - b).item()
    return diff / scale if scale else diff


def assert_within_rounding(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    """``‖a - b‖_F <= tol ‖b‖_F``, with both shapes equal and both finite where ``b`` is."""
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)), what
    d = relative_difference(a.nan_to_num(), b.nan_to_num())
    assert d <= tol, f"{what}: relative difference {d:.3g} above the rounding bound {tol:.3g}"


def two_paths_bound(inner: int, steps: int = 1, factor_dtype: torch.dtype = torch.float32,
                    margin: float = 8.0) -> float:
    """How far two correct code paths of the PowerSGD step (relative, Frobenius) may drift
    apart after ``steps`` steps, the derivation of ``tests/test_dp_plans.py``'s
    ``slow_hop_rounding_bound``: each product's rounding differs between kernels by at most
    ``γ_k ≈ k u`` componentwise, ~``√k u`` in norm for well-spread matrices (``inner``: the
    longest inner dimension of the step's products); a factor rounded to ``factor_dtype``
    on the other side of a tie changes by ``u_f``; the error feedback and the warm start
    carry a step's difference into the next, so the bound grows with the steps. ``margin``
    8 as there. A wrong factor, a wrong side or a lost residual differ by O(1)."""
    u32, uf = unit_roundoff(torch.float32), unit_roundoff(factor_dtype)
    per_step = inner ** 0.5 * u32 + (uf if factor_dtype != torch.float32 else u32)
    return margin * steps * per_step


def rounded_once_bound(dtype: torch.dtype, drift: float) -> float:
    """``‖rn(y') - y‖ <= tol ‖y‖`` for ``y'`` an fp32 result within ``drift`` (relative,
    Frobenius: :func:`two_paths_bound`) of the reference ``y``, rounded once to ``dtype``:
    round to nearest gives ``|rn(x) - x| <= u |x|`` element-wise (no under/overflow), so
    ``‖rn(y') - y'‖ <= u ‖y'‖ <= u (1 + drift) ‖y‖``, plus ``‖y' - y‖ <= drift ‖y‖``. No
    margin on ``u``: it is a hard bound (one bf16 rounding of well-spread values measures
    about 0.42 u, ``u_bf16 = 2⁻⁸``); a factor off by more than ~u or a lost residual
    exceed it, a second rounding or a truncation (0.7-0.85 u) need an element-wise check."""
    u = unit_roundoff(dtype)
    return u * (1 + drift) + drift
