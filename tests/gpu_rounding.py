"""A model of a GPU's rounding in the orthonormalization, on CPU (issue 56).

On an H100, GPT-2 medium's Cholesky factorizations failed within 25-40 iterations where
LAPACK on this CPU never did: the Gram matrices a GPU computes round differently (other
summation orders, other kernels) and cuSOLVER's Cholesky gives NaN where it fails (LAPACK
finite garbage). :class:`GpuRounding` perturbs every ``torch.linalg.cholesky_ex`` input
``A`` by a symmetric ``E`` with ``E_ij = c √n u √(A_ii A_jj) z_ij`` (``z`` standard normal,
seeded; ``u`` the unit roundoff of ``A``'s dtype; ``n`` the rows the Gram was summed over)
— the size of a Gram's rounding error with random signs, ``c`` times — and returns a NaN
factor where the perturbed factorization fails. ``c = 1`` matches the H200's measured
deficit at ``[256, 64]`` (issue 50).
"""

from __future__ import annotations

import torch


class GpuRounding:
    """Context manager: while it is active, ``torch.linalg.cholesky_ex`` is the modelled
    device's. ``failed`` counts the matrices whose factorization failed, ``calls`` the
    calls, ``dtypes`` the input dtypes seen."""

    def __init__(self, c: float, n: int, seed: int = 56):
        self.c, self.n = c, n
        self.failed = self.calls = 0
        self.dtypes: set = set()
        self.gen = torch.Generator().manual_seed(seed)

    def perturbation(self, a: torch.Tensor) -> torch.Tensor:
        z = torch.randn(a.shape, generator=self.gen, dtype=torch.float64)
        z = (z + z.transpose(-1, -2)) / 2 ** 0.5
        d = a.diagonal(dim1=-2, dim2=-1).double().clamp_min(0).sqrt()
        u = torch.finfo(a.dtype).eps / 2
        return (self.c * self.n ** 0.5 * u) * d.unsqueeze(-1) * d.unsqueeze(-2) * z

    def __enter__(self):
        self.original = torch.linalg.cholesky_ex

        def device_cholesky_ex(a, **kw):
            self.calls += 1
            self.dtypes.add(a.dtype)
            perturbed = (a.double() + self.perturbation(a)).to(a.dtype)
            out = self.original(perturbed, **kw)
            bad = out.info > 0
            self.failed += int(bad.sum())
            return type(out)((out.L.masked_fill(bad[..., None, None], float("nan")),
                              out.info))

        torch.linalg.cholesky_ex = device_cholesky_ex
        return self

    def __exit__(self, *exc):
        torch.linalg.cholesky_ex = self.original
