"""The plug-in under Megatron-FSDP HSDP (issue 94): Megatron-LM core_v0.16.1's own
``pretrain_gpt.py`` with the two lines, 4 gloo processes (2 instances x 2 inner DP, TP1
PP1), ``--use-megatron-fsdp``: dense (``--edgc-mode off``: Megatron-FSDP's own sync) and the
outer hop compressed at a static rank (:class:`~megatron_edgc.patches.fsdp_outer.FSDPOuterCompression`,
built by the runtime the plug-in builds); then the refusals, pure (no process group)."""

import argparse
import math
import os

import pytest

from distributed import compressed_bucket_bytes
from megatron_lm_job import add_two_lines, lm_losses, unpack
from megatron_edgc.config import ConfigError, ModelConfig, ParallelConfig
from megatron_edgc.model_shapes import stage_param_shapes

ITERS = 6
RANK = 4
TAG = "core_v0.16.1"
#: Megatron-LM's flags of the HSDP form the plug-in runs (its fsdp_dtensor format is
#: required by Megatron-LM with --use-megatron-fsdp; nothing is saved).
FSDP = ["--pipeline-model-parallel-size", "1", "--global-batch-size", "16",  # 2 micro-batches
        "--train-iters", str(ITERS), "--log-interval", "1",
        "--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--ckpt-format", "fsdp_dtensor"]
STATIC = ["--edgc-mode", "static", "--edgc-rank", str(RANK), "--edgc-bypass", "off",
          "--edgc-dense-wire", "grad"]


@pytest.fixture(scope="module")
def fsdp_job(tmp_path_factory):
    """``run(strategy, edgc_flags)``: (output, Megatron-LM's printed losses, EDGC records),
    each job run once for the module."""
    from test_megatron_lm import VENDOR, environment, run_megatron_lm

    source = next((s for s in (os.path.join(VENDOR, f"megatron-lm-{TAG}{ext}")
                               for ext in (".tar.gz", "")) if os.path.exists(s)), None)
    if source is None:
        pytest.skip(f"no Megatron-LM {TAG} under {VENDOR}")
    env = environment("0.16")
    if isinstance(env, str):
        pytest.skip(env)
    where = unpack(source, str(tmp_path_factory.mktemp("megatron-lm")))
    original, copy = add_two_lines(where)
    megatron_lm = (where, original, copy, env)
    jobs = {}

    def run(strategy, flags):
        key = (strategy, tuple(flags))
        if key not in jobs:
            tmp = tmp_path_factory.mktemp(f"{strategy}-{flags[1]}")
            out, _, records = run_megatron_lm(
                megatron_lm, copy, FSDP + ["--data-parallel-sharding-strategy", strategy]
                + list(flags), tmp, "run")
            jobs[key] = (out, lm_losses(out), records)
        return jobs[key]
    return run


def outer_bytes_from_shapes(rank):
    """The outer hop of one rank per step under inner ``no_shard`` (its bucket the whole
    model, one bucket): PowerSGD's (n+m) r bf16 factors per compressed matrix, the rest
    fp32, one flag; dense (``rank`` None): every gradient in fp32."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                        max_position_embeddings=64, make_vocab_size_divisible_by=128)
    model.resolve()
    (shapes,) = stage_param_shapes(model, ParallelConfig(pipeline_model_parallel_size=1,
                                                         data_parallel_size=4),
                                   vocab_size=1001)   # + EOD
    return compressed_bucket_bytes(shapes, rank)


def test_megatron_fsdp_static_outer_hop_through_the_plugin(fsdp_job):
    dense_out, dense, dense_records = fsdp_job("no_shard", ["--edgc-mode", "off"])
    assert dense_records == [] and sorted(dense) == list(range(1, ITERS + 1))
    assert "EDGC did not run (--edgc-mode off" in dense_out
    assert "--no-gradient-reduce-div-fusion" in dense_out   # the CPU setting, said
    out, losses, records = fsdp_job("no_shard", STATIC)
    assert "compressing the outer hop only, 1 buckets" in out
    assert f"EDGC ran (DP static, PP off)" in out
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    dense_outer, outer = outer_bytes_from_shapes(None), outer_bytes_from_shapes(RANK)
    assert outer < dense_outer / 10   # 33284 against 678912 bytes
    for r in records:
        assert r["rank_dp"] == [RANK]
        assert r["dp_slow_hop_bytes_dense"] == dense_outer
        assert r["dp_slow_hop_bytes_sent"] == outer
        assert r["dp_slow_hop_bytes_sent_job"] == 4 * outer
        # Megatron-FSDP's inner all-reduce (the whole bucket once) stays dense
        assert r["dp_bytes_sent"] - outer == r["dp_bytes_dense"] - dense_outer > 0
    # the same weights at iteration 1; measured at iteration 6 (6.941 at the start):
    # dense 6.804, static rank 4 6.886 (no_shard) and 6.884 (optim_grads_params): the
    # tolerance about twice the difference
    assert losses[1] == pytest.approx(dense[1], abs=1e-6)
    assert all(math.isfinite(x) for x in losses.values())
    assert abs(losses[ITERS] - dense[ITERS]) < 0.15, (losses, dense)
    assert losses[ITERS] < losses[1] - 0.02

    ogp_out, ogp, ogp_records = fsdp_job("optim_grads_params", STATIC)
    assert "(optim_grads_params inside 2 instances)" in ogp_out
    assert [r["iteration"] for r in ogp_records] == list(range(1, ITERS + 1))
    for r in ogp_records:   # each rank's shard: half the bucket (and its padding)
        assert dense_outer / 2 <= r["dp_slow_hop_bytes_dense"] < dense_outer / 2 + 4096
        assert 0 < r["dp_slow_hop_bytes_sent_job"] < r["dp_slow_hop_bytes_dense_job"] / 10
    assert ogp[1] == pytest.approx(dense[1], abs=1e-6)
    assert abs(ogp[ITERS] - dense[ITERS]) < 0.15, (ogp, dense)
    assert ogp[ITERS] < ogp[1] - 0.02


def megatron_lm_fsdp_args(*argv, **values):
    """Megatron-LM's ``args`` for the plug-in's flags check: ``argv``'s ``--edgc-*`` flags,
    the rest the HSDP job above (``values`` override)."""
    from megatron_edgc.megatron_lm.flags import add_args

    args = add_args(argparse.ArgumentParser()).parse_args(list(argv))
    base = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
        seq_length=64, max_position_embeddings=64, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, data_parallel_size=4,
        virtual_pipeline_model_parallel_size=None, overlap_grad_reduce=True,
        overlap_param_gather=True, use_distributed_optimizer=True,
        num_distributed_optimizer_instances=2, use_megatron_fsdp=True,
        data_parallel_sharding_strategy="no_shard", outer_dp_sharding_strategy="no_shard",
        micro_batch_size=2, global_batch_size=16, train_iters=6, train_samples=None,
        seed=1234, save=None, load=None, fp16=False, bf16=False, rerun_mode="disabled",
        ckpt_format="fsdp_dtensor")
    base.update(values)
    for name, value in base.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_hsdp_static_accepted(strategy):
    from megatron_edgc.megatron_lm.flags import run_config

    cfg = run_config(megatron_lm_fsdp_args(*STATIC, data_parallel_sharding_strategy=strategy))
    p = cfg.parallel
    assert p.use_megatron_fsdp and p.data_parallel_sharding_strategy == strategy
    assert p.num_distributed_optimizer_instances == 2
    # dense: Megatron-FSDP's own, whatever its form
    assert run_config(megatron_lm_fsdp_args(data_parallel_sharding_strategy="optim",
                                            num_distributed_optimizer_instances=1))


@pytest.mark.parametrize("flags,values,flag,fragment", [
    ([], dict(data_parallel_sharding_strategy="optim_grads"),
     "--data-parallel-sharding-strategy", "allowed: no_shard, optim_grads_params"),
    ([], dict(outer_dp_sharding_strategy="optim"), "--outer-dp-sharding-strategy",
     "optim: not yet"),
    ([], dict(num_distributed_optimizer_instances=1), "--num-distributed-optimizer-instances",
     "HSDP only: needs >= 2"),
    ([], dict(tensor_model_parallel_size=2, data_parallel_size=2), "--use-megatron-fsdp",
     "not yet with TP 2 x PP 1"),
    ([], dict(bf16=True), "--bf16", "set: not yet with --use-megatron-fsdp"),
    ([], dict(fp16=True), "--fp16", "not yet with --use-megatron-fsdp"),
    ([], dict(num_experts=4), "--num-experts", "not yet with --use-megatron-fsdp"),
    ([], dict(save="/tmp/x"), "--save", "not yet with --use-megatron-fsdp"),
    ([], dict(overlap_grad_reduce=False), "--overlap-grad-reduce", "needs it on here"),
    ([], dict(overlap_param_gather=False), "--overlap-param-gather", "needs it on here"),
    (["--edgc-bypass", "auto"], {}, "--edgc-bypass", "auto: not yet with --use-megatron-fsdp"),
    (["--edgc-dense-wire", "bf16"], {}, "--edgc-dense-wire", "allowed: grad"),
])
def test_refused_by_name(flags, values, flag, fragment):
    from megatron_edgc.megatron_lm.flags import run_config

    argv = STATIC + flags
    with pytest.raises(ConfigError) as refused:
        run_config(megatron_lm_fsdp_args(*argv, **values))
    message = str(refused.value)
    assert message.startswith(f"{flag}: ") and fragment in message, message


def test_edgc_mode_refused_by_name():
    from megatron_edgc.megatron_lm.flags import run_config

    with pytest.raises(ConfigError) as refused:
        run_config(megatron_lm_fsdp_args("--edgc-mode", "edgc", "--edgc-bypass", "off",
                                         "--edgc-dense-wire", "grad"))
    assert str(refused.value).startswith("--edgc-mode: edgc: not yet with --use-megatron-fsdp")


@pytest.mark.parametrize("name,flag", [("ddp_average_in_collective",
                                        "--ddp-average-in-collective"),
                                       ("fsdp_double_buffer", "--fsdp-double-buffer"),
                                       ("nccl_ub", "--use-nccl-ub")])
def test_untested_settings_refused_by_name(name, flag):
    from megatron_edgc.megatron_lm.flags import run_config

    with pytest.raises(ConfigError) as refused:
        run_config(megatron_lm_fsdp_args(*STATIC, **{name: True}))
    assert str(refused.value).startswith(f"{flag}: not yet with --use-megatron-fsdp")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU settings")
def test_cpu_settings():
    """On CPU, any --edgc-mode: NCCL's user buffers refused by name, the fused division
    (NCCL's premul-sum) turned off."""
    from megatron_edgc.megatron_lm.cpu_shims import megatron_fsdp_on_cpu

    with pytest.raises(ConfigError) as refused:
        megatron_fsdp_on_cpu(argparse.Namespace(use_megatron_fsdp=True, nccl_ub=True))
    assert str(refused.value).startswith("--use-nccl-ub: not on CPU processes")
    args = argparse.Namespace(use_megatron_fsdp=True, nccl_ub=False,
                              gradient_reduce_div_fusion=True, rank=1)
    megatron_fsdp_on_cpu(args)
    assert args.gradient_reduce_div_fusion is False
