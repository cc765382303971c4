"""``type=`` functions and actions for argparse shared by the commands: a bad value ends in
argparse's one-line error and exit code 2 before anything is loaded or run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def _checked(kind: type, accepts: Callable[[int | float], bool],
             what: str) -> Callable[[str], int | float]:
    """``kind`` parsed from the text, refused unless ``accepts`` it."""

    def parse(text: str) -> int | float:
        value = kind(text)
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def positive(kind: type) -> Callable[[str], int | float]:
    """``kind`` (int or float) parsed from the text, refused unless positive and finite."""
    what = "a positive integer" if kind is int else "a positive finite number"
    return _checked(kind, lambda value: 0 < value < math.inf, what)


def non_negative(kind: type) -> Callable[[str], int | float]:
    """``kind`` (int or float), refused unless 0 or more and finite: for a flag whose 0
    means none."""
    what = "an integer of 0 or more" if kind is int else "a finite number of 0 or more"
    return _checked(kind, lambda value: 0 <= value < math.inf, what)


def at_least(minimum: int) -> Callable[[str], int | float]:
    """An integer, refused below ``minimum``."""
    return _checked(int, lambda value: value >= minimum, f"an integer of at least {minimum}")


fraction = _checked(float, lambda value: 0 < value <= 1, "a fraction in (0, 1]")
port = _checked(int, lambda value: 0 <= value <= 65535, "a port number in [0, 65535]")
# An empty secret or name would mean none.
non_empty = _checked(str, bool, "a non-empty string")


class MinMax(argparse.Action):
    """Two values, MIN and MAX, stored as a tuple; refused where MIN exceeds MAX (a range a
    workload draws from, which would be empty)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        kwargs.setdefault("metavar", ("MIN", "MAX"))
        super().__init__(option_strings, dest, nargs=2, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        low, high = values
        if low > high:
            raise argparse.ArgumentError(self, f"MIN must not exceed MAX, got {low} {high}")
        setattr(namespace, self.dest, (low, high))
