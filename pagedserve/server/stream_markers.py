"""What a stream holds back at a marker it may be in the middle of (a tool call's or a
reasoning block's tag): the parsers pass text on as it comes, except the end that could still
turn out to be the start of the marker."""

from __future__ import annotations


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
