"""Configuration: precedence, and one-line errors naming the flag for bad input."""

import os
import subprocess
import sys
import time

import pytest
import torch

from megatron_edgc.config import ConfigError, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def expect_error(argv, flag, fragment="", world_size=None):
    with pytest.raises(ConfigError) as info:
        parse_config(argv, world_size=world_size)
    message = str(info.value)
    assert message.startswith(flag + ":"), message
    assert fragment in message, message
    assert "\n" not in message
    return message


def test_precedence_default_yaml_cli(small_model_argv):
    cfg = parse_config(small_model_argv)
    assert cfg.model.hidden_size == 64            # CLI over YAML (128)
    assert cfg.parallel.pipeline_model_parallel_size == 2   # from YAML
    assert cfg.model.ffn_hidden_size == 256       # derived default: 4 x hidden
    assert cfg.training.adam_beta2 == 0.95        # dataclass default
    assert cfg.num_microbatches == 2              # 8 / (2 x DP 2)
    assert cfg.parallel.world_size == 4


def test_world_size_from_launcher(small_model_argv):
    argv = [a for a in small_model_argv]
    cfg = parse_config(argv + ["--data-parallel-size", "4", "--global-batch-size", "16"],
                       world_size=8)
    assert cfg.parallel.data_parallel_size == 4
    cfg = parse_config(argv, world_size=4)
    assert cfg.parallel.data_parallel_size == 2


@pytest.mark.parametrize("extra,flag,fragment,world", [
    (["--data-parallel-size", "2"], "--data-parallel-size", "!= world size 8", 8),
    (["--num-layers", "3"], "--num-layers", "divisible by --pipeline-model-parallel-size", None),
    (["--hidden-size", "96", "--num-attention-heads", "3", "--tensor-model-parallel-size", "2",
      "--data-parallel-size", "1", "--global-batch-size", "4"],
     "--num-attention-heads", "divisible by --tensor-model-parallel-size", None),
    (["--hidden-size", "64", "--num-attention-heads", "3"], "--hidden-size", "divisible", None),
    (["--global-batch-size", "10"], "--global-batch-size", "multiple of micro batch x DP", None),
    (["--global-batch-size", "4"], "--global-batch-size", "1F1B needs at least PP = 2", None),
    (["--virtual-pipeline-model-parallel-size", "3"], "--num-layers", "PP x virtual", None),
    (["--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "2"],
     "--virtual-pipeline-model-parallel-size", "needs --pipeline-model-parallel-size >= 2", None),
    (["--num-layers", "0"], "--num-layers", "must be in [1, inf] (got 0)", None),
    (["--lr", "-1"], "--lr", "must be in [0.0, inf]", None),
    (["--adam-beta2", "1.5"], "--adam-beta2", "must be in [0.0, 1.0]", None),
    (["--min-lr", "1e-2"], "--min-lr", "must be <= --lr", None),
    (["--lr-warmup-iters", "50"], "--lr-warmup-iters", "must be < --lr-decay-iters", None),
    (["--seq-length", "256", "--max-position-embeddings", "128"], "--seq-length", "<=", None),
    (["--split", "1,0,0"], "--split", "train and valid > 0", None),
    (["--split", "abc"], "--split", "three comma-separated", None),
    (["--save-interval", "5"], "--save-interval", "needs --save", None),
    (["--load", "/nonexistent/ckpt"], "--load", "is not a directory", None),
    (["--data-path", "/nonexistent/prefix"], "--data-path", "does not exist", None),
    (["--vocab-file", "/nonexistent/vocab.json"], "--vocab-file", "does not exist", None),
    (["--edgc-rank", "0"], "--edgc-rank", "must be in [1, inf] (got 0)", None),
    (["--edgc-rank", "-3"], "--edgc-rank", "must be in [1, inf]", None),
    (["--edgc-min-compression-rate", "0.5"], "--edgc-min-compression-rate", "[1.0, inf]", None),
    (["--edgc-start-iter", "-1"], "--edgc-start-iter", "[0, inf]", None),
    (["--edgc-rank-min", "40", "--edgc-rank-max", "32"], "--edgc-rank-min",
     "must be <= --edgc-rank-max (32)", None),
    (["--edgc-rank-max", "0"], "--edgc-rank-max", "[1, inf]", None),
    (["--edgc-window", "0"], "--edgc-window", "[1, inf]", None),
    (["--edgc-iter-sample-rate", "0"], "--edgc-iter-sample-rate", "(0.0, 1.0]", None),
    (["--edgc-iter-sample-rate", "1.5"], "--edgc-iter-sample-rate", "1.0", None),
    (["--edgc-grad-sample-rate", "-0.1"], "--edgc-grad-sample-rate", "(0.0, 1.0]", None),
    (["--edgc-grad-sample-rate", "2"], "--edgc-grad-sample-rate", "1.0", None),
    (["--edgc-rank-step", "0"], "--edgc-rank-step", "[1, inf]", None),
    (["--edgc-time-budget", "0"], "--edgc-time-budget", "(0.0, 1.0]", None),
    (["--edgc-time-budget", "1.5"], "--edgc-time-budget", "(0.0, 1.0]", None),
    (["--edgc-controller", "accordion"], "--edgc-controller", "paper, budget", None),
    (["--edgc-mode", "edgc", "--edgc-budget-weight", "adam"], "--edgc-budget-weight",
     "needs --edgc-mode edgc --edgc-controller budget", None),
    (["--edgc-mode", "edgc", "--edgc-controller", "budget", "--edgc-budget-weight", "adam",
      "--use-distributed-optimizer"], "--edgc-budget-weight", "distributed optimizer", None),
    (["--edgc-budget-weight", "fisher"], "--edgc-budget-weight", "elements, adam", None),
    # calibrated g fits the paper controller's rank model; the budget controller has none
    (["--edgc-mode", "edgc", "--edgc-controller", "budget", "--edgc-g", "calibrated"],
     "--edgc-g", "the budget controller has no rank model", None),
    (["--edgc-factor-dtype", "fp8"], "--edgc-factor-dtype", "fp32, bf16", None),
    (["--edgc-warmup-eps", "0"], "--edgc-warmup-eps", "(0.0, inf]", None),
    (["--edgc-warmup-windows", "0"], "--edgc-warmup-windows", "[1, inf]", None),
    (["--edgc-entropy", "kde"], "--edgc-entropy", "must be one of gaussian, histogram", None),
    (["--edgc-bypass", "sometimes"], "--edgc-bypass", "must be one of auto, off", None),
    (["--edgc-link-gbps", "0"], "--edgc-link-gbps", "(0.0, inf]", None),
    (["--edgc-link-latency-ms", "-1"], "--edgc-link-latency-ms", "[0.0, inf]", None),
    (["--edgc-link-latency-ms", "2"], "--edgc-link-latency-ms", "needs --edgc-link-gbps",
     None),
    (["--edgc-link-window", "-1"], "--edgc-link-window", "[0, inf]", None),
    (["--edgc-warmup-max-fraction", "0"], "--edgc-warmup-max-fraction", "(0.0, 1.0]", None),
    (["--edgc-warmup-max-fraction", "1.5"], "--edgc-warmup-max-fraction", "(0.0, 1.0]", None),
    (["--edgc-dense-wire", "fp8"], "--edgc-dense-wire", "must be one of grad, bf16", None),
    (["--last-word-examples", "-1"], "--last-word-examples", "[0, inf]", None),
    (["--num-experts", "1"], "--num-experts", "[2, inf]", None),
    # NCCL without a GPU crashed in init_worker (an undefined device)
    pytest.param(["--distributed-backend", "nccl"], "--distributed-backend",
                 "nccl needs CUDA devices", None,
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here")),
    (["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4",
      "--expert-model-parallel-size", "2"], "--expert-model-parallel-size",
     "needs --num-experts", None),
    (["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4", "--num-experts", "6",
      "--expert-model-parallel-size", "3"], "--expert-model-parallel-size",
     "must divide the DP size (4); got 3", None),
    (["--pipeline-model-parallel-size", "1", "--data-parallel-size", "4", "--num-experts", "6",
      "--expert-model-parallel-size", "4"], "--num-experts",
     "must be divisible by --expert-model-parallel-size (4); got 6", None),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk",
     "must be <= --num-experts (4), got 5", None),
    (["--no-bf16", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16", "needs --bf16", None),
    (["--fp16", "--bf16"], "--fp16", "and --bf16 exclude each other", None),
    (["--fp16", "--loss-scale", "0"], "--loss-scale", "must be in (0.0, inf]", None),
    (["--fp16", "--initial-loss-scale", "0.5"], "--initial-loss-scale", "must be in [1.0, inf]", None),
    (["--fp16", "--initial-loss-scale", "1024", "--min-loss-scale", "4096"],
     "--min-loss-scale", "must be <= --initial-loss-scale (1024), got 4096", None),
    (["--fp16", "--loss-scale-window", "0"], "--loss-scale-window", "must be in [1, inf]", None),
    (["--fp16", "--hysteresis", "0"], "--hysteresis", "must be in [1, inf]", None),
    (["--accumulate-allreduce-grads-in-fp32"], "--accumulate-allreduce-grads-in-fp32",
     "applies to --fp16", None),
])
def test_bad_values_name_the_flag(small_model_argv, extra, flag, fragment, world):
    expect_error(small_model_argv + extra, flag, fragment, world)


def test_bad_files(small_model_argv, corpus_data, tmp_path):
    # A tokenizer file that is not one.
    bad_vocab = tmp_path / "vocab.json"
    bad_vocab.write_text("{not json")
    expect_error(small_model_argv + ["--vocab-file", str(bad_vocab)], "--vocab-file",
                 "not a tokenizers JSON file")
    # A real tokenizer, but not the one the data was made with (256 ids < the data's).
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    small = Tokenizer(models.BPE())
    small.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    small.train_from_iterator(["to be or not to be"] * 10, trainers.BpeTrainer(
        vocab_size=260, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"]))
    small.save(str(tmp_path / "small.tokenizer.json"))
    expect_error(small_model_argv + ["--vocab-file", str(tmp_path / "small.tokenizer.json")],
                 "--vocab-file", "beyond this tokenizer's")
    # A truncated .bin and a corrupt .idx.
    prefix = str(tmp_path / "broken")
    data = open(corpus_data["prefix"] + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(data[: len(data) // 2])
    open(prefix + ".idx", "wb").write(open(corpus_data["prefix"] + ".idx", "rb").read())
    expect_error(small_model_argv + ["--data-path", prefix], "--data-path", "truncated")
    open(prefix + ".bin", "wb").write(data)
    open(prefix + ".idx", "wb").write(b"garbage" * 10)
    expect_error(small_model_argv + ["--data-path", prefix], "--data-path",
                 "not a valid Megatron index")
    # Too few documents for a validation split.
    expect_error(small_model_argv + ["--split", "1000,1,0"], "--split", "for validation")
    # Metrics under a regular file cannot be written.
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    expect_error(small_model_argv + ["--metrics-file", str(blocker / "m.jsonl")],
                 "--metrics-file", "cannot be written")


@pytest.mark.parametrize("extra,flag,value", [
    (["--edgc-warmup-eps", "nan"], "--edgc-warmup-eps", "nan"),
    (["--lr", "inf"], "--lr", "inf"),
    (["--edgc-time-budget=-inf"], "--edgc-time-budget", "-inf"),
    (["--edgc-link-gbps", "NaN"], "--edgc-link-gbps", "nan"),
])
def test_non_finite_floats_are_refused(small_model_argv, extra, flag, value):
    message = expect_error(small_model_argv + extra, flag)
    assert message == f"{flag}: must be a finite number (got {value})"


def test_non_finite_yaml_values_are_refused(small_model_argv, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("training:\n  weight_decay: .nan\nedgc:\n  mode: edgc\n")
    message = expect_error(small_model_argv + ["--config", str(cfg)], "--weight-decay")
    assert message == "--weight-decay: must be a finite number (got nan)"
    cfg.write_text("edgc:\n  warmup_eps: .inf\n")
    message = expect_error(small_model_argv + ["--config", str(cfg)], "--edgc-warmup-eps")
    assert message == "--edgc-warmup-eps: must be a finite number (got inf)"


@pytest.mark.parametrize("flag,path", [
    ("--save", "/proc/edgc-ckpt"),
    ("--tensorboard-dir", "/proc/edgc-tb/run1"),
    ("--metrics-file", "/proc/edgc-metrics/m.jsonl"),
    ("--data-cache-path", "/proc/edgc-cache"),
])
def test_unwritable_output_paths_fail_before_training(small_model_argv, flag, path):
    message = expect_error(small_model_argv + [flag, path], flag, "cannot be written")
    assert path in message and "creating a file in /proc fails" in message
    assert not os.path.exists(path)


def test_output_path_that_is_a_file_is_refused(small_model_argv, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    expect_error(small_model_argv + ["--save", str(blocker)], "--save",
                 "exists and is not a directory")
    expect_error(small_model_argv + ["--save", str(blocker / "ckpt")], "--save",
                 "is not a directory")
    expect_error(small_model_argv + ["--metrics-file", str(tmp_path)], "--metrics-file",
                 "is a directory")
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]
    # A path that does not exist yet under a writable directory is fine, and not created.
    cfg = parse_config(small_model_argv + ["--save", str(tmp_path / "a" / "b")])
    assert cfg.checkpoint.save == str(tmp_path / "a" / "b")
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]


def test_edgc_yaml_section_and_flags(small_model_argv, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("edgc:\n  mode: static\n  rank: 16\n")
    cfg = parse_config(small_model_argv + ["--config", str(cfg_file)])
    assert (cfg.edgc.mode, cfg.edgc.rank) == ("static", 16)
    cfg = parse_config(small_model_argv + ["--config", str(cfg_file), "--edgc-rank", "4"])
    assert cfg.edgc.rank == 4
    cfg_file.write_text("edgc:\n  mode: sometimes\n")
    expect_error(small_model_argv + ["--config", str(cfg_file)], "--edgc-mode",
                 "must be one of off, static, edgc")


def test_bad_yaml(small_model_argv, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  num_layerz: 4\n")
    expect_error(small_model_argv + ["--config", str(cfg)], "--config", "unknown key model.num_layerz")
    cfg.write_text("modle:\n  num_layers: 4\n")
    expect_error(small_model_argv + ["--config", str(cfg)], "--config", "unknown section")
    cfg.write_text("model:\n  hidden_size: sixty-four\n")
    argv = [a for i, a in enumerate(small_model_argv)
            if "--hidden-size" not in small_model_argv[max(0, i - 1):i + 1]]
    expect_error(argv + ["--config", str(cfg)], "--hidden-size", "must be an integer")
    expect_error(small_model_argv + ["--config", str(tmp_path / "none.yaml")], "--config",
                 "does not exist")


def test_cli_fails_fast_with_one_line(small_model_argv):
    start = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt2_edgc.py"),
                           *small_model_argv, "--num-layers", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip() and "Warning" not in l
             and "warnings.warn" not in l]
    assert lines == [lines[0]] and lines[0].startswith("error: --num-layers:"), proc.stderr
    assert proc.stdout == ""
    assert time.time() - start < 30  # no process group, no model: config only


def test_validation_reads_no_file(small_model_argv, tmp_path):
    """Values are checked without the files (parse_values); the run's files at run start
    (parse_config = parse_values + check_run_inputs), still before any process group."""
    from megatron_edgc.config import parse_values

    argv = small_model_argv + ["--data-path", str(tmp_path / "none"), "--save", "/proc/ck"]
    cfg = parse_values(argv)
    assert cfg.data.tokenizer_vocab_size is None and cfg.compression_notes == []
    expect_error(argv, "--data-path", "does not exist")
    expect_error(small_model_argv + ["--save", "/proc/ck"], "--save", "cannot be written")
    assert sorted(os.listdir(tmp_path)) == []


def test_warmup_bound_follows_the_run(small_model_argv):
    """Without --edgc-warmup-max-iters the dense warm-up ends by the first window end from
    10 % of --train-iters: for the paper controller a bound on the dense part (its rank
    decisions wait for the stability rule), for the budget controller the warm-up's end;
    the absolute cap wins where given; fraction 1 is the paper's rule alone."""
    def bounds(*extra):
        cfg = parse_config(small_model_argv + ["--edgc-mode", "edgc", *extra])
        return cfg.edgc.warmup_bounds(cfg.training.train_iters)
    assert bounds("--train-iters", "200") == (None, 4)          # 2 % (issue 64)
    assert bounds("--train-iters", "1001") == (None, 21)
    assert bounds("--train-iters", "200", "--edgc-controller", "budget") == (4, None)
    assert bounds("--train-iters", "200", "--edgc-warmup-max-fraction", "0.25") == (None, 50)
    assert bounds("--train-iters", "200", "--edgc-warmup-max-iters", "80") == (80, None)
    assert bounds("--train-iters", "200", "--edgc-warmup-max-fraction", "1") == (None, None)


def test_edgc_flags_grouped_in_both_parsers():
    """--help lists EDGC's knobs as method, controller, diagnostics; the plug-in's parser
    has the same groups and flags (plus its own two, in diagnostics)."""
    import argparse
    import dataclasses

    from megatron_edgc.config import EdgcConfig, build_arg_parser
    from megatron_edgc.megatron_lm import add_args

    def groups(parser):
        return {g.title: [a.option_strings[0] for a in g._group_actions]
                for g in parser._action_groups if g.title.startswith("EDGC")}

    titles = [title for title, _ in EdgcConfig.GROUPS.values()]
    assert titles == ["EDGC method", "EDGC controller", "EDGC diagnostics"]
    trainer, plug_in = groups(build_arg_parser()), groups(add_args(argparse.ArgumentParser()))
    assert list(trainer) == list(plug_in) == titles
    keys = [f.metadata["group"] for f in dataclasses.fields(EdgcConfig)]
    assert keys == sorted(keys, key=list(EdgcConfig.GROUPS).index)   # declared in order
    assert trainer["EDGC method"][:2] == ["--edgc-mode", "--edgc-rank"]
    assert plug_in == {**trainer, "EDGC diagnostics": trainer["EDGC diagnostics"]
                       + ["--edgc-metrics-file", "--edgc-allow-untested-megatron"]}
    assert sum(map(len, trainer.values())) == len(keys) == 42
    help_text = build_arg_parser().format_help()
    assert help_text.index("EDGC method:") < help_text.index("EDGC controller:") < \
        help_text.index("EDGC diagnostics:")


ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx f16c avx2 bmi2 sha_ni vaes
"""
SAPPHIRE = """model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile
"""
GRAVITON = """processor\t: 0
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 i8mm
"""


XEON_207 = """model name\t: Intel(R) Xeon(R) Processor
cpu family\t: 6
model\t\t: 207
flags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16 avx512_vnni
"""
ZEN4 = """model name\t: AMD EPYC
cpu family\t: 25
model\t\t: 17
flags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16 avx512_vnni
"""


def test_cpu_bf16_instructions_from_cpuinfo():
    """Which CPUs carry bf16 instructions, named in the start-up line."""
    from megatron_edgc.config import host

    native, what = host.cpu_bf16_from(ZEN3)
    assert not native and "AMD EPYC has no native bf16 (AVX2" in what
    native, what = host.cpu_bf16_from(SAPPHIRE)
    assert native and "AVX512-BF16, AMX-BF16" in what
    assert host.cpu_bf16_from(GRAVITON)[0]
    assert host.cpu_bf16_from(XEON_207) == (True, "Intel(R) Xeon(R) Processor has native "
                                                  "bf16 (AVX512-BF16)")
    assert host.cpu_bf16_from("flags : avx512f avx2")[1].count("AVX-512") == 1


@pytest.mark.parametrize("info, timed, expected", [
    (ZEN3, None, "fp32"),                  # no bf16 instructions: by rule, nothing timed
    (XEON_207, (0.133, 0.229), "fp32"),    # AVX512-BF16, no AMX: bf16 1.7x slower
    (ZEN4, (0.0033, 0.0020), "bf16"),      # AVX512-BF16 on a Zen 4: bf16 0.6x
    (SAPPHIRE, (0.010, 0.004), "bf16"),    # AMX
    (ZEN4, (0.0100, 0.0095), "fp32"),      # a tie goes to fp32 (BF16_FASTER_BELOW)
], ids=["zen3", "xeon-207", "zen4", "amx", "tie"])
def test_an_unset_bf16_on_a_cpu_takes_what_it_computes_faster(info, timed, expected,
                                                               monkeypatch, small_model_argv):
    """Issue 91: an unset --bf16 on a CPU takes the precision this CPU runs the model's
    MLP faster in (timed at its shapes where it has bf16 instructions, fp32 by rule where
    it has none), and the start-up line says which and why; a set flag wins and times
    nothing; a resume takes its checkpoint's precision."""
    from megatron_edgc.config import host

    native, what = host.cpu_bf16_from(info)
    assert native == (timed is not None)
    shapes = []

    def time_layer(shape, reps=host.PROBE_REPS):
        shapes.append(shape)
        return timed

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(host, "cpu_bf16", lambda: (native, what))
    monkeypatch.setattr(host, "time_layer", time_layer)
    argv = [a for a in small_model_argv if a != "--no-bf16"]
    cfg = parse_config(argv)
    assert cfg.training.bf16 is None and cfg.bf16_by_cpu and cfg.cpu_precision is None
    assert cfg.precision == expected
    # the model's MLP: the tokens of a micro-batch (2 x 64), hidden 64, 4 x 64
    assert shapes == ([] if timed is None else [(128, 64, 256)])
    note = cfg.precision_note
    assert note.startswith(f"precision: {expected} (unset --bf16 on a CPU: {what}"), note
    if timed is not None:
        ratio = timed[1] / timed[0]
        assert f"in bf16, {timed[0] * 1e3:.2f} in fp32 ({ratio:.2f}x: {expected} is " \
               f"faster here)" in note, note
    shapes.clear()
    for flag, precision in (("--bf16", "bf16"), ("--no-bf16", "fp32")):
        forced = parse_config(argv + [flag])
        assert forced.precision == precision and not forced.bf16_by_cpu
        assert ("(--no-bf16) runs faster here" in forced.precision_note) == (
            precision == "bf16" and not native)
    resumed = parse_config(argv)
    resumed.resolve_cpu_precision(resumed=("bf16", "ckpt, iteration 10"))
    assert resumed.precision == "bf16" and "bf16, as the run it resumes (ckpt, iteration " \
        "10)" in resumed.precision_note
    assert shapes == []
    with pytest.raises(ConfigError, match="--grad-reduce-in-bf16.*set it"):
        parse_config(argv + ["--grad-reduce-in-bf16"])
    assert host.probe_shape(2048, 1024, 4096) == (64, 1024, 4096)   # GPT-2 medium: capped


def test_the_cpu_precision_timing_is_brief_and_finite():
    """The layer :func:`~megatron_edgc.config.host.measure` times, on this CPU: both
    precisions positive and finite, the tiny config's shapes uncapped."""
    from megatron_edgc.config import host

    shape = host.probe_shape(512, 128, 512)
    assert shape == (512, 128, 512)
    fp32_s, bf16_s = host.time_layer(shape, reps=2)
    assert 0 < fp32_s < 5 and 0 < bf16_s < 60
