"""Comparisons of two code paths that compute the same mathematics with different kernels
(``docs/tests.md``): bit-equality holds only where the same code sees the same data; BLAS
picks kernels by CPU, shape, stride and alignment, so two paths agree to their rounding."""

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u`` of a floating dtype: half its machine epsilon (2^-24 for fp32, 2^-9 for bf16)."""
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
