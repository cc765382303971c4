"""Streamed chat deltas added up as a client adds them up, with every delta's shape checked
(OpenAI's): a call's first delta carries its index (the next one), id, type and name; the
later ones only its index and more of its arguments."""

from __future__ import annotations

from typing import NamedTuple

from pagedserve.server.tool_parsers import ParsedCall


class Added(NamedTuple):
    contents: list[str]  # each delta's content ("" for none)
    calls: list[ParsedCall]  # the calls, each with its arguments' pieces joined
    pieces: list[int]  # how many pieces of arguments each call came in


def add_up(deltas: list[dict], expected: list[tuple[str, str]] = ()) -> Added:
    """``deltas`` (as dicts) added up. Each call's arguments are checked, after every delta,
    to start the ``expected`` (name, arguments)'s, where there is one: no piece is wrong."""
    contents, calls, pieces = [], [], []
    for delta in deltas:
        contents.append(delta.get("content") or "")
        for d in delta.get("tool_calls") or ():
            index, function = d["index"], d["function"]
            if index == len(calls):
                assert d["id"].startswith("call_") and d["type"] == "function", d
                assert function["name"], d
                calls.append(ParsedCall(function["name"], ""))
                pieces.append(0)
            else:
                assert set(d) == {"index", "function"} and set(function) == {"arguments"}, d
                assert function["arguments"], d  # no empty pieces
            calls[index] = calls[index]._replace(
                arguments=calls[index].arguments + function["arguments"])
            pieces[index] += bool(function["arguments"])
            if index < len(expected):
                name, arguments = expected[index]
                assert (name, arguments[:len(calls[index].arguments)]) == calls[index], (
                    calls[index], expected[index])
    return Added(contents, calls, pieces)
