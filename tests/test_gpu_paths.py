"""The parts of the CUDA code path that CPU can run: workers started with ``spawn`` and
the model in bf16 (both broke on the first H100 run: BENCHMARKS.md, GPU check), and the
fused paths chosen by what is installed (the first H200 run, without Apex). Each
reproduces here."""

import os
import subprocess
import sys

import pytest
import torch

from distributed import LAYOUTS, assert_dp_replicas_identical, read_jsonl, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_workers_spawn_where_cuda_is_available(monkeypatch):
    from megatron_edgc.training import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert launch.start_method() == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.start_method() == "fork"


def test_pretrain_trains_with_spawned_workers(small_model_argv, tmp_path):
    """The launcher's target and config must survive pickling into spawned processes (on
    the H100 a forked worker failed: "Cannot re-initialize CUDA in forked subprocess")."""
    metrics = str(tmp_path / "m.jsonl")
    code = ("import sys; from megatron_edgc.training import launch\n"
            "launch.start_method = lambda: 'spawn'\n"
            "from megatron_edgc.training.pretrain import main\n"
            "sys.exit(main(sys.argv[1:]))")
    argv = small_model_argv + ["--pipeline-model-parallel-size", "1", "--data-parallel-size",
                               "2", "--train-iters", "3", "--edgc-mode", "static",
                               "--edgc-bypass", "off", "--metrics-file", metrics]
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = read_jsonl(metrics)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert records[-1]["dp_bytes_sent_job"] < records[-1]["dp_bytes_dense_job"] / 4


@pytest.fixture(scope="module")
def fp32_and_bf16_runs(small_model_argv, tmp_path_factory):
    """The same compressed 4-process job (PP2·DP2, overlapped DP reduce, static rank on DP
    and PP) in fp32 and in bf16."""
    runs = {}
    for precision in ("fp32", "bf16"):
        tmp = tmp_path_factory.mktemp(precision)
        metrics = str(tmp / "m.jsonl")
        flags = ["--bf16"] if precision == "bf16" else ["--no-bf16"]
        results = run_job(small_model_argv + LAYOUTS["tp1-pp2-dp2-overlap"] + flags + [
            "--edgc-mode", "static", "--edgc-bypass", "off", "--edgc-pp-compression", "static",
            "--metrics-file", metrics], str(tmp / "out"))
        runs[precision] = (results, read_jsonl(metrics))
    return runs


def test_bf16_model_trains_like_fp32(fp32_and_bf16_runs):
    """Every parameter in bf16 (megatron-core's Float16Module, as Megatron-LM wraps it),
    replicas bit-identical, the loss within 0.05 of fp32 over 20 compressed iterations,
    and the same bytes on the wire: gradients reduce in fp32, factors in their own dtype."""
    results, bf16 = fp32_and_bf16_runs["bf16"]
    _, fp32 = fp32_and_bf16_runs["fp32"]
    dtypes = {p.dtype for r in results for p in r["params"].values()}
    assert dtypes == {torch.bfloat16}
    assert assert_dp_replicas_identical(results) > 0
    assert len(bf16) == len(fp32) == 20
    losses = [r["loss"] for r in bf16]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(bf16, fp32)]
    assert max(diffs) < 0.05, diffs
    assert bf16[-1]["dp_bytes_sent_job"] == fp32[-1]["dp_bytes_sent_job"]
    assert bf16[-1]["dp_bytes_sent_job"] < bf16[-1]["dp_bytes_dense_job"] / 4


FUSED_KERNELS = {  # TransformerConfig switch -> the modules it needs on a GPU
    "masked_softmax_fusion": ("scaled_masked_softmax_cuda",
                              "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda"),
    "bias_activation_fusion": ("triton",),
    "bias_dropout_fusion": ("triton",),
    "gradient_accumulation_fusion": ("fused_weight_gradient_mlp_cuda",),
    "persist_layer_norm": ("apex.contrib.layer_norm.layer_norm",),
}


@pytest.mark.parametrize("installed", [False, True], ids=["kernels-absent", "kernels-present"])
def test_fused_paths_follow_their_kernels_on_gpu(monkeypatch, installed):
    """On a GPU each fused path is on only where its kernel imports: the H200 without Apex
    crashed at the first forward (``No module named 'scaled_masked_softmax_cuda'``) with
    ``masked_softmax_fusion`` set from the device alone. Off on CPU, whatever is installed."""
    import types

    from megatron_edgc.config import RunConfig
    from megatron_edgc.training.model import transformer_config

    for modules in FUSED_KERNELS.values():
        for name in modules:  # None in sys.modules: the import raises ImportError
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name) if installed else None)
    config = transformer_config(RunConfig(), bf16=True, on_gpu=True)
    assert {flag: getattr(config, flag) for flag in FUSED_KERNELS} == \
        dict.fromkeys(FUSED_KERNELS, installed)
    config = transformer_config(RunConfig(), bf16=True, on_gpu=False)
    assert not any(getattr(config, flag) for flag in FUSED_KERNELS)


@pytest.mark.parametrize("apex_or_te", [False, True], ids=["torch-adam", "fused-adam"])
def test_torch_adam_resume_fix_follows_the_optimizer_not_the_device(monkeypatch, apex_or_te):
    """The plug-in on the H200 without Apex or TE: resuming ``torch_dist`` with the
    distributed optimizer asserted in ``DistributedOptimizer.state_dict``, the fix having
    been applied on CPU only. It applies wherever megatron-core runs torch's Adam, CUDA or
    not; resumed, each parameter's ``step`` advances by one per optimizer step."""
    import inspect

    from megatron.core.optimizer import distrib_optimizer

    from megatron_edgc.patches import torch_adam_resume

    optimizer = distrib_optimizer.DistributedOptimizer
    patched = ("sharded_state_dict", "load_state_dict")
    for name in patched:  # the originals, restored after the test
        monkeypatch.setattr(optimizer, name, inspect.unwrap(getattr(optimizer, name)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", apex_or_te)
    assert torch_adam_resume.apply_torch_adam_resume_fix() is not apex_or_te
    assert [getattr(getattr(optimizer, n), "__edgc_wrapped__", False) for n in patched] == \
        [not apex_or_te] * 2

    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    adam = torch.optim.Adam(params)

    def load(self, state_dict):  # megatron-core's load: one step tensor for every state
        step = torch.tensor(float(state_dict["optimizer"]["param_groups"][0]["step"]))
        for p in params:
            self.optimizer.state[p] = {"step": step, "exp_avg": torch.zeros(2),
                                       "exp_avg_sq": torch.zeros(2)}

    holder = type("Holder", (), {"optimizer": adam})()
    torch_adam_resume._own_step_per_parameter(load)(
        holder, {"optimizer": {"param_groups": [{"step": 5}]}})
    for p in params:
        p.grad = torch.ones(2)
    adam.step()
    assert [adam.state[p]["step"].item() for p in params] == [6.0] * 3
