"""fp16 with megatron-core's loss scaler in this project's trainer (issue 63), on 4 gloo
processes (TP1·PP2·DP2): dense, static and EDGC train to dense fp16's loss; an overflow on
one rank skips the step everywhere, halves the scale and loses nothing; a scale that
changes gives the run of a fixed scale. (The exact resume across a scale change is a
variant of ``test_checkpoint.py``'s resume test.)"""

import math
import statistics

import pytest
import torch

from distributed import LAYOUTS, assert_dp_replicas_identical, read_jsonl, run_job

ITERS = 30
#: fp16 at a scale a 30-iteration run settles from, growing every 10 iterations
FP16 = ["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "10"]


def fp16_run(small_model_argv, tmp_path, name, *extra, iters=ITERS):
    metrics = str(tmp_path / f"{name}.jsonl")
    argv = (small_model_argv + LAYOUTS["tp1-pp2-dp2"] + FP16
            + ["--train-iters", str(iters), "--eval-interval", str(iters),
               "--metrics-file", metrics, *extra])
    results = run_job(argv, str(tmp_path / name))
    summary = next(r["summary"] for r in results if r["summary"])
    return results, read_jsonl(metrics), summary, open(tmp_path / name / "stdout.txt").read()


def test_fp16_dense_static_and_edgc_reach_dense_fp16s_loss(small_model_argv, tmp_path):
    """Dense fp16 on three seeds gives the spread; static rank 4 and EDGC (DP and pipeline)
    end inside it. Every run ends finite with bit-identical DP replicas; the summary counts
    the scaler's skips and scale changes, and the compressing runs their compressed
    iterations."""
    dense = []
    for seed in (1234, 1235, 1236):
        results, records, summary, _ = fp16_run(small_model_argv, tmp_path, f"dense{seed}",
                                                "--seed", str(seed), "--edgc-mode", "off")
        dense.append(statistics.mean(r["loss"] for r in records[-10:]))
    lo, hi = min(dense), max(dense)
    spread = hi - lo
    runs = {
        "static": ("--edgc-mode", "static", "--edgc-rank", "4"),
        "edgc": ("--edgc-mode", "edgc", "--edgc-window", "4", "--edgc-iter-sample-rate", "1.0",
                 "--edgc-rank-max", "8", "--edgc-rank-min", "2", "--edgc-rank-step", "2",
                 "--edgc-warmup-max-iters", "6", "--edgc-pp-compression", "edgc",
                 "--edgc-pp-rank-max", "8", "--edgc-pp-rank-min", "2"),
    }
    for name, extra in runs.items():
        results, records, summary, stdout = fp16_run(small_model_argv, tmp_path, name, *extra)
        loss = statistics.mean(r["loss"] for r in records[-10:])
        assert lo - spread <= loss <= hi + spread, (name, loss, dense)
        assert all(math.isfinite(r["loss"]) for r in records)
        for r in results:
            assert all(torch.isfinite(t).all() for t in r["params"].values())
        assert assert_dp_replicas_identical(results) > 0
        skipped = sum(r["skipped"] for r in records)
        changes = sum(a["loss_scale"] != b["loss_scale"] for a, b in zip(records, records[1:]))
        assert summary["skipped_iterations"] == skipped
        assert summary["loss_scale_changes"] >= changes >= 2, (summary, changes)
        assert f"| {skipped} skipped | {summary['loss_scale_changes']} loss-scale changes" \
            in stdout
        # issue 71: compressing in fp16, the gradient buffers are fp32 (the start-up line)
        assert "(fp32 gradients," in stdout, stdout[:2000]
        compressed = summary["compression"]["dp_iterations_compressed"]
        applied_with_rank = [sum(1 for r in records if not r["skipped"] and r["rank_dp"]
                                 and r["rank_dp"][s] is not None) for s in range(2)]
        assert compressed == applied_with_rank and min(compressed) > 0, (compressed, records)


#: the overflow: iteration 6 (1-based) of 8, static rank 4 on several buckets per stage
OVERFLOW_AT = 5


@pytest.mark.parametrize("buffers", ["fp32", "fp16"])
def test_an_overflow_on_one_rank_skips_the_step_everywhere_and_loses_nothing(
        small_model_argv, tmp_path, buffers):
    """An Inf in DP rank 1's first bucket of one bucket group at iteration 6, several
    buckets per stage, the gradient buffers compression keeps by default (fp32) and fp16
    ones (``--no-accumulate-allreduce-grads-in-fp32``, issue 81: the residuals then reach
    fp16 gradients): the step is skipped on every rank, the scale
    halves (hysteresis 1), and every bucket follows the skip rule exactly: a finite
    bucket's residual is the ``M = G + E`` it did not apply, a bucket with the Inf keeps
    its ``E`` and ``Q`` bit for bit, the same on every DP rank. What the sync left (the
    rule before issue 63: the finite buckets' sent part dropped with the skipped step)
    fails that rule. The run ends finite, replicas identical."""
    argv = (["--inject-overflow-at", str(OVERFLOW_AT)] + small_model_argv
            + LAYOUTS["tp1-pp2-dp2"] + FP16
            + ["--train-iters", "8", "--eval-interval", "8", "--hysteresis", "1",
               "--edgc-mode", "static", "--edgc-rank", "4", "--overlap-grad-reduce",
               "--bucket-size", "40000", "--metrics-file", str(tmp_path / "m.jsonl")]
            + (["--no-accumulate-allreduce-grads-in-fp32"] if buffers == "fp16" else []))
    results = run_job(argv, str(tmp_path / "out"))
    want = torch.float16 if buffers == "fp16" else torch.float32
    assert {b.dtype for r in results for b in r["grad_buffers"]} == {want}
    records = read_jsonl(str(tmp_path / "m.jsonl"))
    assert [r["skipped"] for r in records] == [r["iteration"] == OVERFLOW_AT + 1
                                             for r in records]
    scale = records[OVERFLOW_AT]["loss_scale"]
    assert records[OVERFLOW_AT + 1]["loss_scale"] == scale / 2
    assert all(math.isfinite(r["loss"]) for r in records)
    assert assert_dp_replicas_identical(results) > 0
    bad = finite = 0
    # a bucket that holds the Inf on any DP rank of its stage (the flag is summed)
    with_inf = {(r["pp"], c["key"]) for r in results for c in r["overflow_capture"]
                if not c["bucket_finite"]}
    assert len({(r["pp"], c["key"]) for r in results for c in r["overflow_capture"]}) \
        > len(with_inf) == 2, with_inf   # one bucket per stage: the others finite
    for r in results:
        for c in r["overflow_capture"]:
            if (r["pp"], c["key"]) in with_inf:   # the failing bucket: as before the step
                assert torch.equal(c["E_after"], c["E_before"])
                assert torch.equal(c["Q_after"], c["Q_before"])
                bad += 1
                continue
            err = ((c["E_after"] - c["M"]).norm() / c["M"].norm()).item()
            assert err < 1e-5, (c["key"], c["shape"], err)
            # the sync alone (the rule before issue 63) left M - P^ Qᵀ: far from M
            stale = ((c["E_synced"] - c["M"]).norm() / c["M"].norm()).item()
            assert stale > 0.05, (c["key"], c["shape"], stale)
            finite += 1
    assert bad > 0 and finite > 0
    # the DP replicas of a stage hold the same warm starts
    for a in results:
        for b in results:
            if a["pp"] == b["pp"] and a["dp"] < b["dp"]:
                for ca, cb in zip(a["overflow_capture"], b["overflow_capture"]):
                    assert torch.equal(ca["Q_after"], cb["Q_after"])


@pytest.mark.parametrize("pp", [pytest.param("off", marks=pytest.mark.extended), "static"])
def test_a_changing_loss_scale_gives_the_fixed_scale_run(small_model_argv, tmp_path, pp):
    """Static rank 4 (and the pipeline's compression at rank 4): a scale that starts at 2^10
    and doubles every 3 iterations (4 changes in 14) against a fixed 2^12, the same data:
    the losses agree to fp16's rounding (the products of a power-of-2 scale are exact but
    for fp16's subnormals). With the residual read in the units it was formed at (the
    code before issue 63, ``EDGC_TEST_STALE_UNITS``), they do not."""
    import os

    common = (small_model_argv + LAYOUTS["tp1-pp2-dp2"]
              + ["--fp16", "--train-iters", "14", "--eval-interval", "14", "--edgc-mode",
                 "static", "--edgc-rank", "4", "--edgc-pp-compression", pp,
                 "--edgc-pp-rank", "4"])
    changing = ["--initial-loss-scale", "1024", "--loss-scale-window", "3"]

    def losses(name, extra, env=None):
        metrics = str(tmp_path / f"{name}.jsonl")
        run_job(common + extra + ["--metrics-file", metrics], str(tmp_path / name),
                env=env)
        return read_jsonl(metrics)

    fixed = losses("fixed", ["--loss-scale", "4096"])
    moving = losses("changing", changing)
    scales = [r["loss_scale"] for r in moving]
    assert not any(r["skipped"] for r in fixed + moving)
    assert len(set(scales)) >= 4 and scales[0] == 1024, scales
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(fixed, moving))
    assert gap < 2e-3, [(a["loss"], b["loss"]) for a, b in zip(fixed, moving)]
    stale = losses("stale", changing, env={**os.environ, "EDGC_TEST_STALE_UNITS": "1"})
    stale_gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(fixed, stale))
    assert stale_gap > max(10 * gap, 5e-3), (gap, stale_gap)   # measured 2.6e-4 vs 2.1e-2


def test_edgc_under_a_changing_scale_measures_the_fixed_scale_entropies_and_ranks(
        small_model_argv, tmp_path):
    """Issue 71: GDS measures the gradients net of the loss scale. EDGC (DP and pipeline)
    with a scale that doubles every 3 iterations from 2^10, against a fixed 2^12 on the
    same data: every measured entropy agrees to fp16's rounding, and so do the ranks the
    controller chose. (Taken on the scaled gradients, the entropy moved by ln 2 = 0.69 nats
    at every doubling, and CQM read each as a rise.)"""
    common = (small_model_argv + LAYOUTS["tp1-pp2-dp2"]
              + ["--fp16", "--train-iters", "14", "--eval-interval", "14", "--edgc-mode",
                 "edgc", "--edgc-window", "3", "--edgc-iter-sample-rate", "1.0",
                 "--edgc-rank-max", "8", "--edgc-rank-min", "2", "--edgc-rank-step", "2",
                 "--edgc-warmup-max-iters", "3", "--edgc-pp-compression", "edgc",
                 "--edgc-pp-rank-max", "8", "--edgc-pp-rank-min", "2",
                 "--edgc-dac", "off"])   # DAC's ranks follow measured times: not repeatable

    def records(name, extra):
        metrics = str(tmp_path / f"{name}.jsonl")
        run_job(common + extra + ["--metrics-file", metrics], str(tmp_path / name))
        return read_jsonl(metrics)

    fixed = records("fixed", ["--loss-scale", "4096"])
    moving = records("changing", ["--initial-loss-scale", "1024", "--loss-scale-window", "3"])
    assert len({r["loss_scale"] for r in moving}) >= 4
    assert not any(r["skipped"] for r in fixed + moving)
    measured = [(a, b) for a, b in zip(fixed, moving) if "entropy" in a]
    assert len(measured) == len(fixed) and all("entropy" in b for _, b in measured)
    gap = max(abs(x - y) for a, b in measured for x, y in zip(a["entropy"], b["entropy"]))
    pp_gap = max(abs(a["entropy_pp"] - b["entropy_pp"]) for a, b in measured
                 if a.get("entropy_pp") is not None and math.isfinite(a["entropy_pp"]))
    assert gap < 0.1 and pp_gap < 0.1, (gap, pp_gap)   # measured 0.028 and 2e-4; ln 2 = 0.69
    for key in ("rank_cqm", "rank_dp", "rank_pp"):
        assert [r.get(key) for r in fixed] == [r.get(key) for r in moving], key
    assert len({str(r["rank_dp"]) for r in fixed}) >= 3   # the controller moved the rank


@pytest.mark.parametrize("mode,setting,want", [
    ("static", None, True), ("edgc", None, True), ("off", None, False),
    ("static", False, False), ("off", True, True)])
def test_compression_in_fp16_keeps_fp32_gradient_buffers_by_default(mode, setting, want):
    """Issue 71 item 8: a compressed result written into fp16 buffers overflowed where the
    dense sum did not (BENCHMARKS.md "fp16: does compression add overflows?"), so a
    compressing fp16 run keeps and reduces its gradients in fp32 unless told otherwise;
    a dense run keeps Megatron's default (fp16 buffers)."""
    from megatron_edgc.config import parse_values

    flags = {None: [], True: ["--accumulate-allreduce-grads-in-fp32"],
             False: ["--no-accumulate-allreduce-grads-in-fp32"]}[setting]
    import os

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "configs", "tiny-cpu.yaml")
    cfg = parse_values(["--config", config, "--fp16", "--edgc-mode", mode, *flags])
    assert cfg.fp16_grads_in_fp32 is want
