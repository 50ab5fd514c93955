"""Validated run configuration: one dataclass per concern, YAML sections and flags 1:1.

Every field is a knob with a default, a help line and (where it has one) a range. The
YAML file has one section per dataclass (``model:``, ``parallel:``, ...) whose keys are
the field names; each field is also a Megatron-style flag (``num_layers`` is
``--num-layers``). Precedence: dataclass default < YAML < command line.

Validation (:meth:`RunConfig.validate`) checks values only; the files a run reads and
writes are checked at run start (:mod:`.run_inputs`). :func:`parse_config`, the trainer's
entry, does both, in one process, before any process group exists; every error is a
:class:`ConfigError` whose message starts with the flag it is about. The modules:

* :mod:`.knobs`: a knob, its flag, the per-field checks;
* :mod:`.sections`: model, parallel, training, data, eval, logging, checkpoint;
* :mod:`.edgc`: EDGC's knobs, grouped as method, controller, diagnostics;
* :mod:`.rules`: the rules between sections, :func:`validate_edgc` for both front-ends;
* :mod:`.run`: :class:`RunConfig`; :mod:`.cli`: flags and YAML; :mod:`.run_inputs`: files.
"""

from __future__ import annotations

from typing import Optional

from megatron_edgc.config.cli import (DEFAULT_CONFIG, add_knob_argument, add_knob_arguments,
                                      build_arg_parser, parse_values)
from megatron_edgc.config.edgc import EdgcConfig
from megatron_edgc.config.knobs import ConfigError, base_type, check_ranges, flag_of, knob
from megatron_edgc.config.rules import check_run_layout, validate_edgc
from megatron_edgc.config.run import RunConfig
from megatron_edgc.config.run_inputs import check_run_inputs, check_writable
from megatron_edgc.config.sections import (CheckpointConfig, DataConfig, EvalConfig,
                                           LoggingConfig, ModelConfig, ParallelConfig,
                                           TrainingConfig)

__all__ = ["ConfigError", "knob", "flag_of", "base_type", "check_ranges", "ModelConfig",
           "ParallelConfig", "TrainingConfig", "DataConfig", "EvalConfig", "LoggingConfig",
           "CheckpointConfig", "EdgcConfig", "RunConfig", "validate_edgc", "check_run_layout",
           "DEFAULT_CONFIG", "build_arg_parser", "add_knob_arguments", "add_knob_argument",
           "parse_values", "check_writable", "check_run_inputs", "parse_config"]


def parse_config(argv=None, world_size: Optional[int] = None) -> RunConfig:
    """YAML (``--config``) + flag overrides → a validated :class:`RunConfig` whose files were
    checked: :func:`parse_values`, then :func:`check_run_inputs` (the run's start)."""
    # The trainer's tokenizer and checkpoint formats, the one reach of config/ into
    # training/ (docs/layout.md: inside this function only).
    from megatron_edgc.training import checkpoint_files, tokenizer

    return check_run_inputs(parse_values(argv, world_size), tokenizer, checkpoint_files)
