"""GDS: estimators against analytic Gaussian entropy; sampling is seeded and cheap."""

import math

import pytest
import torch

from megatron_edgc.control.entropy import GradientSampler, gaussian_entropy, histogram_entropy


@pytest.mark.parametrize("sigma", [1e-4, 1e-2, 1.0])
def test_estimators_match_analytic_gaussian_entropy(sigma):
    torch.manual_seed(0)
    x = torch.randn(200_000, dtype=torch.float64) * sigma
    analytic = 0.5 * math.log(2 * math.pi * math.e * sigma ** 2)
    assert abs(gaussian_entropy(x) - analytic) < 0.01
    assert abs(histogram_entropy(x) - analytic) < 0.02


def test_histogram_sees_heavy_tails_gaussian_does_not():
    torch.manual_seed(0)
    t = torch.distributions.StudentT(2.5).sample((200_000,)).double()
    # For heavy tails the Gaussian model overestimates the entropy of the bulk.
    assert histogram_entropy(t) < gaussian_entropy(t) - 0.05


def test_sampler_is_seeded_identical_across_ranks_and_redrawn_per_window():
    a = GradientSampler(10_000, grad_sample_rate=0.25, seed=3)
    b = GradientSampler(10_000, grad_sample_rate=0.25, seed=3)
    assert torch.equal(a.indices(0), b.indices(0))            # same set on every DP rank
    assert a.indices(0).numel() == 2500 and a.indices(0).max() < 10_000
    assert not torch.equal(a.indices(0), a.indices(1))        # redrawn each window
    assert GradientSampler(10, grad_sample_rate=1.0).indices(0) is None


def test_iteration_sampling():
    s = GradientSampler(100, iter_sample_rate=0.1)
    assert [i for i in range(30) if s.should_sample(i)] == [0, 10, 20]
    assert all(GradientSampler(100, iter_sample_rate=1.0).should_sample(i) for i in range(5))


@pytest.mark.parametrize("bad", [dict(iter_sample_rate=0), dict(grad_sample_rate=1.5),
                                 dict(estimator="kde")])
def test_bad_rates(bad):
    with pytest.raises(ValueError):
        GradientSampler(100, **bad)
