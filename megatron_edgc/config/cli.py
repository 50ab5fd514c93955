"""Flags and YAML into a :class:`RunConfig`: the trainer's parser (one argument group per
section, EDGC's three in their order), the YAML sections, and :func:`parse_values`.
Precedence: dataclass default < YAML < command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Callable, Optional

import yaml

from megatron_edgc.config.knobs import ConfigError, base_type, flag_of
from megatron_edgc.config.run import RunConfig

#: The tiny CPU default, shipped in the package (``configs/`` at the top of the source
#: tree links here).
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "tiny-cpu.yaml")


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="GPT-2 pretraining on megatron-core with EDGC gradient compression.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG,
                        help="YAML config; flags below override its values")
    parser.add_argument("--allow-untested-megatron", action="store_true",
                        help="run on a megatron-core version the patches were not tested with")
    for section_name, section in RunConfig().sections():
        add_knob_arguments(parser, type(section), title=section_name,
                           dest=lambda f, s=section_name: f"{s}.{f.name}",
                           default=lambda f: argparse.SUPPRESS)
    return parser


def add_knob_arguments(parser, section_cls, *, title: str, dest: Callable,
                       default: Callable) -> dict:
    """Every knob of ``section_cls`` as a flag, in one argument group named ``title``; a
    section with ``GROUPS`` (EDGC) gets one group per entry, in that order, each field in
    the group its ``group`` tag names. ``dest(field)`` and ``default(field)`` give each
    flag's destination and default. Returns the groups by key (``None``: the one group)."""
    spec = getattr(section_cls, "GROUPS", None)
    groups = {key: parser.add_argument_group(name, about)
              for key, (name, about) in spec.items()} if spec else \
        {None: parser.add_argument_group(title)}
    for f in dataclasses.fields(section_cls):
        group = groups[f.metadata["group"]] if spec else groups[None]
        add_knob_argument(group, flag_of(f.name, section_cls), f, dest=dest(f),
                          default=default(f))
    return groups


def add_knob_argument(group, flag: str, f, *, dest: str, default) -> None:
    """One flag for the :func:`knob` field ``f``: its type, help and default shown."""
    base, meta = base_type(f.type), f.metadata
    kwargs = dict(dest=dest, default=default, help=f"{meta['help']} (default {f.default})")
    if base is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
    else:
        # Choices are checked by the validator, so every bad value gets the same
        # one-line "--flag: must be one of ..." error.
        metavar = "{" + ",".join(map(str, meta["choices"])) + "}" if meta.get("choices") \
            else base.__name__.upper()
        group.add_argument(flag, type=base, metavar=metavar, **kwargs)


def _apply_yaml(cfg: RunConfig, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError("--config", f"{path} does not exist")
    try:
        with open(path) as fh:
            doc = yaml.safe_load(fh) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("--config", f"{path} is not valid YAML: {str(exc).splitlines()[0]}")
    if not isinstance(doc, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of sections")
    sections = dict(cfg.sections())
    for section_name, values in doc.items():
        if section_name not in sections:
            raise ConfigError("--config", f"{path}: unknown section {section_name!r} "
                                          f"(known: {', '.join(sections)})")
        section = sections[section_name]
        names = {f.name for f in dataclasses.fields(section)}
        for key, value in (values or {}).items():
            if key not in names:
                raise ConfigError("--config", f"{path}: unknown key {section_name}.{key}")
            setattr(section, key, value)


def parse_values(argv=None, world_size: Optional[int] = None) -> RunConfig:
    """YAML (``--config``) + flag overrides → a :class:`RunConfig` whose values are
    validated (:meth:`RunConfig.validate`); no file but the YAML is read."""
    args = build_arg_parser().parse_args(argv)
    cfg = RunConfig(config_file=args.config, allow_untested_megatron=args.allow_untested_megatron)
    _apply_yaml(cfg, args.config)
    sections = dict(cfg.sections())
    for dest, value in vars(args).items():
        if "." in dest:
            section_name, name = dest.split(".", 1)
            setattr(sections[section_name], name, value)
    return cfg.validate(world_size)
