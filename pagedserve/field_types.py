"""Type checks of a dataclass's plain fields (int, float, bool, str, or one of them | None)
against their annotations, for the Python API, which passes values as they come: the command
line and the server's pydantic models have parsed theirs already. At the bottom of the import
graph with ``errors``: it imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import types
import typing
from typing import Any, NamedTuple

_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}


class PlainField(NamedTuple):
    name: str
    kind: type  # int, float, bool or str
    optional: bool  # None is allowed


def plain_fields(cls: type) -> tuple[PlainField, ...]:
    """The fields of dataclass ``cls`` whose annotation is a plain type or it ``| None``; the
    others (dicts, lists, nested configs, ``bool | str``) are left to the class's own checks."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        hint, optional = _without_none(hints[f.name])
        if hint in _KIND_NAMES:
            found.append(PlainField(f.name, hint, optional))
    return tuple(found)


def wrong_type(obj: Any, fields: tuple[PlainField, ...]) -> tuple[str, str] | None:
    """The first field of ``obj`` whose value is not of its type, with what it must be ("must
    be an integer, got '5' (str)"); None if all are."""
    for f in fields:
        value = getattr(obj, f.name)
        if not (value is None and f.optional) and not _is_kind(value, f.kind):
            return f.name, (f"must be {_KIND_NAMES[f.kind]}, got {value!r} "
                            f"({type(value).__name__})")
    return None


def _is_kind(value: Any, kind: type) -> bool:
    # bool is an int in Python, but True as a count or a temperature is a mistake; numpy's
    # integers and floats register as numbers.Integral and numbers.Real. A string may be a
    # pathlib path: the model and folders are paths, and the loader takes them as such.
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, (str, os.PathLike))


def _without_none(hint: Any) -> tuple[Any, bool]:
    """``int | None`` -> ``(int, True)``; a union of two types other than None is kept whole."""
    if not (isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union):
        return hint, False
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    optional = len(args) < len(typing.get_args(hint))
    return (args[0] if len(args) == 1 else hint), optional
