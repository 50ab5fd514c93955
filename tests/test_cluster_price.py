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


def test_the_h200_step_is_read_from_its_checks():
    """The step priced is the H200's of 2026-11-28 (issue 72): the off checks' compute per
    gradient-buffer dtype, the static checks' math at r64, the EDGC checks' largest GDS."""
    step = cp.h200_step()
    assert step["device"] == "NVIDIA H200" and step["date"] == "2026-11-28"
    assert step["compute_ms"] == pytest.approx({"fp32": 169.5629, "bf16": 175.7946}, abs=1e-3)
    assert sorted(step["math_ms"]) == [(64, "bf16", pytest.approx(22.6306, abs=1e-3)),
                                       (64, "fp32", pytest.approx(15.7464, abs=1e-3))]
    assert step["gds_ms"] == pytest.approx({"fp32": 62.846, "bf16": 77.252}, abs=1e-2)


def test_math_by_rank_and_iteration_total():
    fp32, bf16 = (dict((g, ms) for _, g, ms in cp.STEP["math_ms"])[g] for g in ("fp32", "bf16"))
    assert cp.math_ms("static r_max", 64) == pytest.approx(fp32)
    assert cp.math_ms("static r_max", 32) == pytest.approx(fp32)       # held below 64
    assert cp.math_ms("static r_max", 32, scale=2.0) == pytest.approx(2 * fp32)
    assert cp.math_ms("static r_max bf16", 32) == pytest.approx(bf16)
    assert cp.math_ms("EDGC", None) == 0.0 and cp.math_ms("bf16 wire", 32) == 0.0
    total = cp.iteration_ms("static r_max", 32, 10, 8, 100.0)
    comm = 1e3 * cp.comm_s("static r_max", 32, 10, 8, 100.0, SHAPES)
    assert total == pytest.approx(169.5629 + fp32 + comm, abs=1e-3)
    assert cp.iteration_ms("static r_max", 32, 10, 8, 100.0, overlap=True) == \
        pytest.approx(169.5629 + fp32, abs=1e-3)              # comm hidden under compute
    # bf16 buffers: their own compute
    assert cp.iteration_ms("dense bf16", None, 10, 8, 100.0, overlap=True) == \
        pytest.approx(175.7946, abs=1e-3)


def test_priced_run_warm_up_dense_then_compressed():
    """EDGC: two dense iterations then two at rank 32; the target reached at the last
    evaluation, half-way between the two evaluations' losses."""
    recs = [{"iteration": 1, "rank_dp": [None]},
            {"iteration": 2, "rank_dp": [None], "val_loss": 6.0},
            {"iteration": 3, "rank_dp": [32]}, {"iteration": 4, "rank_dp": [32], "val_loss": 5.0}]
    sampler = cp.sampler_ms(20, 0.25)
    assert sampler == pytest.approx(cp.STEP["gds_ms"]["fp32"] / 20)   # once per window
    assert cp.sampler_ms(20, 0.25, "bf16", every_sample=True) == \
        pytest.approx(5 * cp.STEP["gds_ms"]["bf16"] / 20)           # 5 sampled iterations
    got = cp.price_run("EDGC", recs, 5.5, 64, 10.0, sampler=sampler)
    dense = cp.iteration_ms("EDGC", None, 1, 64, 10.0) + sampler
    comp = cp.iteration_ms("EDGC", 32, 3, 64, 10.0) + sampler
    assert got["iters"] == pytest.approx(3.0)
    assert got["s"] == pytest.approx((2 * dense + comp) / 1e3)
    assert got["ms"] == pytest.approx((dense + comp) / 2)


def test_sensitivity_reprices_ours_and_the_peer_alike():
    """price(): each sensitivity variant prices the peer the same way; doubling the math
    raises static PowerSGD's ratio to a dense peer (whose iterations have no math) by the
    math added, halving lowers it; the table says which variant a row is."""
    curve = [{"iteration": i, "rank_dp": [32], **({"val_loss": 6.0 - i / 10} if i % 2 == 0
                                                  else {})} for i in range(1, 11)]
    data = {"loss": {"dense fp32": {1: [dict(r, rank_dp=[None]) for r in curve]},
                     "static r_max": {1: curve}}}
    out = cp.price(data, 20, 0.25)
    row = next(r for r in out["rows"] if r["mode"] == "static r_max" and r["gpus"] == 8
               and r["gbit"] == 10.0)
    math = cp.math_ms("static r_max", 32)
    comm_c = 1e3 * cp.comm_s("static r_max", 32, 3, 8, 10.0, SHAPES)
    comm_d = 1e3 * cp.comm_s("dense fp32", None, 3, 8, 10.0, SHAPES)
    compute = cp.STEP["compute_ms"]["fp32"]
    for variant, scale in (("s_math_half", 0.5), ("s_math_double", 2.0)):
        [ratio] = row["sensitivity"][variant]
        assert ratio == pytest.approx((compute + scale * math + comm_c) / (compute + comm_d),
                                      rel=1e-6)
    assert row["sensitivity"]["s_math_half"][0] < row["vs_best_peer"][0] < \
        row["sensitivity"]["s_math_double"][0]
    text = cp.sensitivity_table(out, 8)
    assert "| static r_max | math x2 |" in text and "GDS on every sample" in text


def test_a_diloco_dense_warmup_pays_the_gradient_allreduce():
    """A DiLoCo arm after a dense warm-up (marked by bench.peers.mark_dense_warmup): its
    warm-up iterations pay one fp32 gradient all-reduce each, the rest the pseudo-gradient's
    all-reduce amortized over H."""
    from bench import peers

    whole = allreduce_s(4 * PARAMS, 8, 10.0, cp.ALPHA_US)
    assert cp.comm_s("DiLoCo H8", None, 50, 8, 10.0, SHAPES) == pytest.approx(whole / 8)
    assert cp.comm_s("DiLoCo H8", None, 50, 8, 10.0, SHAPES, dense_warmup=True) == \
        pytest.approx(whole)
    recs = peers.mark_dense_warmup([{"iteration": i, "rank_dp": None} for i in range(1, 5)]
                                   + [{"iteration": 5, "rank_dp": None, "val_loss": 5.0}], 2)
    compute = cp.STEP["compute_ms"]["fp32"]
    got = cp.price_run("DiLoCo H8", recs, 5.0, 8, 10.0)
    assert got["s"] == pytest.approx((5 * compute + 1e3 * (2 * whole + 3 * whole / 8)) / 1e3)
