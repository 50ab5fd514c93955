"""The paper's two setups: their configs validate at their world sizes; parameter counts."""

import os

import pytest

from megatron_edgc.config import parse_config
from megatron_edgc.model_shapes import padded_vocab_size
from megatron_edgc.training.model import count_parameters

from distributed import run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,world,billions,precision", [
    ("gpt2-2.5b-v100x32.yaml", 32, 2.5, "fp16"),   # a V100 has no bf16
    ("gpt2-12.1b-h100x64.yaml", 64, 12.1, "bf16"),
])
def test_paper_config(name, world, billions, precision, corpus_data):
    cfg = parse_config(["--config", os.path.join(ROOT, "configs", name),
                        "--data-path", corpus_data["prefix"]], world_size=world)
    assert cfg.parallel.world_size == world
    if precision == "fp16":   # the precision its users train in, with the dynamic scaler
        assert cfg.precision == "fp16" and cfg.training.loss_scale is None
    e = cfg.edgc
    assert (e.mode, e.pp_compression, e.dac, e.window, e.rank_min) == ("edgc", "edgc", "on", 1000, 16)
    vocab = padded_vocab_size(50257, cfg.model.make_vocab_size_divisible_by,
                              cfg.parallel.tensor_model_parallel_size)
    n = count_parameters(cfg, vocab)
    assert abs(n / 1e9 - billions) / billions < 0.02, n


def test_parameter_formula_matches_megatron_gpt_model(small_model_argv, tmp_path):
    """count_parameters() equals the real megatron-core GPTModel's count (one process)."""
    argv = small_model_argv + ["--pipeline-model-parallel-size", "1", "--data-parallel-size",
                               "1", "--train-iters", "3", "--eval-iters", "1"]
    (result,) = run_job(argv, str(tmp_path / "out"))
    n = sum(p.numel() for p in result["params"].values())
    assert n == count_parameters(parse_config(argv), 2048) == 335_232  # 4 x 78,912 per layer + 2048 x 64 + 64 x 64 + 128
