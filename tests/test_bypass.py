"""The bypass's cost model and the error-feedback hand-over, one process."""

import pytest
import torch

from megatron_edgc.compression.bypass import LinkModel, compression_pays, compression_saving_s
from megatron_edgc.compression.powersgd import FLOAT_BYTES, BucketCompressor


def test_link_fit_recovers_alpha_beta_and_clamps_noise():
    link = LinkModel(2e-4, 1e-9)
    sizes = [1e3, 1e6, 4e6]
    fitted = LinkModel.fit(sizes, [link.allreduce_s(b) for b in sizes])
    assert fitted.alpha_s == pytest.approx(2e-4) and fitted.s_per_byte == pytest.approx(1e-9)
    assert fitted.gbit_per_s == pytest.approx(8.0)
    # noise that tilts the fit below zero: a fast link, clamped, never a negative time
    tilted = LinkModel.fit([1e3, 4e6], [5e-3, 4e-3])
    assert tilted.s_per_byte == 0.0 and tilted.alpha_s == pytest.approx(4.5e-3)
    assert LinkModel.declared(8.0).s_per_byte == pytest.approx(1e-9)
    with pytest.raises(ValueError):
        LinkModel.fit([1e3, 1e3], [1e-3, 2e-3])


def test_break_even_both_sides():
    """A 1024x1024 matrix at rank 8: the saving is 2(α)... exactly dense - P - Q on the link;
    compression pays on 1 Gbit/s and not on 10 Tbit/s against 1 ms of math."""
    comp = BucketCompressor([("w", (1024, 1024))], 8)
    first, second = comp.collective_numels()
    assert (first, second) == (1024 * 8 + 1, 1024 * 8)
    dense = comp.dense_numel() * FLOAT_BYTES
    slow, fast = LinkModel.declared(1.0, 1e-4), LinkModel.declared(1e4, 1e-4)
    saving = compression_saving_s(slow, dense, first * 4, second * 4)
    assert saving == pytest.approx(-1e-4 + (dense - (first + second) * 4) * 8e-9)
    assert compression_pays(slow, dense, first * 4, second * 4, cost_s=1e-3)
    assert not compression_pays(fast, dense, first * 4, second * 4, cost_s=1e-3)
    # a bucket with nothing to compress never pays: one more element and no fewer bytes
    tiny = BucketCompressor([("b", (1, 64))], 8)
    f, s = tiny.collective_numels()
    assert s == 0 and not compression_pays(slow, 64 * 4, f * 4, 0, cost_s=0.0)


def test_absorb_residual_hands_the_whole_error_to_the_dense_message():
    torch.manual_seed(0)
    comp = BucketCompressor([("a", (64, 32)), ("b", (64, 32)), ("bias", (1, 32))], 2)
    grads = [torch.randn(64, 32), torch.randn(64, 32), torch.randn(1, 32)]
    bufs, step = comp.start(grads)
    comp.finish(step, comp.middle(step, bufs))       # one compressed step, one process
    residuals = [g.residual.clone() for g in comp.groups.values()][0]
    assert residuals.abs().sum() > 0
    fresh = [torch.randn(64, 32), torch.randn(64, 32), torch.randn(1, 32)]
    before = [t.clone() for t in fresh]
    comp.absorb_residual(fresh)
    assert torch.equal(fresh[0], before[0] + residuals[0])
    assert torch.equal(fresh[1], before[1] + residuals[1])
    assert torch.equal(fresh[2], before[2])
    assert all(g.residual.abs().sum() == 0 for g in comp.groups.values())
    q = [g.q.clone() for g in comp.groups.values()][0]
    held = [t.clone() for t in before]
    bufs, step = comp.start(held)                   # next compressed step: warm start kept
    assert torch.equal(held[0], before[0]) and torch.equal(held[1], before[1])  # M = G + 0
    assert torch.equal([g.q for g in comp.groups.values()][0], q)


def test_each_first_phase_collective_pays_its_latency():
    link = LinkModel(alpha_s=1e-3, s_per_byte=1e-9)
    one = compression_saving_s(link, 10_000, 600, 400)
    two = compression_saving_s(link, 10_000, [200, 400], 400)
    assert one - two == pytest.approx(link.alpha_s)
