"""--edgc-debug-dump and scripts/replay_step.py (issue 50): a step flagged non-finite is
captured at the first such iteration and replayed phase by phase with no process group,
naming the first phase whose output is not finite."""

import glob
import importlib.util
import os

import pytest
import torch

from megatron_edgc.patches import ddp
from test_powersgd import cusolver_failing_everywhere
from test_host_sync import compressed_dp_step, compression_of, fake_ddp_chunk
from test_host_sync import one_process_group  # noqa: F401  (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def replay_script():
    spec = importlib.util.spec_from_file_location(
        "replay_step", os.path.join(ROOT, "scripts", "replay_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fault", ["factorization", "gradient"])
def test_the_first_flagged_step_is_captured_and_its_replay_names_the_phase(
        one_process_group, tmp_path, monkeypatch, capsys, fault):
    chunk = fake_ddp_chunk()
    compression = compression_of(chunk, one_process_group, factor_dtype=torch.bfloat16,
                                 debug_dump=str(tmp_path))
    gen = torch.Generator().manual_seed(4)
    events = []
    for it in range(4):
        compression.set_iteration(it)
        compression.prepare_iteration()
        with monkeypatch.context() as m:
            if fault == "factorization" and it >= 2:
                cusolver_failing_everywhere(m)
            compressed_dp_step(compression, chunk, gen,
                               nan_in=1 if fault == "gradient" and it >= 2 else None)
        events += compression.stats.take().events
    files = sorted(f for f in glob.glob(str(tmp_path / "*.pt"))
                   if not f.endswith(".factors.pt"))
    factor_files = sorted(glob.glob(str(tmp_path / "*.factors.pt")))
    # iteration 3 (1-based) only: both buckets with the failed factorization, bucket 1
    # with the NaN gradient; iteration 4 failed alike and wrote nothing
    buckets = ["bucket0", "bucket1"] if fault == "factorization" else ["bucket1"]
    assert [os.path.basename(f) for f in files] == \
        [f"iter3-rank0-chunk0.group0.{b}.pt" for b in buckets]
    cause = "a failed factorization, or non-finite factors, from finite gradients" \
        if fault == "factorization" else "non-finite gradient"
    assert factor_files == ([f[:-len(".pt")] + ".factors.pt" for f in files]
                            if fault == "factorization" else [])
    captured = [e for e in events if "step captured" in e]
    assert captured == [f"chunk0.group0.{b} ({cause}): step captured in {f} "
                        f"(python scripts/replay_step.py {f})" for b, f in zip(buckets, files)]
    rec = torch.load(files[-1], weights_only=True)
    assert rec["cause"] == cause and rec["factor_dtype"] == "torch.bfloat16"
    assert {g["n"] for g in rec["groups"]} == {64, 48}
    assert all("p_sum" in g and "q_sum" in g for g in rec["groups"])

    replay = replay_script()
    capsys.readouterr()
    with monkeypatch.context() as m:   # the device as it was: the failure reproduces
        if fault == "factorization":
            cusolver_failing_everywhere(m)
        assert replay.main([files[-1]]) == 0
    out = capsys.readouterr().out
    first = out.strip().splitlines()[-1]
    group = rec["groups"][0]["key"]
    if fault == "factorization":
        assert first == (f"first non-finite phase: {group}: orthonormalize "
                         f"2. two shifted CholeskyQR passes")
        assert f"ok          {group}: orthonormalize 1. unit columns" in out
        assert f"ok          {group}: orthonormalize 5. a fixed basis where a " \
            f"factorization failed" in out   # the stand-in: the step lost nothing
        assert replay.main(files) == 0   # on the CPU as it is: no failure
        out = capsys.readouterr().out
        assert out.count("every phase finite on cpu: the failure did not reproduce here\n") \
            == 2, out
        # the factors that stood in (issue 56: what a GPU run brings back), every matrix of
        # every group, replayed batched and one at a time: they stand in again on the
        # failing device, and not on this CPU
        factors = torch.load(factor_files[-1], weights_only=True)
        assert [(g["key"], g["indices"]) for g in factors["groups"]] == \
            [(g["key"], list(range(len(g["names"])))) for g in rec["groups"]]
        assert all(torch.equal(f["p"], g["p_sum"])
                   for f, g in zip(factors["groups"], rec["groups"]))
        with monkeypatch.context() as m:
            cusolver_failing_everywhere(m)
            assert replay.main([factor_files[-1]]) == 0
        out = capsys.readouterr().out
        for g in rec["groups"]:
            k = len(g["names"])
            assert f"  {g['key']} batched: {k} of {k} stood in" in out
            assert f"  {g['key']} one at a time: {k} of {k} stood in" in out
        assert replay.main([factor_files[-1]]) == 0
        out = capsys.readouterr().out
        assert out.count(" stood in (smallest eigenvalue") == 2 * len(rec["groups"])
        assert " 1 of " not in out and all(f"{0} of {len(g['names'])} stood in" in out
                                           for g in rec["groups"])
    else:
        assert first == f"first non-finite phase: {group}: input: gradient G"
