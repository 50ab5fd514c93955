"""The plug-in in Megatron-LM's own ``pretrain_gpt.py``, two lines added, 4 gloo processes
(TP1·PP2·DP2), mock data, on each Megatron-LM tag of ``../shared/vendor`` whose environment
is here:

* core_v0.16.1 with megatron-core 0.16.x: the pinned venv (``make test``);
* core_v0.19.0 with megatron-core 0.19.x: Python 3.12 (``make venv312`` and
  ``make test-compat VERSIONS=0.19.2``, which installs it under build/compat/py3.12/).

A tag whose snapshot or environment is missing skips, saying which and how to get it.
``EDGC_MEGATRON_LM`` names another folder of snapshots (``megatron-lm-<tag>.tar.gz`` or an
unpacked ``megatron-lm-<tag>/``).
"""

import functools
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

import warm
from distributed import compressed_bucket_bytes
from rounding import relative_difference
from megatron_lm_job import (ARGS, EDGC, EDGC_DP, ENABLE_LINE, MAIN, PROVIDER, TORCH_DIST,
                            add_two_lines, lm_losses, read_records, torchrun_command,
                            unpack)
from test_faults import kill_rank_after, read_jsonl_lenient
from megatron_edgc.config import ModelConfig, ParallelConfig
from megatron_edgc.model_shapes import stage_param_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENDOR = os.environ.get("EDGC_MEGATRON_LM") or os.path.join(ROOT, "..", "shared", "vendor")
#: Megatron-LM tag -> the megatron-core release series it pairs with.
TAGS = {"core_v0.16.1": "0.16", "core_v0.19.0": "0.19"}

def _probe(python: str, pythonpath: str) -> tuple:
    """(Python X.Y, the megatron-core release it imports with ``pythonpath`` or None)."""
    code = ("import sys, importlib.metadata as m\n"
            "try: v = m.version('megatron-core')\nexcept m.PackageNotFoundError: v = ''\n"
            "print('%d.%d' % sys.version_info[:2], v)")
    probe = subprocess.run([python, "-c", code], env=dict(os.environ, PYTHONPATH=pythonpath),
                           capture_output=True, text=True, timeout=60)
    found = probe.stdout.split()
    return (found[0], found[1] if len(found) > 1 else None) if found else (None, None)


@functools.lru_cache(maxsize=None)
def environment(series: str):
    """(python, PYTHONPATH) running megatron-core ``series``, or a string saying why none:
    this interpreter, else a venv of the project with build/compat/py<its X.Y>/<series>.*
    (as ``make test-compat`` installs them)."""
    candidates = [(sys.executable, os.environ.get("PYTHONPATH", ""))]
    for python in sorted(glob.glob(os.path.join(ROOT, ".venv*", "bin", "python"))):
        version, _ = _probe(python, "")
        pattern = os.path.join(ROOT, "build", "compat", f"py{version}", f"{series}.*")
        candidates += [(python, target) for target in sorted(glob.glob(pattern))
                       if os.path.isfile(os.path.join(target, ".installed"))]
    for python, path in candidates:
        if (_probe(python, path)[1] or "").startswith(series + "."):
            return python, path
    return (f"no Python environment with megatron-core {series}.x here (for 0.19: "
            f"make venv312 && make test-compat VERSIONS=0.19.2)")


def test_readme_shows_the_two_lines_the_tests_add():
    """The README's two lines are the ones the tests here add to ``pretrain_gpt.py``, in
    both of its snippets (core_v0.19.0; core_v0.13.1 ... core_v0.16.1): line 1 first in
    the main block, line 2 the ``extra_args_provider``. Needs no Megatron-LM."""
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = fh.read()
    section = readme.split("\n## EDGC in your Megatron-LM job\n", 1)[1].split("\n## ", 1)[0]
    snippets = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(snippets) == 2, snippets
    for snippet in snippets:
        code = [line.split("#")[0].rstrip() for line in snippet.splitlines()]
        main = code.index(MAIN.rstrip("\n"))
        assert code[main + 1] == ENABLE_LINE.rstrip("\n"), snippet
        assert sum(line.strip() == PROVIDER for line in code) == 1, snippet


@pytest.fixture(scope="module", params=list(TAGS))
def megatron_lm(request, tmp_path_factory):
    """(directory of Megatron-LM, the unmodified pretrain_gpt.py, the two-line copy,
    (python, PYTHONPATH)) for one tag."""
    tag = request.param
    sources = [os.path.join(VENDOR, f"megatron-lm-{tag}{ext}") for ext in (".tar.gz", "")]
    source = next((s for s in sources if os.path.exists(s)), None)
    if source is None:
        pytest.skip(f"no Megatron-LM {tag} here: none of {', '.join(sources)}")
    env = environment(TAGS[tag])
    if isinstance(env, str):
        pytest.skip(f"Megatron-LM {tag}: {env}")
    where = unpack(source, str(tmp_path_factory.mktemp(f"megatron-lm-{tag}")))
    original, copy = add_two_lines(where)
    return where, original, copy, env


def megatron_lm_command(megatron_lm, script: str, extra: list, tmp_path, name: str,
                        nproc: int = 4):
    """(command, environment, EDGC metrics file) of one torchrun of ``script``."""
    where, _, _, (python, pythonpath) = megatron_lm
    metrics = str(tmp_path / f"{name}.jsonl")
    cmd = torchrun_command(python, script, ARGS + list(extra), nproc)
    if script != megatron_lm[1]:
        cmd += ["--edgc-metrics-file", metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([where, ROOT, pythonpath]))
    return cmd, env, metrics


def run_megatron_lm(megatron_lm, script: str, extra: list, tmp_path, name: str,
                    expect_ok: bool = True, nproc: int = 4):
    """One 4-process torchrun of ``script``; returns (output, Megatron's per-iteration lm
    losses, the EDGC metrics records)."""
    cmd, env, metrics = megatron_lm_command(megatron_lm, script, extra, tmp_path, name, nproc)
    proc = warm.run(cmd, env=env, cwd=str(tmp_path), timeout=300)
    out = proc.stdout + proc.stderr
    if expect_ok:
        assert proc.returncode == 0, out[-4000:]
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", out)]
    return out, losses, read_records(metrics)


def stage_bytes(rank, embedding_apart: bool = False, dense_bytes: int = 4) -> list:
    """DP bytes one replica of each stage sends at ``rank`` (None: dense), from the shapes:
    (n+m) r bf16 elements per compressed matrix, the rest dense at ``dense_bytes`` (fp32;
    bf16 buffers: 2), one flag per bucket (one bucket; ``embedding_apart``: the shared word
    embedding in a bucket of its own, as megatron-core lays it out for the distributed
    optimizer)."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                        max_position_embeddings=64, make_vocab_size_divisible_by=128)
    model.resolve()
    parallel = ParallelConfig(pipeline_model_parallel_size=2, data_parallel_size=2)
    stages = stage_param_shapes(model, parallel, vocab_size=1001)   # + EOD
    if not embedding_apart:   # bf16 factors
        return [compressed_bucket_bytes(shapes, rank, dense_bytes=dense_bytes)
                for shapes in stages]
    embedding = (1024, 64)
    return [compressed_bucket_bytes([s for s in shapes if tuple(s) != embedding], rank,
                                    dense_bytes=dense_bytes)
            + compressed_bucket_bytes([embedding], rank, dense_bytes=dense_bytes)
            for shapes in stages]


@pytest.fixture(scope="module")
def edgc_run(megatron_lm, tmp_path_factory):
    """One uninterrupted EDGC run of 8 iterations (DP and PP compression, TensorBoard)."""
    tmp = tmp_path_factory.mktemp("edgc")
    out, losses, records = run_megatron_lm(
        megatron_lm, megatron_lm[2], EDGC + ["--tensorboard-dir", str(tmp / "tb")], tmp, "edgc")
    return out, losses, records, str(tmp / "tb")


def test_mode_off_is_megatron_lm_and_edgc_trains_with_bytes_from_shapes(megatron_lm, edgc_run,
                                                                         tmp_path):
    _, unmodified, _ = run_megatron_lm(megatron_lm, megatron_lm[1], [], tmp_path, "plain")
    off_out, off, off_records = run_megatron_lm(megatron_lm, megatron_lm[2], [], tmp_path,
                                                "off")
    assert len(unmodified) == 8 and off == unmodified          # bitwise, as printed
    assert off_records == []                                   # nothing built, nothing logged
    # the summary says whether EDGC ran (issue 92)
    assert "| EDGC did not run (--edgc-mode off, --edgc-pp-compression off: dense)" in off_out
    out, losses, records, tb = edgc_run
    assert re.search(r"EDGC summary \| 8 iterations \|.*\| EDGC ran \(DP edgc, PP edgc\)\n",
                     out), out[-3000:]
    assert "DP compression (edgc): r_max: at rank 8 22 of 22 weight matrices compress" in out
    # Megatron-LM's line for iteration 2 prints the mean of iterations 1-2 (its loss
    # accumulator is first reset at iteration 2's log); every other line one iteration's.
    ours = [r["loss"] for r in records]
    assert len(losses) == 8 and ours[:1] + ours[2:] == pytest.approx(losses[:1] + losses[2:],
                                                                      rel=1e-6)
    assert (ours[0] + ours[1]) / 2 == pytest.approx(losses[1], rel=1e-6)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    assert losses[:2] == unmodified[:2]                        # dense warm-up
    dense = sum(stage_bytes(None)) * 2
    compressed = 0
    for rec in records:   # the trainer's record (runtime/frontend.py), iter_ms included
        assert {"iteration", "loss", "lr", "iter_ms", "tokens", "tokens_per_s", "grad_norm",
                "skipped"} <= rec.keys()
        assert rec["tokens"] == 8 * 64 and rec["iter_ms"] > 0
        ranks = rec["rank_dp"]
        if rec["iteration"] <= 2:
            assert ranks == [None, None]
            assert rec["dp_bytes_sent_job"] == rec["dp_bytes_dense_job"] >= dense
            continue
        compressed += 1
        assert all(2 <= r <= 8 for r in ranks), ranks
        want = 2 * sum(stage_bytes(r)[s] for s, r in enumerate(ranks))
        assert rec["dp_bytes_sent_job"] == want, (rec["iteration"], ranks)
        assert rec["dp_bytes_sent_job"] < rec["dp_bytes_dense_job"] / 5
        assert 4 <= rec["rank_pp"] <= 16 and rec["pp_bytes_sent_job"] < rec["pp_bytes_dense_job"]
    assert compressed == 6
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "edgc/dp_bytes_sent_job" in tags and "edgc/rank_dp/stage1" in tags
    assert "lm loss" in tags                                   # Megatron-LM's own, same file
    sent = [e.value for e in events.Scalars("edgc/dp_bytes_sent_job")]
    assert sent == [float(r["dp_bytes_sent_job"]) for r in records]


def test_resume_from_megatron_lm_checkpoint_is_exact(megatron_lm, edgc_run, tmp_path):
    """Save at 4 (exit), resume to 8: the same losses, ranks and bytes as one run of 8.
    At --log-interval 3 the records are written at 3, at the save (4), at 6 and at 8: the
    same records as the whole run's, written every iteration."""
    ckpt = str(tmp_path / "ckpt")
    whole = edgc_run[2]
    save = EDGC + ["--save", ckpt, "--save-interval", "4", "--log-interval", "3"]
    run_megatron_lm(megatron_lm, megatron_lm[2], save + ["--exit-interval", "4"], tmp_path,
                    "resumed")
    sidecars = sorted(os.listdir(os.path.join(ckpt, "iter_0000004", "edgc")))
    assert sidecars == [f"tp00_pp{p:03d}_dp{d:05d}.pt" for p in (0, 1) for d in (0, 1)]
    out, _, resumed = run_megatron_lm(megatron_lm, megatron_lm[2], save + ["--load", ckpt],
                                      tmp_path, "resumed")
    assert "no compressor state" not in out
    keys = ("iteration", "loss", "rank_dp", "rank_pp", "dp_bytes_sent_job", "pp_bytes_sent_job")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole]
    assert any(r["rank_dp"] != [8, 8] for r in whole[2:])      # the controller moved


OWN_LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "own_loop_job.py")


def run_own_loop(megatron_lm, tmp_path, *flags) -> tuple:
    """``tests/own_loop_job.py`` on 2 gloo processes (DP 2): (exit code, output)."""
    where, _, _, (python, pythonpath) = megatron_lm
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([where, ROOT, pythonpath]))
    proc = warm.run(torchrun_command(python, OWN_LOOP, list(flags), 2), env=env,
                    cwd=str(tmp_path), timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_a_loop_the_plug_in_does_not_reach_stops_before_its_first_step(megatron_lm, tmp_path):
    """Issue 92: a loop of one's own on megatron-core (GPTModel, DDP, optimizer, schedule;
    no Megatron-LM ``train_step``) trains 3 iterations without the plug-in; after
    ``enable()`` it stops at its first gradient sync, before any step, every rank alike,
    with one line naming the loop and what to do (before: it trained dense, without a word).
    Run from a module named as Megatron-Bridge's loop, the line names Megatron-Bridge."""
    rc, out = run_own_loop(megatron_lm, tmp_path)
    assert rc == 0, out[-4000:]
    losses = {}
    for rank_line in re.findall(r"own loop: iteration (\d) loss ([0-9.]+) step applied", out):
        losses.setdefault(int(rank_line[0]), []).append(float(rank_line[1]))
    assert sorted(losses) == [1, 2, 3] and all(len(v) == 2 for v in losses.values()), out
    assert sum(losses[3]) < sum(losses[1]) - 0.1, losses      # it trains
    assert out.count("own loop: done") == 2

    head = ("error: EDGC never engaged: megatron_edgc.megatron_lm.enable() was called, but the "
            "job reached its first gradient sync (megatron-core's DistributedDataParallel."
            "finish_grad_sync) in ")
    rc, out = run_own_loop(megatron_lm, tmp_path, "--enable")
    assert rc != 0 and out.count(head) == 1, out[-4000:]       # rank 0 says it, once
    line = out[out.index(head):].splitlines()[0]
    assert line.startswith(head + f"__main__.train at {OWN_LOOP}:"), line
    assert ("a loop the plug-in does not reach (it wraps Megatron-LM's "
            "megatron.training.training.train_step): the job would train dense. Train "
            "through Megatron-LM's pretrain(...) with the plug-in's two lines") in line, line
    assert "remove enable() to train dense on purpose" in line
    assert "own loop: iteration" not in out and "own loop: done" not in out

    rc, out = run_own_loop(megatron_lm, tmp_path, "--enable", "--as-bridge")
    assert rc != 0 and out.count(head) == 1, out[-4000:]
    line = out[out.index(head):].splitlines()[0]
    assert line.startswith(head + "Megatron-Bridge's loop, megatron.bridge.training.train."
                                  f"train at {OWN_LOOP}:"), line
    assert "this package has no Megatron-Bridge adapter: docs/megatron-lm.md#" in line
    assert "own loop: iteration" not in out


@pytest.mark.parametrize("flag, error", [
    (["--edgc-rank", "0"], "error: --edgc-rank: must be in [1, inf] (got 0)"),
    # Megatron-LM's default, which runs an iteration again after a failed check (issue 91)
    (["--rerun-mode", "validate_results"],
     "error: --rerun-mode: validate_results runs an iteration again (")])
def test_bad_edgc_flag_fails_before_any_process_group(megatron_lm, tmp_path, flag, error):
    out, losses, _ = run_megatron_lm(megatron_lm, megatron_lm[2],
                                     ["--edgc-mode", "static", *flag,
                                      "--pipeline-model-parallel-size", "1"], tmp_path,
                                     "bad", expect_ok=False, nproc=1)
    assert error in out
    assert "initializing torch distributed" not in out and losses == []


def test_torch_dist_async_saves_fail_cleanly_and_resume_exactly(megatron_lm, tmp_path):
    """Megatron-LM's default format as large jobs run it (distributed optimizer, bf16,
    ``--async-save``), on the slow hop: DP 4 as 2 distributed-optimizer instances of 2,
    bf16 gradient buffers. One run of 8 saves at 4 and cannot save at 8 (a file is in the
    way): it stops with one error line, and iteration 4 stays complete and named by
    ``latest``, with every rank's EDGC sidecar. From it a resumed run repeats iterations
    5-8 exactly; a run on half the DP size keeps the DP-invariant state (the ranks in
    force) and resets the per-replica one."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "iter_0000008").write_text("in the way")
    job = EDGC_DP + TORCH_DIST + INSTANCES + ["--grad-reduce-in-bf16"]   # INSTANCES: below
    save = job + ["--save", str(ckpt), "--save-interval", "4"]
    out, _, whole = run_megatron_lm(megatron_lm, megatron_lm[2], save, tmp_path, "whole",
                                    expect_ok=False)
    assert "compressing the slow hop only" in out and "(bf16 gradients," in out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-4000:]
    assert errors[0].startswith("error: --save: saving iteration 8 failed on rank 0: "
                                "NotADirectoryError: "), errors
    assert errors[0].endswith(f"; the last complete checkpoint is iteration 4 in {ckpt}, "
                              f"intact"), errors
    assert "Overwriting old incomplete" not in out      # our files alone are no stale ckpt
    assert [r["iteration"] for r in whole] == list(range(1, 9))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "iter_0000008",
                                        "latest_checkpointed_iteration.txt"]
    assert (ckpt / "iter_0000008").read_text() == "in the way"
    sidecars = ckpt / "iter_0000004" / "edgc"
    assert sorted(os.listdir(sidecars)) == [f"tp00_pp000_dp{d:05d}.pt" for d in range(4)]
    import torch

    for d in range(4):   # each rank's: its shard's residuals and the controller's state
        state = torch.load(sidecars / f"tp00_pp000_dp{d:05d}.pt", weights_only=False)
        assert state["iteration"] == 4 and state["coords"] == (0, 0, d, 0)
        assert state["layout"]["dp"] == 4 and state["layout"]["pp"] == 1
        assert set(state["extensions"]) == {"dp_compression", "edgc"}
        buckets = state["extensions"]["dp_compression"]["buckets"]
        residuals = [m["residual"] for b in buckets.values() for m in b["matrices"].values()]
        assert residuals and all(torch.isfinite(r).all() for r in residuals), d
        assert sum(float(r.abs().sum()) for r in residuals) > 0, d

    out, _, resumed = run_megatron_lm(megatron_lm, megatron_lm[2], job + ["--load", str(ckpt)],
                                      tmp_path, "resumed")
    assert "no compressor state" not in out and "did not fit" not in out
    keys = ("iteration", "loss", "rank_dp", "dp_bytes_sent_job", "dp_slow_hop_bytes_sent_job")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole[4:]]
    assert any(r["rank_dp"] != [8] for r in whole[2:])      # the controller moved
    assert all(r["dp_slow_hop_bytes_sent_job"] < r["dp_slow_hop_bytes_dense_job"]
               for r in whole[2:])                         # compressed across instances

    # half the DP size: 2 instances of 1 rank
    out, _, half = run_megatron_lm(megatron_lm, megatron_lm[2], job + ["--load", str(ckpt)],
                                   tmp_path, "dp2", nproc=2)
    assert "EDGC: resumed on another DP size; per-replica state reset" in out
    assert [r["iteration"] for r in half] == [5, 6, 7, 8]
    # The ranks in force for the window after the save come from the checkpoint.
    assert [r["rank_dp"] for r in half[:2]] == [r["rank_dp"] for r in whole[4:6]]
    assert half[0]["loss"] == pytest.approx(whole[4]["loss"], rel=1e-3)  # same samples


# ------------------------------------------------------------------ today's models

#: MoE on DP 4 (PP 1): 4 experts, expert parallelism 2 (expert-DP 2), top-2 router, the
#: alltoall dispatcher (gloo carries its ``all_to_all_single``), SequentialMLP experts.
MOE = ["--pipeline-model-parallel-size", "1", "--num-experts", "4",
       "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-router-topk", "2"]
#: Llama-style layers as Megatron-LM's Llama recipes set them, on the local spec: SwiGLU,
#: RoPE (unfused: the fused kernel is Transformer Engine's), grouped-query attention,
#: RMSNorm, no linear biases, untied embeddings; TP1·PP2·DP2.
LLAMA = ["--swiglu", "--position-embedding-type", "rope", "--no-rope-fusion",
         "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights"]


def _layer_norm(h):
    return [(h,), (h,)]


def moe_buckets() -> list:
    """Each DP rank's DDP buckets for :data:`MOE` (hidden 64, 2 layers, padded vocab 1024,
    FFN 256), as ``(expert, [shapes])``: the dense parameters, and the expert-parallel
    ones (2 local experts per layer: fc1, fc2 with biases); the router (weight [4, 64] and
    bias [4]) is a dense parameter, reduced over all four replicas."""
    h, f, e_local = 64, 256, 2
    layer = _layer_norm(h) + [(3 * h, h), (3 * h,), (h, h), (h,)] + _layer_norm(h) + \
        [(4, h), (4,)]
    dense = [(1024, h), (64, h)] + 2 * layer + _layer_norm(h)
    experts = 2 * e_local * [(f, h), (f,), (h, f), (h,)]
    return [(False, dense), (True, experts)]


def llama_stage_shapes() -> list:
    """Each stage's parameters for :data:`LLAMA` (hidden 64, 4 heads of 16, 2 query
    groups, Megatron-LM's SwiGLU FFN int(4·64·2/3 / 64)·64 = 128): stage 0 the input
    embedding and layer 1, stage 1 layer 2, the final RMSNorm and the untied output layer."""
    h, f = 64, 128
    layer = [(h,), (h + 2 * 2 * 16, h), (h, h), (h,), (2 * f, h), (h, f)]
    return [[(1024, h)] + layer, layer + [(h,), (1024, h)]]


def _check_model_job(megatron_lm, tmp_path, model: list, edgc: list, want_bytes,
                     compare_off: bool = True):
    """Mode off is bitwise Megatron-LM (``compare_off``); EDGC (torch_dist, distributed
    optimizer, bf16, async save at 4) trains, sends the bytes ``want_bytes(ranks)`` gives
    as ``(job, expert part of job)``, keeps every replica of every bucket bit-identical; a
    resume from 4 repeats 5-8 exactly."""
    plain = TORCH_DIST[:-1]   # no checkpoint: the same model and optimizer, no async save
    unmodified = None
    if compare_off:
        _, unmodified, _ = run_megatron_lm(megatron_lm, megatron_lm[1], model + plain,
                                           tmp_path, "plain")
        _, off, _ = run_megatron_lm(megatron_lm, megatron_lm[2], model + plain, tmp_path,
                                    "off")
        assert len(unmodified) == 8 and off == unmodified           # bitwise, as printed
    ckpt = str(tmp_path / "ckpt")
    run = model + edgc + TORCH_DIST + ["--edgc-check-replicas", "--save", ckpt,
                                       "--save-interval", "4"]
    out, losses, whole = run_megatron_lm(megatron_lm, megatron_lm[2], run, tmp_path, "whole")
    assert [r["iteration"] for r in whole] == list(range(1, 9))
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    if unmodified is not None:
        assert losses[:2] == unmodified[:2]                          # dense warm-up
    for rec in whole:
        assert rec["dp_replica_mismatches"] == 0, rec["iteration"]
        if want_bytes is None:   # the slow hop: its own check
            continue
        job, expert = want_bytes(rec["rank_dp"])
        if not any(rec["rank_dp"] or []):   # warm-up: Megatron's buckets, padded (distopt)
            assert rec["dp_bytes_sent_job"] == rec["dp_bytes_dense_job"] >= job
            assert rec.get("dp_expert_bytes_sent_job", 0) == \
                rec.get("dp_expert_bytes_dense_job", 0) >= expert
            continue
        assert rec["dp_bytes_sent_job"] == job, (rec["iteration"], rec["rank_dp"])
        assert rec.get("dp_expert_bytes_sent_job", 0) == expert, rec["iteration"]
        assert rec["dp_bytes_sent_job"] < rec["dp_bytes_dense_job"] / 5
    assert any(r["rank_dp"] != whole[2]["rank_dp"] for r in whole[3:])  # the controller moved
    # as if the job had died after saving 4: iteration 8 gone, ``latest`` at 4
    shutil.rmtree(os.path.join(ckpt, "iter_0000008"))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("4")
    out, _, resumed = run_megatron_lm(megatron_lm, megatron_lm[2],
                                      model + edgc + TORCH_DIST + ["--load", ckpt], tmp_path,
                                      "resumed")
    assert "no compressor state" not in out
    keys = ("iteration", "loss", "rank_dp", "dp_bytes_sent_job", "dp_bytes_dense_job")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole[4:]]
    return out, whole


@pytest.mark.extended   # 94 s a tag: make test-compat (the trainer's MoE resume and
# test_group_sync's expert-DP groups stay in make test)
def test_moe_expert_parallel_job(megatron_lm, tmp_path):
    """MoE with EP 2 on DP 4: dense buckets over DP (4), experts over expert-DP (2); the
    bytes of each group from the shapes at the controller's rank."""
    def want(ranks):
        rank = None if ranks is None else ranks[0]
        per_rank = {e: compressed_bucket_bytes(shapes, rank) for e, shapes in moe_buckets()}
        assert len(per_rank) == 2
        return 4 * (per_rank[False] + per_rank[True]), 4 * per_rank[True]

    out, whole = _check_model_job(megatron_lm, tmp_path, MOE, EDGC_DP, want)
    assert "| dense " in out and " + expert " in out                # the progress line
    # Resumed on EP 4 (one expert per rank, expert-DP 1): the rank controller's state is
    # kept, the per-replica one starts fresh. (Megatron's distributed-optimizer state does
    # not reshard across EP sizes here: the model is loaded, the optimizer starts fresh.)
    moe_ep4 = MOE[:MOE.index("--expert-model-parallel-size") + 1] + ["4"] + \
        MOE[MOE.index("--expert-model-parallel-size") + 2:]
    out, _, ep4 = run_megatron_lm(megatron_lm, megatron_lm[2],
                                  moe_ep4 + EDGC_DP + TORCH_DIST + [
                                      "--load", str(tmp_path / "ckpt"), "--no-load-optim",
                                      "--no-load-rng"], tmp_path, "ep4")
    assert "EDGC: resumed on another EP size; per-replica state reset (dp_compression)" in out
    assert [r["iteration"] for r in ep4] == [5, 6, 7, 8]
    assert [r["rank_dp"] for r in ep4[:2]] == [r["rank_dp"] for r in whole[4:6]]
    # expert-DP 1: the experts' buckets have no replica to reduce with: nothing sent
    assert all(r["dp_expert_bytes_sent_job"] == r["dp_expert_bytes_dense_job"] == 0
               for r in ep4)


@pytest.mark.extended   # 80 s a tag: make test-compat (CI's make test keeps under 20 min)
def test_llama_style_job(megatron_lm, tmp_path):
    """SwiGLU, RoPE, GQA, RMSNorm, no biases, untied embeddings on TP1·PP2·DP2 with DP and
    PP compression."""
    stages = llama_stage_shapes()

    def want(ranks):
        ranks = ranks or [None] * len(stages)
        return 2 * sum(compressed_bucket_bytes(s, r) for s, r in zip(stages, ranks)), 0

    _check_model_job(megatron_lm, tmp_path, LLAMA, EDGC, want)


#: Megatron's partial distributed optimizer (multi-data-centre training): DP 4 as 2
#: instances of 2 ranks; EDGC compresses each rank's shard across instances only.
INSTANCES = ["--pipeline-model-parallel-size", "1", "--num-distributed-optimizer-instances",
             "2"]


@pytest.mark.extended   # 70 s a tag: make test-compat
def test_partial_distributed_optimizer_job(megatron_lm, tmp_path):
    """Mode off is Megatron-LM's partial distributed optimizer bitwise; EDGC compresses the
    slow hop only (the reduce-scatter inside an instance stays dense), every replica stays
    bit-identical, the loss falls and a resume is exact (the checks of the models above)."""
    out, whole = _check_model_job(megatron_lm, tmp_path, INSTANCES, EDGC_DP, None)
    assert "compressing the slow hop only" in out and "| slow hop " in out
    for rec in whole:
        if not any(rec["rank_dp"] or []):     # warm-up: the shards go dense across
            assert rec["dp_slow_hop_bytes_sent_job"] == rec["dp_slow_hop_bytes_dense_job"]
            continue
        assert rec["dp_slow_hop_bytes_sent_job"] < rec["dp_slow_hop_bytes_dense_job"] / 8
        # inside the instance: the dense reduce-scatter and the gathers of the factors
        # (P rows, Q slices: factor-sized, fp32), exact in tests/test_group_sync.py
        rs = rec["dp_bytes_dense_job"] - rec["dp_slow_hop_bytes_dense_job"]
        gathers = rec["dp_bytes_sent_job"] - rs - rec["dp_slow_hop_bytes_sent_job"]
        assert 0 < gathers < rec["dp_slow_hop_bytes_dense_job"] / 2


#: One line for a rank lost without an error of its own (megatron_edgc/runtime/lost_ranks.py).
LOST_RANK_2 = ("error: rank 2 of 4 was lost (no error of its own, no answer: killed, crashed, "
               "or its host is gone); the other ranks' errors followed from it")


def _worker_of_rank(agent_pid: int, rank: int):
    """torchrun's worker of ``rank``: the child of its agent whose environment has
    ``RANK=rank`` (the processes a worker starts itself are its children, not the agent's)."""
    found = []
    for task in os.listdir(f"/proc/{agent_pid}/task"):
        try:
            with open(f"/proc/{agent_pid}/task/{task}/children") as fh:
                children = [int(c) for c in fh.read().split()]
        except OSError:
            continue
        for child in children:
            try:
                with open(f"/proc/{child}/environ", "rb") as fh:
                    if f"RANK={rank}".encode() in fh.read().split(b"\0"):
                        found.append(child)
            except OSError:
                continue
    assert len(found) <= 1, found
    return found[0] if found else None


@pytest.mark.extended   # about 65 s a tag: make test-compat
def test_killed_rank_is_named_and_the_job_resumes_exactly(megatron_lm, tmp_path):
    """Rank 2 SIGKILLed mid-run, past the first save, on the slow hop (DP 4 as 2
    distributed-optimizer instances of 2, bf16 training and gradient buffers, torch_dist
    saves every 4 iterations): torchrun's own root cause is not reliably the killed rank
    (docs/reliability.md); the EDGC line names rank 2, once. Rerun with ``--load``, the job
    resumes from the last checkpoint, and Megatron-LM's losses and EDGC's records from there
    are the uninterrupted run's."""
    job = EDGC_DP + TORCH_DIST[:-1] + INSTANCES + ["--grad-reduce-in-bf16", "--train-iters",
                                                   "16", "--save-interval", "4"]
    out, _, whole = run_megatron_lm(megatron_lm, megatron_lm[2],
                                    job + ["--save", str(tmp_path / "whole-ckpt")], tmp_path,
                                    "whole")
    assert "compressing the slow hop only" in out and "(bf16 gradients," in out
    want = lm_losses(out)
    assert sorted(want) == list(range(1, 17)) and [r["iteration"] for r in whole] == \
        list(range(1, 17))

    ckpt = str(tmp_path / "ckpt")
    cmd, env, metrics = megatron_lm_command(megatron_lm, megatron_lm[2], job + ["--save", ckpt],
                                            tmp_path, "crashed")
    with open(tmp_path / "crashed.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=str(tmp_path), stdout=log,
                                stderr=subprocess.STDOUT)
        killed_after, code = kill_rank_after(proc, metrics, 6, 2, _worker_of_rank)
    out = (tmp_path / "crashed.log").read_text()
    assert killed_after is not None and killed_after < 16, "the run ended before the kill"
    assert code != 0, out[-4000:]
    assert [line for line in out.splitlines() if "was lost" in line] == [LOST_RANK_2], \
        out[-4000:]
    last = int(open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read())
    crashed = [r["iteration"] for r in read_jsonl_lenient(metrics)]
    assert last in (4, 8, 12) and last <= crashed[-1] < 16, (last, crashed)

    out, _, resumed = run_megatron_lm(megatron_lm, megatron_lm[2],
                                      job + ["--save", ckpt, "--load", ckpt], tmp_path,
                                      "crashed")
    assert "no compressor state" not in out
    # The metrics file: each iteration once, the crashed attempt's records past ``last``
    # dropped; from ``last`` on, the uninterrupted run's records.
    assert [r["iteration"] for r in resumed] == list(range(1, 17))
    keys = ("iteration", "loss", "rank_dp", "dp_bytes_sent_job", "dp_slow_hop_bytes_sent_job")
    assert [[r[k] for k in keys] for r in resumed[last:]] == \
        [[r[k] for k in keys] for r in whole[last:]]
    assert any(r["rank_dp"] != whole[2]["rank_dp"] for r in whole[last:])  # controller moved
    # Megatron-LM's losses, as printed: its first line after a start shows that iteration,
    # its second the mean of the two (the accumulator is first reset there), then each its own.
    got = lm_losses(out)
    assert sorted(got) == list(range(last + 1, 17))
    first, second = last + 1, last + 2
    assert got[first] == want[first]
    assert got[second] == pytest.approx((want[first] + want[second]) / 2, rel=1e-5)
    assert [got[i] for i in range(second + 1, 17)] == [want[i] for i in range(second + 1, 17)]


def test_moe_allgather_dispatcher(megatron_lm, tmp_path):
    """The allgather token dispatcher (``--moe-token-dispatcher-type allgather``) with
    EDGC: the same bytes per group as alltoall's, replicas bit-identical, the loss falls."""
    moe = MOE[:MOE.index("alltoall")] + ["allgather"] + MOE[MOE.index("alltoall") + 1:]
    _, losses, records = run_megatron_lm(megatron_lm, megatron_lm[2],
                                         moe + EDGC_DP + ["--edgc-check-replicas"], tmp_path,
                                         "allgather")
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    for rec in records:
        assert rec["dp_replica_mismatches"] == 0
        if not any(rec["rank_dp"] or []):
            continue
        per_rank = {e: compressed_bucket_bytes(s, rec["rank_dp"][0]) for e, s in moe_buckets()}
        assert rec["dp_bytes_sent_job"] == 4 * (per_rank[False] + per_rank[True])
        assert rec["dp_expert_bytes_sent_job"] == 4 * per_rank[True]


def test_grad_reduce_in_bf16_job(megatron_lm, tmp_path):
    """Megatron-LM's ``--grad-reduce-in-bf16`` (bf16 gradient buffers) on TP1·PP2·DP2,
    torch_dist with the distributed optimizer: EDGC compresses the bf16 buffers (fp32 math,
    no fp32 copy of them) with the bytes of its shapes, keeps the replicas bit-identical,
    names the gradient dtype, and resumes exactly. (Mode off touches no buffer whatever
    its dtype: its bitwise check is the other jobs', not repeated here for CI's time.)"""
    def want(ranks):
        if not any(ranks or []):   # dense warm-up: Megatron's bf16 reduction, half of fp32's
            return sum(stage_bytes(None)), 0
        # the dense rest travels as the buffers do, in bf16, with the factors
        return 2 * sum(stage_bytes(r, embedding_apart=True, dense_bytes=2)[s]
                       for s, r in enumerate(ranks)), 0

    out, _ = _check_model_job(megatron_lm, tmp_path, ["--grad-reduce-in-bf16"], EDGC_DP, want,
                              compare_off=False)
    assert "(bf16 gradients," in out


@pytest.mark.extended   # about 35 s a tag: make test-compat
def test_the_bypass_refits_its_link_in_the_plug_in(megatron_lm, tmp_path):
    """The plug-in runs the same bypass as the trainer: the link measured at start-up, then
    refitted every ``--edgc-link-window`` iterations from the job's own collectives (one
    flush per window), named in the EDGC line and in every record (loopback links: this
    checks the wiring; tests/test_netns.py changes a link under the trainer)."""
    static = ["--edgc-mode", "static", "--edgc-rank", "4", "--edgc-bypass", "auto",
              "--edgc-link-window", "2"]
    out, losses, records = run_megatron_lm(megatron_lm, megatron_lm[2], static, tmp_path,
                                           "link")
    assert len(losses) == 8 and [r["iteration"] for r in records] == list(range(1, 9))
    assert all(r["dp_link_gbps"] > 0 for r in records)
    assert re.search(r"\| link [0-9.]+ Gbit/s, \d+ dense", out), out[-3000:]
    assert "measured at start-up)" in out
    refits = sorted({int(m) for m in re.findall(
        r"iteration (\d+): bypass: link [0-9.e+-]+ -> [0-9.e+-]+ Gbit/s", out)})
    assert refits == [3, 5, 7], out[-3000:]


#: The plug-in's fault injection: a NaN in DP rank 1's first gradient of (0-based) iteration
#: EDGC_TEST_NAN_AT, written before Megatron-LM's finalize_model_grads (the DP sync); then
#: the two-line copy runs as __main__.
NAN_INJECTING_SCRIPT = """
import os, runpy, sys
from megatron.core import parallel_state
from megatron.training import training
from megatron.training.global_vars import get_args

AT, original = int(os.environ["EDGC_TEST_NAN_AT"]), training.finalize_model_grads

def finalize_model_grads(model, *args, **kwargs):
    if get_args().curr_iteration == AT and parallel_state.get_data_parallel_rank() == 1:
        next(model[0].parameters()).main_grad.view(-1)[0] = float("nan")
    return original(model, *args, **kwargs)

training.finalize_model_grads = finalize_model_grads
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.parametrize("extra", [
    ["--bf16", "--use-distributed-optimizer"],   # mode off: the guard protects any run
    pytest.param(["--edgc-mode", "static", "--edgc-rank", "4", "--edgc-bypass", "off"],
                 marks=pytest.mark.extended)],
    ids=["off-bf16-distopt", "static-fp32"])
def test_a_nan_gradient_is_a_skipped_iteration(megatron_lm, tmp_path, extra):
    """A NaN in DP rank 1's gradient at iteration 4 of 8: Megatron-LM's optimizer step is
    skipped on every rank (its own ``number of skipped iterations`` counts it, once), rank 0
    names it, the plug-in's summary counts it, every loss stays finite and the job exits 0
    (its weights checked finite at the end). Megatron-LM's own check of each rank's
    gradient before the DP collective (``--check-for-nan-in-loss-and-grad``, on by default:
    it raises) is off, as it cannot see a non-finite *reduced* gradient (an overflow in the
    reduction, a faulty compressed sync), which is what the guard is for."""
    out, records = run_with_nonfinite_grad(megatron_lm, tmp_path, extra, "nan", value="nan")
    skips = [int(n) for n in re.findall(r"number of skipped iterations:\s+(\d+)", out)]
    assert len(skips) == 8 and sum(skips) == 1 and skips[3] == 1, (skips, out[-4000:])
    assert out.count("iteration 4: non-finite gradient (grad norm nan): step skipped, "
                     "weights unchanged") == 1, out[-4000:]
    assert "EDGC summary | 8 iterations | 1 skipped for a non-finite gradient (4)" in out
    losses = lm_losses(out)
    assert len(losses) >= 7 and all(v == v and abs(v) < 100 for v in losses.values()), losses
    if records:   # compression on: the plug-in's records say which iteration was skipped
        assert [r["skipped"] for r in records] == [r["iteration"] == 4 for r in records]


#: The plug-in's factorization failures: every Cholesky factorization of the (0-based)
#: iterations in EDGC_TEST_FAIL_AT returns NaN with info > 0, as cuSOLVER's batched potrf
#: does where it fails; then the two-line copy runs as __main__.
FAILING_FACTORIZATIONS_SCRIPT = """
import os, runpy, sys
import torch
from megatron.training.global_vars import get_args

AT, original = {{int(i) for i in os.environ["EDGC_TEST_FAIL_AT"].split(",")}}, \\
    torch.linalg.cholesky_ex

def cholesky_ex(a, **kwargs):
    out = original(a, **kwargs)
    if get_args().curr_iteration in AT:
        return type(out)((torch.full_like(out.L, float("nan")), out.info + 1))
    return out

torch.linalg.cholesky_ex = cholesky_ex
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""

FALLBACK = ["--edgc-mode", "static", "--edgc-rank", "4", "--edgc-bypass", "off",
            "--edgc-fallback-iters", "2", "--edgc-dense-wire", "grad"]


def run_injected(megatron_lm, tmp_path, template: str, variables: dict, extra, name):
    """The two-line script run through an injecting ``template`` (its path as ``{script}``)
    with the environment ``variables``; returns (output, EDGC records)."""
    script = tmp_path / f"pretrain_gpt_{name}.py"
    script.write_text(template.format(script=megatron_lm[2]))
    cmd, env, metrics = megatron_lm_command(megatron_lm, str(script), extra, tmp_path, name)
    proc = warm.run(cmd, env={**env, **variables}, cwd=str(tmp_path), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out, read_records(metrics)


def run_failing_factorizations(megatron_lm, tmp_path, extra, name):
    """The plug-in's job with factorizations failing at iterations 2 and 3 (1-based)."""
    return run_injected(megatron_lm, tmp_path, FAILING_FACTORIZATIONS_SCRIPT,
                        {"EDGC_TEST_FAIL_AT": "1,2"}, FALLBACK + extra, name)


def test_failed_factorizations_go_dense_and_come_back_in_the_plug_in(megatron_lm, tmp_path):
    """Megatron-LM's own script, factorizations failing at iterations 2 and 3 of 8 (static
    r4, PP 2 x DP 2): a fixed basis stands in (no step skipped), the buckets go dense at
    the read after the second failure for ``--edgc-fallback-iters`` 2 iterations (4, 5),
    shown dense in the records and the EDGC line, then compress again; the summary says 6
    of 8 iterations compressed per stage and how many factorizations stood in."""
    out, records = run_failing_factorizations(megatron_lm, tmp_path, [], "fallback")
    assert [r["iteration"] for r in records] == list(range(1, 9))
    assert not any(r["skipped"] for r in records)
    assert [r["rank_dp"] for r in records] == \
        [[None, None] if r["iteration"] in (4, 5) else [4, 4] for r in records]
    assert [r["dp_bytes_sent"] == r["dp_bytes_dense"] for r in records] == \
        [r["iteration"] in (4, 5) for r in records]
    assert "rank dp dense/dense" in out and "rank dp 4/4" in out
    assert "sent dense (an all-reduce of the bucket, as megatron-core's) for iterations " \
        "4-5, then compressed again" in out, out[-4000:]
    assert "compressed again from iteration 6, after 2 iterations sent dense" in out
    stood_in = sum(r["dp_factors_stood_in"] for r in records)
    assert stood_in >= 4
    assert "EDGC summary | 8 iterations | 0 skipped for a non-finite gradient | DP " \
        f"compressed 6/6 of 8 iterations per stage (8/8 with a rank in force) | {stood_in} " \
        "factorizations stood in" in out, out[-4000:]


@pytest.mark.extended   # three more jobs (about 100 s a tag): make test-compat
def test_the_fallback_resumes_in_the_plug_in(megatron_lm, tmp_path):
    """Saved at iteration 4 (inside the dense interval) and resumed: the same records as
    one run (the fallback's state is in the plug-in's checkpoint sidecar)."""
    ckpt = str(tmp_path / "ckpt")
    _, whole = run_failing_factorizations(megatron_lm, tmp_path, [], "whole")
    save = ["--save", ckpt, "--save-interval", "4"]
    run_failing_factorizations(megatron_lm, tmp_path, save + ["--exit-interval", "4"],
                               "resumed")
    _, resumed = run_failing_factorizations(megatron_lm, tmp_path, save + ["--load", ckpt],
                                            "resumed")
    keys = ("iteration", "loss", "rank_dp", "dp_bytes_sent", "dp_fallback_share")
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in whole]


#: Megatron-LM's rerun machine asking, at (0-based) iteration EDGC_TEST_EXIT_AT, for a
#: checkpoint and an exit after the DP sync and before the optimizer's step (train_step
#: returns early: the plug-in never hears the step's outcome); then the two-line copy runs
#: as __main__.
EARLY_EXIT_SCRIPT = """
import os, runpy, sys
from megatron.core.rerun_state_machine import RerunStateMachine
from megatron.training.global_vars import get_args

AT, original = int(os.environ["EDGC_TEST_EXIT_AT"]), RerunStateMachine.should_checkpoint_and_exit

def should_checkpoint_and_exit(self):
    if get_args().curr_iteration == AT:
        return True, True, 0
    return original(self)

RerunStateMachine.should_checkpoint_and_exit = should_checkpoint_and_exit
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


#: A NaN written into every rank's first gradient after the DP sync of (0-based) iteration
#: EDGC_TEST_NAN_AT: the sync was finite, the optimizer skips the step on every rank.
NAN_AFTER_SYNC_SCRIPT = """
import os, runpy, sys
from megatron.training import training
from megatron.training.global_vars import get_args

AT, original = int(os.environ["EDGC_TEST_NAN_AT"]), training.finalize_model_grads

def finalize_model_grads(model, *args, **kwargs):
    out = original(model, *args, **kwargs)
    if get_args().curr_iteration == AT:
        next(model[0].parameters()).main_grad.view(-1)[0] = float("nan")
    return out

training.finalize_model_grads = finalize_model_grads
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def _sidecars(ckpt, iteration: int, read) -> dict:
    """``read(extensions)`` of each rank's EDGC sidecar of ``iteration``, by file name."""
    import torch

    folder = os.path.join(ckpt, f"iter_{iteration:07d}", "edgc")
    return {name: read(torch.load(os.path.join(folder, name), weights_only=False)["extensions"])
            for name in sorted(os.listdir(folder))}


def _dp_residuals(ckpt, iteration: int) -> dict:
    """Each rank's DP compression residuals, by matrix name (a pending one included)."""
    def read(ext):
        buckets = ext["dp_compression"]["buckets"]
        out = {f"{b}/{m}": e["residual"] for b, bucket in buckets.items()
               for m, e in bucket["matrices"].items()}
        out.update({f"{b}/{m}": e for b, bucket in buckets.items()
                    for m, e in bucket.get("pending", {}).items()})
        return out
    return _sidecars(ckpt, iteration, read)


def _pp_senders(ckpt, iteration: int) -> dict:
    """Each rank's pipeline senders' ``(E, Q)``, by matrix name (stage 1's; stage 0 sends
    no backward message)."""
    return _sidecars(ckpt, iteration, lambda ext: {
        m: (e["residual"], e["q"])
        for sender in (ext.get("pp_compression") or {"senders": {}})["senders"].values()
        for m, e in sender["matrices"].items()})


def test_a_save_before_the_optimizer_step_keeps_the_step_as_a_skip(megatron_lm, tmp_path):
    """Megatron-LM's rerun machine can checkpoint and exit between an iteration's DP sync
    and its optimizer step (core_v0.16.1's ``train_step`` returns early, before the
    plug-in's ``end_step``). EDGC (DP and pipeline), exiting so in iteration 5: the saved
    residuals are those of a job whose optimizer skipped iteration 5 after a finite DP sync
    (a NaN written into a gradient after it), saved after it: every compressed matrix
    keeps ``M = G + E`` (issue 71: not ``M - P^ Qᵀ``, as if the step had been applied);
    every pipeline sender holds, bit for bit, what iteration 5 found (issue 81: the
    rule rolls a sender back to the iteration's start, whether the outcome was a skip or
    never reported)."""
    guard = ["--no-check-for-nan-in-loss-and-grad"]
    exited, skipped = str(tmp_path / "exited"), str(tmp_path / "skipped")
    out, records = run_injected(megatron_lm, tmp_path, EARLY_EXIT_SCRIPT,
                                {"EDGC_TEST_EXIT_AT": "4"},
                                EDGC + guard + ["--save", exited, "--save-interval", "100"],
                                "exited")
    assert [r["iteration"] for r in records] == [1, 2, 3, 4], out[-3000:]
    with open(os.path.join(exited, "latest_checkpointed_iteration.txt")) as fh:
        assert fh.read() == "4"
    out, records = run_injected(megatron_lm, tmp_path, NAN_AFTER_SYNC_SCRIPT, {"EDGC_TEST_NAN_AT": "4"},
                                EDGC + guard + ["--save", skipped, "--save-interval", "5",
                                                "--exit-interval", "5"], "skipped")
    assert [r["skipped"] for r in records] == [False] * 4 + [True], out[-3000:]
    want, got = _dp_residuals(skipped, 5), _dp_residuals(exited, 4)
    assert sorted(got) == sorted(want) and len(got) == 4
    for rank, residuals in want.items():
        assert sorted(got[rank]) == sorted(residuals) and len(residuals) >= 5, rank
        for name, e in residuals.items():
            assert e.abs().sum() > 0, (rank, name)
            assert relative_difference(got[rank][name], e) < 1e-6, (rank, name)
    import torch

    want, got = _pp_senders(skipped, 5), _pp_senders(exited, 4)
    assert sorted(got) == sorted(want) and sum(len(v) for v in want.values()) == 2
    for rank, senders in want.items():
        for name, (e, q) in senders.items():
            assert e.abs().sum() > 0, (rank, name)
            assert torch.equal(got[rank][name][0], e) and torch.equal(got[rank][name][1], q)


#: fp16 with Megatron-LM's dynamic loss scaler: a scale an 8-iteration job can grow from
#: (every 3 iterations) and halve at once (hysteresis 1)
FP16 = ["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "3",
        "--hysteresis", "1"]


def run_with_nonfinite_grad(megatron_lm, tmp_path, extra, name, value="inf", at=3):
    """The two-line script with ``value`` (``nan``; ``inf``, an fp16 overflow) in DP rank
    1's gradient of (0-based) iteration ``at``, Megatron-LM's own per-rank check off;
    returns (output, EDGC records)."""
    return run_injected(megatron_lm, tmp_path,
                        NAN_INJECTING_SCRIPT.replace('float("nan")', f'float("{value}")'),
                        {"EDGC_TEST_NAN_AT": str(at)},
                        extra + ["--no-check-for-nan-in-loss-and-grad"], name)


def test_fp16_with_the_loss_scaler_in_the_plug_in(megatron_lm, tmp_path):
    """Megatron-LM's own script with ``--fp16`` (its fp16 optimizer and dynamic scaler;
    fp16 gradient buffers dense, fp32 ones where EDGC compresses):

    * mode off is Megatron-LM's run bit for bit;
    * static rank 4 with an Inf in DP rank 1's gradient at iteration 4: the step is
      skipped on every rank (Megatron's own count), the scale halves, the summary counts
      the skip as the scaler's and calls it no compressed iteration, and the losses are
      the fp32 job's with the same skip (the guard's there) to fp16's rounding: on this
      8-iteration mock-data job rank 4 lags dense alike in both precisions (measured
      0.09-0.13 at 16 iterations in fp32 and fp16; the trainer's test compares with dense
      fp16 on the corpus);
    * EDGC (DP and pipeline) with the bypass on, which on loopback sends every DP bucket
      dense: it ends at dense fp16's loss, and its summary calls no iteration compressed.
    """
    _, plain, _ = run_megatron_lm(megatron_lm, megatron_lm[1], FP16, tmp_path, "plain")
    _, off, _ = run_megatron_lm(megatron_lm, megatron_lm[2], FP16, tmp_path, "off")
    assert len(plain) == 8 and off == plain, (off, plain)   # bitwise, as printed
    static = ["--edgc-mode", "static", "--edgc-rank", "4", "--edgc-bypass", "off"]
    out, records = run_with_nonfinite_grad(megatron_lm, tmp_path, FP16 + static, "static16")
    skips = [int(n) for n in re.findall(r"number of skipped iterations:\s+(\d+)", out)]
    assert skips == [int(i == 3) for i in range(8)], (skips, out[-4000:])
    assert [r["skipped"] for r in records] == [r["iteration"] == 4 for r in records]
    scales = [r["loss_scale"] for r in records]
    assert scales[4] == scales[3] / 2, scales
    changes = sum(a != b for a, b in zip(scales, scales[1:]))
    assert "EDGC summary | 8 iterations | 0 skipped for a non-finite gradient | 1 skipped " \
        f"by the loss scaler | {changes} loss-scale changes" in out, out[-3000:]
    assert "DP compressed 7/7 of 8 iterations per stage (8/8 with a rank in force)" in out
    _, fp32 = run_with_nonfinite_grad(megatron_lm, tmp_path, static, "static32")
    assert [r["skipped"] for r in fp32] == [r["iteration"] == 4 for r in fp32]
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(records, fp32))
    assert gap < 0.02, ([r["loss"] for r in records], [r["loss"] for r in fp32])
    # EDGC with the bypass on: every DP bucket dense on loopback, so nothing compressed
    out, losses, records = run_megatron_lm(
        megatron_lm, megatron_lm[2], FP16 + EDGC[:EDGC.index("--edgc-bypass")]
        + ["--edgc-bypass", "auto", "--edgc-dac", "off", "--edgc-pp-compression", "edgc",
           "--edgc-pp-rank-max", "16"], tmp_path, "edgc")
    assert abs(sum(losses[-3:]) / 3 - sum(plain[-3:]) / 3) < 0.03, (losses, plain)
    # compressing in fp16, the plug-in keeps fp32 gradient buffers (issue 71): every DP
    # bucket goes dense on the default bf16 dense wire, half megatron-core's fp32 bytes
    assert all(2 * r["dp_bytes_sent"] == r["dp_bytes_dense"] and r["rank_dp"] == [None, None]
               for r in records), [(r["rank_dp"], r["dp_bypassed_buckets"]) for r in records]
    assert "EDGC: --fp16 with DP compression: gradients accumulated and reduced in fp32" in out
    ranked = sum(r["dp_bypassed_buckets"] > 0 and not r["skipped"] for r in records)
    assert ranked > 0 and f"DP compressed 0/0 of 8 iterations per stage ({ranked}/{ranked} " \
        "with a rank in force)" in out, out[-3000:]
