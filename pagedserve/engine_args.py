"""Command-line flags for the engine, derived from ``EngineConfig``'s fields.

The field ``max_num_seqs`` is the flag ``--max-num-seqs`` (vLLM's names); its type, default,
help and choices come from the field. A boolean is a switch that flips its default
(``--enforce-eager``, ``--no-enable-prefix-caching``); a ``bool | None`` is tri-state
(``--async-scheduling`` / ``--no-async-scheduling``, unset: the platform decides).
``pagedserve serve`` lets ``--model`` repeat (``models_dest``), one engine per model.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from pagedserve.config import EngineConfig, flag_name


def add_engine_args(parser: argparse.ArgumentParser, models_dest: str | None = None) -> None:
    """With ``models_dest``, ``--model`` may be given several times: each value is appended to
    ``args.<models_dest>`` and ``args.model`` keeps the first, so a command line of one model
    reads as it would without."""
    group = parser.add_argument_group("engine")
    exclusive: dict[str, Any] = {}
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        name = f.metadata["exclusive"]
        if name is not None and name not in exclusive:
            exclusive[name] = group.add_mutually_exclusive_group()
        target = group if name is None else exclusive[name]
        flag, kwargs = _argument(f, hints[f.name])
        if f.name == "model" and models_dest is not None:
            kwargs.update(action=_AppendModel, models_dest=models_dest)
        target.add_argument(flag, dest=f.name, default=f.default, **kwargs)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The flags' config, with ``overrides`` (option names) in place of some of them."""
    return EngineConfig(**{f.name: getattr(args, f.name)
                           for f in dataclasses.fields(EngineConfig)} | overrides)


class _AppendModel(argparse.Action):
    """``--model`` of a command serving several models (``add_engine_args``)."""

    def __init__(self, *args: Any, models_dest: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.models_dest = models_dest

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        models = [*(getattr(namespace, self.models_dest, None) or []), value]
        setattr(namespace, self.models_dest, models)
        setattr(namespace, self.dest, models[0])


def _argument(f: dataclasses.Field, hint: Any) -> tuple[str, dict[str, Any]]:
    """The flag of one field and ``add_argument``'s keywords for it."""
    flag, help_text = flag_name(f.name), f.metadata["help"]
    if hint is bool and f.default:
        help_text += " (on by default; this turns it off)"
        return "--no-" + flag.removeprefix("--"), {"action": "store_false", "help": help_text}
    if hint is bool:
        return flag, {"action": "store_true", "help": help_text}
    if typing.get_origin(hint) is tuple:  # a list of names, given after one flag
        return flag, {"nargs": "+", "type": str, "help": help_text}
    value_type = _value_type(hint)
    if value_type is bool:
        return flag, {"action": argparse.BooleanOptionalAction, "help": help_text}
    if f.default is not None:
        help_text += " (default: %(default)s)"
    # A structured option (a config dataclass or a dict) is JSON text, which EngineConfig
    # parses, so its errors read as the config's own.
    structured = dataclasses.is_dataclass(value_type) or typing.get_origin(value_type) is dict
    parse = str if structured else value_type
    return flag, {"type": parse, "choices": f.metadata["choices"], "help": help_text}


def _value_type(hint: Any) -> type:
    """``int | None`` -> ``int``."""
    if isinstance(hint, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint
