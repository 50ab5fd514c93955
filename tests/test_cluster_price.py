"""bench/cluster_price.py's arithmetic: bytes per mode, collective times, priced runs."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import cluster_price as cp  # noqa: E402
from bench.model import allreduce_s  # noqa: E402

SHAPES = cp.medium_shapes()
PARAMS = 354_871_296    # GPT-2 medium at vocab 50304: dp_bytes_dense / 4 measured on the H100
LAT = 2 * 63 * cp.ALPHA_US * 1e-6   # latency of one ring all-reduce over 64 GPUs


def test_dense_bytes_are_the_parameters():
    assert cp.n_params(SHAPES) == PARAMS
    assert cp.mode_bytes("dense fp32", None, SHAPES) == [("allreduce", 4 * PARAMS)]
    for mode in ("bf16 wire", "ours dense bf16 wire", "dense bf16"):
        assert cp.mode_bytes(mode, None, SHAPES) == [("allreduce", 2 * PARAMS)]
    # a dense mode stays dense whatever its record says
    assert cp.mode_bytes("dense fp32", 32, SHAPES) == [("allreduce", 4 * PARAMS)]


def test_bf16_allreduce_is_half_the_fp32_one_less_latency():
    fp32 = cp.comm_s("dense fp32", None, 10, 64, 10.0, SHAPES)
    bf16 = cp.comm_s("bf16 wire", None, 10, 64, 10.0, SHAPES)
    assert bf16 - LAT == pytest.approx((fp32 - LAT) / 2)
    assert fp32 - LAT == pytest.approx(2 * 63 / 64 * 4 * PARAMS * 8 / 10e9)


def test_powersgd_bytes():
    mats, rest = SHAPES
    factors = sum(32 * (n + m) for n, m in mats)
    ours = sum(b for _, b in cp.mode_bytes("static r_max", 32, SHAPES))
    assert ours == factors * 2 + rest * 4                   # bf16 P, Q; fp32 rest
    bf16 = sum(b for _, b in cp.mode_bytes("static r_max bf16", 32, SHAPES))
    assert bf16 == factors * 2 + rest * 2                   # the rest in bf16 too
    hook = sum(b for _, b in cp.mode_bytes("hook r_max", 32, SHAPES))
    assert hook == factors * 4 + rest * 4                   # torch's hook: all fp32
    wrapped = sum(b for _, b in cp.mode_bytes("hook r_max bf16", 32, SHAPES))
    assert wrapped == factors * 2 + rest * 2                # in bf16_compress_wrapper
    assert sum(b for _, b in cp.mode_bytes("hook r_max bf16", None, SHAPES)) == \
        2 * (sum(n * m for n, m in mats) + rest)            # its warm-up: a bf16 all-reduce
    # the H100 run's measured dp_bytes_sent at r64 (fp32 buffers / bf16 buffers)
    assert sum(b for _, b in cp.mode_bytes("static r_max", 64, SHAPES)) == \
        pytest.approx(58_449_924, abs=8)
    assert sum(b for _, b in cp.mode_bytes("EDGC bf16 grads", 64, SHAPES)) == \
        pytest.approx(57_806_850, abs=8)


def test_local_sgd_is_an_eighth_of_a_parameter_allreduce():
    whole = allreduce_s(4 * PARAMS, 64, 25.0, cp.ALPHA_US)
    assert cp.comm_s("local SGD /8", None, 1, 64, 25.0, SHAPES) == pytest.approx(whole)
    assert cp.comm_s("local SGD /8", None, 50, 64, 25.0, SHAPES) == pytest.approx(whole / 8)


def test_uint8_is_two_allgathers():
    chans = -(-PARAMS // 512)
    expect = 2 * 63 * cp.ALPHA_US * 1e-6 + 63 * (chans * 8 + chans * 512) * 8 / 10e9
    assert cp.comm_s("uint8", None, 10, 64, 10.0, SHAPES) == pytest.approx(expect)
    # 64 ranks each receive 63 payloads: dearer than the fp32 all-reduce
    assert expect > cp.comm_s("dense fp32", None, 10, 64, 10.0, SHAPES)


def test_math_by_rank_and_iteration_total():
    assert cp.math_ms("static r_max", 64) == pytest.approx(15.957)
    assert cp.math_ms("static r_max", 32) == pytest.approx(15.957)       # held below 64
    assert cp.math_ms("EDGC", 96) == pytest.approx((15.957 + 23.143) / 2)
    assert cp.math_ms("static r_max bf16", 32) == pytest.approx(26.783)
    assert cp.math_ms("EDGC", None) == 0.0 and cp.math_ms("bf16 wire", 32) == 0.0
    total = cp.iteration_ms("static r_max", 32, 10, 8, 100.0)
    comm = 1e3 * cp.comm_s("static r_max", 32, 10, 8, 100.0, SHAPES)
    assert total == pytest.approx(210.8 + 15.957 + comm)
    assert cp.iteration_ms("static r_max", 32, 10, 8, 100.0, overlap=True) == \
        pytest.approx(210.8 + 15.957)                       # comm hidden under compute


def test_priced_run_warm_up_dense_then_compressed():
    """EDGC: two dense iterations then two at rank 32; the target reached at the last
    evaluation, half-way between the two evaluations' losses."""
    recs = [{"iteration": 1, "rank_dp": [None]},
            {"iteration": 2, "rank_dp": [None], "val_loss": 6.0},
            {"iteration": 3, "rank_dp": [32]}, {"iteration": 4, "rank_dp": [32], "val_loss": 5.0}]
    sampler = cp.sampler_ms(20, 0.25)
    assert sampler == pytest.approx((3278.9 + 4 * 1.434) / 20)
    got = cp.price_run("EDGC", recs, 5.5, 64, 10.0, sampler=sampler)
    dense = cp.iteration_ms("EDGC", None, 1, 64, 10.0) + sampler
    comp = cp.iteration_ms("EDGC", 32, 3, 64, 10.0) + sampler
    assert got["iters"] == pytest.approx(3.0)
    assert got["s"] == pytest.approx((2 * dense + comp) / 1e3)
    assert got["ms"] == pytest.approx((dense + comp) / 2)
