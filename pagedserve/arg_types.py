"""``type=`` functions for argparse shared by the commands: a bad value ends in argparse's
one-line error and exit code 2 before anything is loaded or run."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive(kind: type) -> Callable[[str], int | float]:
    """``kind`` (int or float) parsed from the text, refused unless positive and finite."""
    what = "a positive integer" if kind is int else "a positive finite number"

    def parse(text: str) -> int | float:
        value = kind(text)
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse
