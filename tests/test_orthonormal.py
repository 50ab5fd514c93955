"""The orthonormalization under a model of a GPU's rounding (issue 56): no factorization
fails on finite input at the shapes users train, by construction, and the fp32-Gram method
of before the issue fails under the same model."""

import os
import sys

import pytest
import torch

from gpu_rounding import ForcedTf32, GpuRounding
from megatron_edgc.compression.orthonormal import (GRAM_SHIFT, ORTHOGONALITY_BOUND,
                                                   cholesky_safe_shift, orthonormalize)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.model import shard_matrices  # noqa: E402
from bench.orthonormal_before import fp32_gram_orthonormalize  # noqa: E402

VOCAB = 50304


def factor_rows() -> dict:
    """Rows of ``P`` (both orientations: ``n`` of the flat step, ``m`` of the slow hop's)
    of GPT-2 medium and XL (TP 1) and of the paper configs' TP shards, -> their names."""
    models = {"GPT-2 medium": (24, 1024, 4096, 1), "GPT-2 XL": (48, 1600, 6400, 1),
              "2.5B TP4 shard": (54, 1920, 7680, 4), "12.1B TP8 shard": (60, 4096, 16384, 8)}
    rows: dict = {}
    for name, (layers, hidden, ffn, tp) in models.items():
        mats, _ = shard_matrices(layers, hidden, ffn, VOCAB, tp, 1)
        for n, m in set(mats):
            for rows_of_p in (n, m):
                rows.setdefault(rows_of_p, []).append(name)
    return rows


ROWS = factor_rows()
RANKS = (64, 128, 256)
SHAPES = [(n, r) for n in sorted(ROWS) for r in RANKS if 2 * r <= n]


def factors(kind: str, n: int, r: int, seed: int) -> torch.Tensor:
    """``[k, n, r]`` factors ``P`` from well spread to one dominant direction (``k`` 2, 1
    above 8192 rows: batching is the same code, and CI's time is short).

    * ``spread``: Gaussian;
    * ``decaying``: singular values from 1 down to 1e-7 (warm-started PowerSGD);
    * ``dominant``: one direction and 1e-4 noise (early training; the H200's Grams had a
      largest eigenvalue of 50-63 of 64);
    * ``deficient``: rank r/4, then a zero column (a frozen weight's rows);
    * ``norms``: Gaussian columns whose norms span 1e-6 to 1e2."""
    gen = torch.Generator().manual_seed(seed)
    k = 2 if n <= 8192 else 1
    if kind == "spread":
        return torch.randn(k, n, r, generator=gen)
    if kind == "norms":
        return torch.randn(k, n, r, generator=gen) * torch.logspace(-6, 2, r)
    if kind == "decaying":   # Gaussian columns are orthogonal to ~1/√n: U S Vᵀ nearly
        u = torch.randn(k, n, r, generator=gen) / n ** 0.5
        v = torch.linalg.qr(torch.randn(k, r, r, generator=gen))[0]
        return (u * torch.logspace(0, -7, r)) @ v.transpose(1, 2)
    if kind == "dominant":
        return (torch.randn(k, n, 1, generator=gen) * torch.randn(k, 1, r, generator=gen)
                + 1e-4 * torch.randn(k, n, r, generator=gen))
    assert kind == "deficient"
    p = torch.randn(k, n, r // 4, generator=gen) @ torch.randn(k, r // 4, r, generator=gen)
    p[:, :, -1] = 0
    return p


def assert_orthonormal_basis_of(q: torch.Tensor, p: torch.Tensor, missed_at_most: float):
    """``q`` finite, orthonormal to :data:`ORTHOGONALITY_BOUND`, and spanning ``p``:
    ``‖P - Q Qᵀ P‖_F <= missed_at_most ‖P‖_F`` per matrix."""
    r = q.shape[-1]
    assert torch.isfinite(q).all()
    qd, pd = q.double(), p.double()
    gram = qd.transpose(1, 2) @ qd
    err = (gram - torch.eye(r, dtype=torch.float64)).abs().amax()
    assert err <= ORTHOGONALITY_BOUND, err.item()
    missed = torch.linalg.matrix_norm(pd - qd @ (qd.transpose(1, 2) @ pd)) / \
        torch.linalg.matrix_norm(pd)
    assert (missed <= missed_at_most).all(), missed.tolist()


@pytest.mark.parametrize("n,r", SHAPES, ids=[f"{n}x{r}" for n, r in SHAPES])
def test_no_factorization_fails_under_a_gpu_rounding_model(n, r):
    """At every factor shape of GPT-2 medium and XL and of the paper's shards, ranks 64 to
    256, for ``P`` from well spread to one dominant direction and rank-deficient, with the
    Cholesky inputs perturbed as a GPU's rounding at ``c = 10`` (and the factor NaN where
    it fails, as cuSOLVER's): no factorization fails, nothing stands in, the basis is
    orthonormal and spans ``P`` (all but directions below the span threshold)."""
    for seed, kind in enumerate(("spread", "decaying", "dominant", "deficient")):
        p = factors(kind, n, r, seed)
        stood_in = []
        with GpuRounding(c=10, n=n) as device:
            q = orthonormalize(p, stood_in=stood_in)
        assert device.calls == 3 and device.dtypes == {torch.float64}
        assert device.failed == 0, (kind, device.failed)
        assert not stood_in[0].any(), kind
        # decaying: directions below ~GRAM_SHIFT^(1/2) of the norm may go (1e-7 .. 3e-3)
        missed = 3e-3 if kind == "decaying" else 1e-4
        assert_orthonormal_basis_of(q, p, missed_at_most=missed)


KINDS = ("spread", "decaying", "dominant", "deficient", "norms")
#: In ``make test``: each model's widest and narrowest rows at rank 256 (or the largest rank
#: that fits) and GPT-2 medium's at 64; every shape under ``-m extended`` (53 s here).
TF32_CI = {(480, 128), (512, 256), (1024, 64), (1024, 256), (1600, 256), (1920, 256),
           (12576, 256), (50304, 256)}
TF32_SHAPES = [pytest.param(n, r, id=f"{n}x{r}",
                            marks=() if (n, r) in TF32_CI else pytest.mark.extended)
               for n, r in SHAPES]


@pytest.mark.parametrize("n,r", TF32_SHAPES)
def test_orthonormal_under_forced_tf32(n, r):
    """Under TF32 forced on every fp32 product (NVIDIA's containers:
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``; emulated by rounding fp32 operands to 10
    mantissa bits), at every factor shape of GPT-2 medium/XL and the paper's shards, for
    every kind of ``P`` the step produces: orthonormal to ``ORTHOGONALITY_BOUND`` and
    spanning ``P`` as without TF32, nothing stood in. The products are fp64 (issue 64)."""
    for seed, kind in enumerate(KINDS):
        p = factors(kind, n, r, seed)
        stood_in = []
        with ForcedTf32():
            q = orthonormalize(p, stood_in=stood_in)
        assert not stood_in[0].any(), kind
        missed = 3e-3 if kind == "decaying" else 1e-4
        assert_orthonormal_basis_of(q, p, missed_at_most=missed)


@pytest.mark.parametrize("n,r", [(1024, 64), (4096, 256), (12576, 128)])
def test_fp32_products_miss_the_bound_under_forced_tf32(n, r, monkeypatch):
    """The emulation has teeth: with the basis's products in fp32 (before issue 64, where
    ``torch.backends.cuda.matmul`` cannot turn forced TF32 off) the output is not
    orthonormal to the bound; the fp64 products' is, on the same input. Their cost on this
    CPU: docs/method.md."""
    from megatron_edgc.compression import orthonormal

    p = torch.cat([factors(kind, n, r, seed) for seed, kind in enumerate(KINDS)])

    def orthogonality(q):
        qd = q.double()
        return (qd.transpose(1, 2) @ qd - torch.eye(r, dtype=torch.float64)).abs().amax()

    with ForcedTf32() as tf32:
        fp64 = orthogonality(orthonormalize(p))
    assert tf32.calls == 0 and fp64 <= ORTHOGONALITY_BOUND   # no fp32 product left
    monkeypatch.setattr(orthonormal, "PRODUCT_DTYPE", torch.float32)
    with ForcedTf32() as tf32:
        fp32 = orthogonality(orthonormalize(p))
    assert tf32.calls > 0 and fp32 > 10 * ORTHOGONALITY_BOUND, fp32.item()


@pytest.mark.parametrize("n,r", [(3072, 128), (4096, 128), (1024, 64)])
def test_the_fp32_gram_method_of_before_fails_under_the_same_model(n, r):
    """The model has teeth: the orthonormalization of before issue 56 (fp32 Grams, the
    shift ``max(1e-5, 1e-6 ‖G‖_F)``) stands a fixed basis in for matrices of GPT-2
    medium's shapes at ``c = 3``, as the H100 did in training."""
    p = torch.cat([factors("spread", n, r, 1), factors("dominant", n, r, 2)])
    stood_in = []
    with GpuRounding(c=3, n=n) as device:
        fp32_gram_orthonormalize(p, stood_in=stood_in)
    assert device.failed > 0 and stood_in[0].any()


def test_the_safe_shift_is_far_below_the_span_threshold_in_fp64_and_impossible_in_fp32():
    """The derivation behind "succeeds by construction": in fp64 the shift that makes any
    Gram's Cholesky succeed is 7.5e-9 at the largest shape (padded vocabulary rows, rank
    256), 1300x below the span threshold the first passes use anyway; in fp32 it would be
    4.0, above the Gram's own scale: no shift can save an fp32 Gram at these widths."""
    assert cholesky_safe_shift(VOCAB, 256) < 1e-8 and 1000 * 1e-8 <= GRAM_SHIFT
    assert cholesky_safe_shift(VOCAB, 256, torch.float32) > 1
    # and the model's perturbation at c = 10 stays below it at every shape (Weyl:
    # ‖E‖₂ <= ‖E‖_F ~ c √n u r for unit diagonals)
    u = torch.finfo(torch.float64).eps / 2
    assert all(10 * n ** 0.5 * u * r < cholesky_safe_shift(n, r) for n, r in SHAPES)


def test_the_fixed_basis_is_orthonormal_built_on_the_device_and_bounded():
    """The null-space fill and the stand-in basis (issue 64): orthonormal columns to fp32's
    rounding at every factor shape; built from indices on the device (no tensor is made on
    the host: the step makes no host copy, hence no sync, at a new shape); one per row
    count whatever the ranks asked (a rank's basis is the widest one's first columns); no
    column a constant direction."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_edgc.compression import orthonormal

    for n, r in [(64, 64), (1024, 256), (50304, 256), (7, 3)]:
        f = orthonormal.fixed_basis(n, r, "cpu").double()
        assert (f.T @ f - torch.eye(r, dtype=torch.float64)).abs().max() < 1e-6, (n, r)
        if 64 <= n and r < n:   # a constant (a gradient's mean) is no column's direction
            assert (f.sum(0).abs() / n ** 0.5).max() < 0.3, (n, r)

    class Devices(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.seen.add(t.device.type)
            return out

    with Devices() as made:
        orthonormal.fixed_basis(300, 20, "meta")
    assert made.seen == {"meta"}
    orthonormal._BASES.clear()
    for r in (4, 8, 16, 8, 4):
        basis = orthonormal.fixed_basis(512, r, "cpu")
        assert basis.shape == (512, r)
    assert [tuple(b.shape) for b in orthonormal._BASES.values()] == [(512, 16)]
    assert torch.equal(orthonormal.fixed_basis(512, 8, "cpu"),
                       orthonormal._BASES[(512, "cpu")][:, :8])


def test_a_fill_in_the_span_of_p_stands_in_instead_of_a_basis_that_is_not_orthonormal():
    """The contrived input of issue 64: ``P``'s only nonzero column is a column of the fill,
    at another column's place. The fill then duplicates ``P``'s direction and the last
    pass's Gram is singular; before, the output came back with ``max |P^ᵀP^ - I|`` = 1.0
    in all 12 placements, unflagged. Step 4's factor has a pivot below
    ``FILL_DEFICIENT`` there: the fixed basis stands in (orthonormal; here it spans ``P``
    too, the fill being part of it) and ``stood_in`` says so. Inputs the step produces
    never trip it (the GPU-rounding and TF32 tests assert nothing stands in)."""
    from megatron_edgc.compression.orthonormal import fixed_basis

    n, r = 2000, 4
    fill = fixed_basis(n, r, "cpu")
    for a in range(r):
        for b in range(r):
            if a == b:
                continue
            p = torch.zeros(1, n, r)
            p[0, :, b] = fill[:, a]
            stood_in = []
            q = orthonormalize(p, stood_in=stood_in)
            assert stood_in[0].tolist() == [True], (a, b)
            assert_orthonormal_basis_of(q, p, missed_at_most=1e-6)


def test_the_method_by_device_and_the_gpu_keeps_the_tested_one():
    """Issue 93: the step orthonormalizes per shape group with :func:`orthonormalize` on a
    GPU (the method the tests above hold, unchanged), batched on the host; a per-group
    function that is not :func:`orthonormalize` (a benchmark's, a test's) runs per group
    everywhere. Decided without running anything on the device."""
    from megatron_edgc.compression import orthonormal

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert orthonormal.orthonormalization("cuda", dtype) == orthonormal.PER_GROUP
        assert orthonormal.orthonormalization(torch.device("cuda", 1), dtype) == \
            orthonormal.PER_GROUP
    assert orthonormal.orthonormalization("cpu", torch.float32) == orthonormal.BATCHED
    p = [torch.randn(2, 64, 8), torch.randn(1, 32, 8)]
    seen = []
    orthonormal.orthonormalize_step(p, [], lambda x, stood_in: seen.append(x.shape) or x)
    assert seen == [(2, 64, 8), (1, 32, 8)]


@pytest.mark.parametrize("n,r", TF32_SHAPES)   # the same shapes in CI and extended
def test_the_hosts_batched_method_meets_the_bound_on_every_kind_of_p(n, r):
    """The host's method (:func:`orthonormalize_batched`: fp64 Grams, IEEE fp32 products,
    every factor of a rank in one chain of ``[r, r]`` calls) on the same adversarial
    factors at the same shapes, batched together with a second height: orthonormal to
    ``ORTHOGONALITY_BOUND`` and spanning ``P`` as the GPU's, nothing stood in, and the
    bits of one matrix the same batched or alone."""
    from megatron_edgc.compression.orthonormal import orthonormalize_batched

    ps = [factors(kind, n, r, seed) for seed, kind in enumerate(KINDS)]
    ps.append(factors("spread", 2 * r, r, 9))
    stood_in = []
    qs = orthonormalize_batched(ps, stood_in=stood_in)
    assert [s.shape[0] for s in stood_in] == [p.shape[0] for p in ps]
    for kind, q, p, s in zip(KINDS + ("other height",), qs, ps, stood_in):
        assert not s.any(), kind
        assert q.dtype == torch.float32 and q.shape == p.shape
        assert_orthonormal_basis_of(q, p, missed_at_most=3e-3 if kind == "decaying" else 1e-4)


def test_the_hosts_batched_method_stands_in_as_the_gpus_does():
    """Zero, rank-deficient and non-finite factors, a fill in the span of ``P`` (issue
    64's input) and failing factorizations (NaN from ``cholesky_ex``, as the job tests
    inject it): the host's method gives a unit vector per missing direction, non-finite
    output for non-finite input (not stood in), and the fixed basis, flagged, where a
    factorization failed; three ``cholesky_ex`` calls per rank, whatever the groups."""
    from megatron_edgc.compression.orthonormal import fixed_basis, orthonormalize_batched

    n, r = 2000, 4
    fill = fixed_basis(n, r, "cpu")
    span = torch.zeros(1, n, r)
    span[0, :, 1] = fill[:, 0]
    nan = torch.randn(1, 300, r)
    nan[0, 7, 2] = float("nan")
    ps = [torch.zeros(2, 100, r), span, nan, factors("deficient", 256, 16, 3)[:, :, :r]]
    stood_in = []
    qs = orthonormalize_batched(ps, stood_in=stood_in)
    assert [s.tolist() for s in stood_in] == [[False, False], [True], [False], [False, False]]
    assert_orthonormal_basis_of(qs[0], torch.randn(2, 100, r), missed_at_most=1.0)
    assert torch.equal(qs[1][0], fill)
    assert not torch.isfinite(qs[2]).all()
    assert_orthonormal_basis_of(qs[3], ps[3], missed_at_most=1e-4)

    calls = []
    original = torch.linalg.cholesky_ex

    def failing(a, **kw):
        calls.append(a.shape)
        out = original(a, **kw)
        return type(out)((torch.full_like(out.L, float("nan")), out.info + 1))

    torch.linalg.cholesky_ex = failing
    try:
        stood_in = []
        ps = [torch.randn(3, 64, 8), torch.randn(1, 512, 8), torch.randn(2, 64, 4)]
        qs = orthonormalize_batched(ps, stood_in=stood_in)
    finally:
        torch.linalg.cholesky_ex = original
    assert sorted(calls) == sorted([(4, 8, 8)] * 3 + [(2, 4, 4)] * 3)
    assert all(s.all() for s in stood_in)
    for q, p in zip(qs, ps):
        assert torch.equal(q, fixed_basis(p.shape[1], p.shape[2], "cpu").expand_as(q))
