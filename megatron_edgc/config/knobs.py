"""What a knob is: a dataclass field with its help, range and group, its flag, and the
checks of one field's value against its declaration (type, finiteness, range, choices)."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import field
from typing import Any, Optional


class ConfigError(ValueError):
    """A bad configuration value; ``str()`` is one line that starts with the flag."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


def knob(default: Any, help: str, *, min: Optional[float] = None, max: Optional[float] = None,
         choices: Optional[tuple] = None, min_exclusive: bool = False,
         group: Optional[str] = None):
    """A dataclass field carrying its help text and allowed range; ``group``: the key of
    the section's ``GROUPS`` entry its flag is listed under (sections that have them)."""
    return field(default=default, metadata=dict(help=help, min=min, max=max, choices=choices,
                                                min_exclusive=min_exclusive, group=group))


def flag_of(name: str, section=None) -> str:
    """``num_layers`` -> ``--num-layers``; a section may prefix its flags (``--edgc-rank``)."""
    prefix = getattr(section, "FLAG_PREFIX", "") if section is not None else ""
    return "--" + (prefix + name).replace("_", "-")


def base_type(tp) -> type:
    """int for ``Optional[int]``, etc."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # annotations are strings under __future__
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def check_ranges(section) -> None:
    """Apply every field's declared type, range and choices (integral numbers become int)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if value is None:
            continue
        meta, flag = f.metadata, flag_of(f.name, section)
        base = base_type(f.type)
        if base is bool and not isinstance(value, bool):
            raise ConfigError(flag, f"must be true or false (got {value!r})")
        if base in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                     or (base is int and not float(value).is_integer())):
            raise ConfigError(flag, f"must be {'an integer' if base is int else 'a number'} "
                                    f"(got {value!r})")
        if base is float and not math.isfinite(value):
            raise ConfigError(flag, f"must be a finite number (got {value})")
        if base is int:
            setattr(section, f.name, int(value))
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise ConfigError(flag, f"must be one of {', '.join(map(str, meta['choices']))} "
                                    f"(got {value!r})")
        lo, hi = meta.get("min"), meta.get("max")
        below = lo is not None and (value <= lo if meta.get("min_exclusive") else value < lo)
        if below or (hi is not None and value > hi):
            opening = "(" if meta.get("min_exclusive") or lo is None else "["
            rng = f"{opening}{lo if lo is not None else '-inf'}, " \
                  f"{hi if hi is not None else 'inf'}]"
            raise ConfigError(flag, f"must be in {rng} (got {value})")
