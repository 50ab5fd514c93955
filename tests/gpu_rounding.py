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


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to TF32 (10 mantissa bits, to nearest), as a tensor core reads
    an fp32 operand when TF32 is on."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).view_as(x)


class ForcedTf32:
    """Context manager: every fp32 ``bmm``/``baddbmm``/``matmul``/``@`` rounds its operands
    to TF32 first, as NVIDIA's PyTorch containers do on a GPU with
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1`` whatever ``torch.backends.cuda.matmul`` says;
    products in other dtypes (fp64) are untouched, as there. ``calls`` counts the fp32
    products rounded."""

    NAMES = ("bmm", "baddbmm", "matmul")

    def __init__(self):
        self.calls = 0

    def _wrap(self, fn, operands):
        def rounded(*args, **kwargs):
            if all(isinstance(a, torch.Tensor) and a.dtype == torch.float32
                   for a in args[operands]):
                self.calls += 1
                args = tuple(to_tf32(a) if i in range(*operands.indices(len(args)))
                             and isinstance(a, torch.Tensor) else a
                             for i, a in enumerate(args))
            return fn(*args, **kwargs)
        return rounded

    def __enter__(self):
        self.saved = {name: getattr(torch, name) for name in self.NAMES}
        self.saved_matmul_op = torch.Tensor.__matmul__
        for name in self.NAMES:   # baddbmm(input, a, b): the product's operands a, b
            operands = slice(1, 3) if name == "baddbmm" else slice(0, 2)
            setattr(torch, name, self._wrap(self.saved[name], operands))
        torch.Tensor.__matmul__ = self._wrap(self.saved_matmul_op, slice(0, 2))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch, name, fn)
        torch.Tensor.__matmul__ = self.saved_matmul_op
