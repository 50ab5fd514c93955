"""The start-up compressibility check: shapes from the config, counts, refused ranks.

(The shapes are held against the real megatron-core model in
``test_dp_compression.py::test_static_rank_trains_with_bytes_from_shapes``.)"""

from types import SimpleNamespace

import pytest

from megatron_edgc.config import ConfigError, parse_config
from megatron_edgc.model_shapes import (activation_grad_max_rank, compressibility,
                                        largest_compressing_rank, stage_param_shapes)


def tiny(**kw):
    model = SimpleNamespace(hidden_size=64, ffn_hidden_size=None, num_layers=2, seq_length=32,
                            max_position_embeddings=32, make_vocab_size_divisible_by=128)
    parallel = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    for k, v in kw.items():
        setattr(parallel if k.endswith("_size") and "parallel" in k else model, k, v)
    return model, parallel


def test_shapes_per_stage_and_tp_shard():
    model, parallel = tiny(pipeline_model_parallel_size=2, tensor_model_parallel_size=2)
    first, last = stage_param_shapes(model, parallel, vocab_size=300)
    # Vocabulary padded to a multiple of 128 x TP = 256 -> 512, split over TP 2.
    assert first[:2] == [(256, 64), (32, 64)]
    assert last[-1] == (256, 64)  # the output layer's copy of the tied embedding
    assert sorted(s for s in first if len(s) == 2) == sorted(
        [(256, 64), (32, 64), (96, 64), (64, 32), (128, 64), (64, 128)])
    assert sum(len(s) == 1 for s in last) == 8 + 2  # 4 LayerNorm vectors + 4 biases, final LN


def test_compressibility_counts_and_largest_rank():
    shapes = [(64, 64), (256, 64), (64,), (3, 100)]
    # rank 8 at rate 2: 64x64 -> (128)*8*2 = 2048 <= 4096 yes; 256x64 yes; 3x100 no.
    c = compressibility(shapes, 8, 2.0)
    assert (c.matrices, c.compressible) == (3, 2)
    assert c.numel == 64 * 64 + 256 * 64 + 64 + 300
    assert c.byte_share == pytest.approx((64 * 64 + 256 * 64) / c.numel)
    # 256x64: (320) r 2 <= 16384 -> r <= 25; 64x64: r <= 16; 3x100: never at rate 2 (r=1:
    # 103*2 = 206 <= 300 yes!) -> 1.
    assert largest_compressing_rank(shapes, 2.0) == 25
    assert compressibility(shapes, 25, 2.0).compressible == 1
    assert compressibility(shapes, 26, 2.0).compressible == 0
    assert largest_compressing_rank([(64,), (1, 50)], 2.0) == 0


def test_activation_rank_limit():
    model = SimpleNamespace(seq_length=128, hidden_size=128)
    limit = activation_grad_max_rank(model, micro_batch_size=4)   # n = 512, m = 128
    assert (512 + 128) * limit < 512 * 128 <= (512 + 128) * (limit + 1)


def test_refused_ranks_name_the_flag(small_model_argv):
    def error(extra):
        with pytest.raises(ConfigError) as info:
            parse_config(small_model_argv + extra)
        return str(info.value)

    # hidden 64, vocab 2048 padded: the largest compressing rank is the embedding's.
    msg = error(["--edgc-mode", "static", "--edgc-rank", "100000"])
    assert msg.startswith("--edgc-rank: no weight matrix of this model compresses at rank "
                          "100000 (a matrix n x m compresses at rank r when r < min(n, m) and "
                          "(n + m) r x 2 <= n m (--edgc-min-compression-rate)); the largest "
                          "rank at which one does is ")
    top = int(msg.rsplit(" ", 1)[1])
    assert error(["--edgc-mode", "static", "--edgc-rank", str(top + 1)]).startswith(
        f"--edgc-rank: no weight matrix of this model compresses at rank {top + 1} ")
    cfg = parse_config(small_model_argv + ["--edgc-mode", "static", "--edgc-rank", str(top)])
    # Only the word embedding and its copy on the last stage (PP 2) are wide enough.
    assert cfg.compression_notes[0].startswith(
        f"DP compression (static): at rank {top} 2 of 19 weight matrices compress (")
    assert error(["--edgc-mode", "edgc", "--edgc-rank-max", "200", "--edgc-rank-min", "100"]
                 ).startswith("--edgc-rank-min: no weight matrix of this model compresses at "
                              "rank 100 ")
    # r_max beyond every matrix but r_min fine: allowed, with the warning in the notes.
    cfg = parse_config(small_model_argv + ["--edgc-mode", "edgc", "--edgc-rank-max", "200",
                                           "--edgc-rank-min", "4"])
    assert cfg.compression_notes[0].startswith(
        "DP compression (edgc): r_max: at rank 200 0 of 19 weight matrices compress (0.0 % of "
        "the gradient bytes); r_min: at rank 4 19 of 19")
    assert cfg.compression_notes[0].endswith(
        "; warning: nothing compresses at --edgc-rank-max 200 (largest compressing rank 31)")
    # PP: micro-batch 2 x sequence 64 = 128 rows, hidden 64 -> 128*64/(192) -> 42 saves
    # bytes; full rank 64 reproduces dense (a test mode: allowed, with a warning); beyond
    # full rank nothing changes: refused.
    assert error(["--edgc-mode", "static", "--edgc-pp-compression", "static",
                  "--edgc-pp-rank", "65"]) == (
        "--edgc-pp-rank: 65 exceeds the full rank 64 of a backward activation gradient "
        "(sequence x micro-batch rows, hidden columns); ranks up to 42 save bytes")
    assert error(["--edgc-mode", "edgc", "--edgc-pp-compression", "edgc",
                  "--edgc-pp-rank-max", "100", "--edgc-pp-rank-min", "8"]).startswith(
        "--edgc-pp-rank-max: 100 exceeds the full rank 64")
    cfg = parse_config(small_model_argv + ["--edgc-pp-compression", "static",
                                           "--edgc-pp-rank", "43"])
    assert cfg.compression_notes == [
        "PP compression (static): backward sends at rank 43 (ranks up to 42 save bytes); "
        "warning: at --edgc-pp-rank 43 a send is no smaller than dense (full rank 64 "
        "reproduces dense exactly)"]
