"""``--edgc-ef-dtype auto`` (issue 57): the residual's dtype chosen from a measurement, and
the dense sync's bookkeeping of a residual that is known zero."""

import pytest
import torch

from megatron_edgc.compression import ef_dtype
from megatron_edgc.compression.powersgd import BucketCompressor

SHAPES = [(256, 64), (64, 64), (256, 64)]


def fixed(fp32_ms, bf16_ms):
    """An ``agree`` that replaces the measured timings (the job's MAX in the runtime)."""
    return lambda times: torch.tensor([fp32_ms, bf16_ms, bf16_ms / fp32_ms],
                                      dtype=torch.float64)


@pytest.mark.parametrize("fp32_ms,bf16_ms,chosen", [
    (10.0, 20.0, torch.bfloat16),    # at the GPU limit, 2x: bf16 kept (its memory)
    (10.0, 20.5, torch.float32),     # beyond it
    (10.0, 6.0, torch.bfloat16)])    # faster
def test_gpu_keeps_bf16_within_its_limit(fp32_ms, bf16_ms, chosen, monkeypatch):
    monkeypatch.setitem(ef_dtype.BF16_MAX_COST, "cpu", 2.0)   # the GPU's rule, on this host
    dtype, a, b = ef_dtype.choose_ef_dtype(SHAPES, torch.float32, torch.device("cpu"),
                                           fixed(fp32_ms, bf16_ms))
    assert dtype == chosen and (a, b) == (fp32_ms, bf16_ms)


def test_the_host_keeps_fp32_untimed():
    """On the host bf16 saves nothing it lacks: fp32 whatever a timing would say (so two
    runs under different load decide alike: resumes reproduce)."""
    assert ef_dtype.BF16_MAX_COST["cuda"] == 2.0 and ef_dtype.BF16_MAX_COST["cpu"] == 1.0
    assert ef_dtype.choose_ef_dtype(SHAPES, torch.float32, torch.device("cpu"),
                                    fixed(10.0, 1.0)) == (torch.float32, 0.0, 0.0)
    assert ef_dtype.choose_ef_dtype([], torch.float32, torch.device("cpu")) == \
        (torch.float32, 0.0, 0.0)


def test_a_rank_without_matrices_joins_with_zeros(monkeypatch):
    """Every rank calls ``agree`` (a collective in the runtime), with or without matrices."""
    monkeypatch.setitem(ef_dtype.BF16_MAX_COST, "cpu", 2.0)
    seen = []
    dtype, _, _ = ef_dtype.choose_ef_dtype([], torch.float32, torch.device("cpu"),
                                           lambda t: seen.append(t.tolist()) or t)
    assert seen == [[0.0, 0.0, 0.0]] and dtype == torch.float32


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_timings_are_of_the_largest_shape_and_both_dtypes(grad_dtype, monkeypatch):
    calls = []
    monkeypatch.setattr(ef_dtype, "_round_trip_ms",
                        lambda dtype, g, shape, count, device: calls.append(
                            (dtype, g, shape, count)) or 1.0)
    times = ef_dtype.time_ef_dtypes(SHAPES, grad_dtype, torch.device("cpu"))
    count = ef_dtype.SAMPLE_ELEMENTS // (256 * 64)
    assert times.tolist() == [1.0, 1.0, 1.0]
    assert calls == [(torch.float32, grad_dtype, (256, 64), count),
                     (torch.bfloat16, grad_dtype, (256, 64), count)]
    # a matrix beyond the sample: one row block of it
    calls.clear()
    ef_dtype.time_ef_dtypes([(1 << 20, 64)], grad_dtype, torch.device("cpu"))
    assert calls[0][2:] == ((ef_dtype.SAMPLE_ELEMENTS // 64, 64), 1)


def test_round_trip_leaves_the_residual_it_measures_finite():
    ms = ef_dtype._round_trip_ms(torch.bfloat16, torch.bfloat16, (32, 16), 3,
                                 torch.device("cpu"))
    assert 0.0 < ms < 1e4


def test_a_dense_sync_adds_a_residual_once_and_then_nothing():
    """After a compressed step the residual goes into the next dense message (nothing
    lost); a second dense sync adds nothing: the residual is known zero, so the dense
    wire may scale in its cast (``BucketPlan.scales_in_cast``)."""
    torch.manual_seed(0)
    comp = BucketCompressor([(f"w{i}", s) for i, s in enumerate(SHAPES)], 4, seed=0)
    assert comp.state.clear
    grads = [torch.randn(s) for s in SHAPES]
    bufs, step = comp.start(grads)
    comp.finish(step, comp.middle(step, bufs))
    comp.after_step(applied=True)
    assert not comp.state.clear
    residual = {k: g.residual.clone() for k, g in comp.groups.items()}
    assert sum(r.abs().sum() for r in residual.values()) > 0
    dense = [torch.randn(s) for s in SHAPES]
    before = [d.clone() for d in dense]
    comp.absorb_residual(dense)
    assert not comp.state.clear     # kept until the step is applied (a skip keeps it)
    comp.after_step(applied=True)
    assert comp.state.clear
    added = sum((d - b).abs().sum() for d, b in zip(dense, before))
    assert torch.isclose(added, sum(r.abs().sum() for r in residual.values()), rtol=1e-5)
    again = [d.clone() for d in dense]
    comp.absorb_residual(dense)
    assert all(torch.equal(a, d) for a, d in zip(again, dense))
