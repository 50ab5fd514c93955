"""``--use-megatron-fsdp`` and its flags (issue 94): what the trainer runs under
Megatron-FSDP (HSDP, fp32, TP1 PP1, the outer hop compressed at a static rank) and what it
refuses by name, before any process group. One process, no model."""

import pytest
import torch

from megatron_edgc.config import parse_config
from test_config import expect_error


def fsdp(small_model_argv, *extra):
    return small_model_argv + [
        "--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
        "--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2",
        "--use-distributed-optimizer", "--overlap-grad-reduce", *extra]


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.parametrize("mode", ["off", "static"])
def test_hsdp_accepted(small_model_argv, strategy, mode):
    cfg = parse_config(fsdp(small_model_argv, "--data-parallel-sharding-strategy", strategy,
                            "--edgc-mode", mode))
    p = cfg.parallel
    assert p.use_megatron_fsdp and p.data_parallel_sharding_strategy == strategy
    assert p.outer_dp_sharding_strategy == "no_shard"
    assert p.num_distributed_optimizer_instances == 2 and p.data_parallel_size == 4


@pytest.mark.parametrize("extra,flag,fragment", [
    (["--data-parallel-sharding-strategy", "optim"], "--data-parallel-sharding-strategy",
     "optim: not yet"),
    (["--data-parallel-sharding-strategy", "optim_grads"], "--data-parallel-sharding-strategy",
     "allowed: no_shard, optim_grads_params"),
    (["--data-parallel-sharding-strategy", "full"], "--data-parallel-sharding-strategy",
     "must be one of no_shard, optim, optim_grads, optim_grads_params"),
    (["--outer-dp-sharding-strategy", "optim"], "--outer-dp-sharding-strategy",
     "optim: not yet"),
    (["--num-distributed-optimizer-instances", "1"], "--num-distributed-optimizer-instances",
     "HSDP only: needs >= 2"),
    (["--num-distributed-optimizer-instances", "3"], "--num-distributed-optimizer-instances",
     "must divide the DP size (4); got 3"),
    (["--no-use-distributed-optimizer"], "--use-megatron-fsdp",
     "needs --use-distributed-optimizer"),
    (["--no-overlap-grad-reduce"], "--overlap-grad-reduce", "needs it on here"),
    (["--data-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     "--use-megatron-fsdp", "not yet with TP 1 x PP 2"),
    (["--num-experts", "4"], "--num-experts", "not yet with --use-megatron-fsdp"),
    (["--fp16"], "--fp16", "not yet with --use-megatron-fsdp"),
    (["--bf16"], "--bf16", "set: not yet with --use-megatron-fsdp"),
    (["--edgc-mode", "edgc"], "--edgc-mode", "edgc: not yet with --use-megatron-fsdp"),
    (["--edgc-mode", "static", "--edgc-bypass", "auto"], "--edgc-bypass",
     "auto: not yet with --use-megatron-fsdp"),
    (["--edgc-mode", "static", "--edgc-dense-wire", "bf16"], "--edgc-dense-wire",
     "allowed: grad"),
    (["--edgc-mode", "static", "--edgc-check-replicas"], "--edgc-check-replicas", "not yet"),
    (["--save", "/tmp/x"], "--save", "not yet with --use-megatron-fsdp"),
])
def test_refused_by_name(small_model_argv, extra, flag, fragment):
    expect_error(fsdp(small_model_argv, *extra), flag, fragment)


def test_unset_bf16_refused(small_model_argv):
    argv = [a for a in fsdp(small_model_argv) if a != "--no-bf16"]
    expect_error(argv, "--bf16", "unset")


def test_save_refusal_says_why(small_model_argv):
    message = expect_error(fsdp(small_model_argv, "--save", "/tmp/x"), "--save")
    if not torch.cuda.is_available():
        assert "gloo's all-gather" in message


@pytest.mark.parametrize("flag", ["--data-parallel-sharding-strategy",
                                  "--outer-dp-sharding-strategy"])
def test_fsdp_flags_need_fsdp(small_model_argv, flag):
    value = "optim_grads_params" if flag.startswith("--data") else "optim"
    expect_error(small_model_argv + [flag, value], flag, "needs --use-megatron-fsdp")
