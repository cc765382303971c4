"""Command-line flags for the engine, derived from ``EngineConfig``'s fields.

The field ``max_num_seqs`` is the flag ``--max-num-seqs`` (vLLM's names); its type, default,
help and choices come from the field. A boolean is a switch that flips its default
(``--enforce-eager``, ``--no-enable-prefix-caching``); a ``bool | None`` is tri-state
(``--async-scheduling`` / ``--no-async-scheduling``, unset: the platform decides).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from pagedserve.config import EngineConfig, flag_name


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    exclusive: dict[str, Any] = {}
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        name = f.metadata["exclusive"]
        if name is not None and name not in exclusive:
            exclusive[name] = group.add_mutually_exclusive_group()
        target = group if name is None else exclusive[name]
        flag, kwargs = _argument(f, hints[f.name])
        target.add_argument(flag, dest=f.name, default=f.default, **kwargs)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name)
                           for f in dataclasses.fields(EngineConfig)})


def _argument(f: dataclasses.Field, hint: Any) -> tuple[str, dict[str, Any]]:
    """The flag of one field and ``add_argument``'s keywords for it."""
    flag, help_text = flag_name(f.name), f.metadata["help"]
    if hint is bool and f.default:
        help_text += " (on by default; this turns it off)"
        return "--no-" + flag.removeprefix("--"), {"action": "store_false", "help": help_text}
    if hint is bool:
        return flag, {"action": "store_true", "help": help_text}
    value_type = _value_type(hint)
    if value_type is bool:
        return flag, {"action": argparse.BooleanOptionalAction, "help": help_text}
    if f.default is not None:
        help_text += " (default: %(default)s)"
    # A structured option (a config dataclass) is JSON text, which EngineConfig parses, so
    # its errors read as the config's own.
    parse = str if dataclasses.is_dataclass(value_type) else value_type
    return flag, {"type": parse, "choices": f.metadata["choices"], "help": help_text}


def _value_type(hint: Any) -> type:
    """``int | None`` -> ``int``."""
    if isinstance(hint, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint
