"""The certain prefix of a JSON value's canonical form (``json.dumps(ensure_ascii=False)``),
read from every prefix of texts written in every style: it only grows, it is always a prefix
of the finished value's canonical form, and for the whole text it is all of it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.server.partial_json import MAX_DEPTH, JsonReader, partial_value


def _check_every_prefix(text: str, canonical: str) -> None:
    """Also that a reader that goes on from its last read (every prefix in turn) reads what a
    fresh one reads."""
    sent, reader = "", JsonReader()
    for end in range(len(text) + 1):
        got = partial_value(text[:end], 0)
        assert reader.value(text[:end], 0) == got, text[:end]
        assert got.json.startswith(sent), (text[:end], got.json, sent)  # never taken back
        assert canonical.startswith(got.json), (text[:end], got.json, canonical)  # certain
        sent = got.json
    whole = partial_value(text, 0)
    assert (whole.json, whole.end) == (canonical, len(text.rstrip(" \t\n\r")))


WRITTEN = [
    '{"a": 1, "b": [1, 2.5, true, false, null, {"c": "x"}], "d": {}, "e": []}',
    # Numbers whose canonical form differs from what was written, and from their prefixes'.
    '[-0, -0.0, 0.5, 1E+2, 1e-3, 10.250, 12345678901234567890, 1e400]',
    # Escapes, a surrogate pair, JSON's escaped slash, an escaped backslash before "u".
    '{"s": "caf\\u00e9 \\ud83d\\ude00 \\n\\t\\"q\\" \\/ \\\\u00e9", "t": "日本語 ☕"}',
    ' {\n  "k" :\t[ 1 ,2 ] ,\r\n  "z":"" } ',
    '"just a string"',
    '[[[[]]], {"a": {"b": {"c": [{}]}}}]',
]


@pytest.mark.parametrize("text", WRITTEN)
def test_every_prefix_of_written_json(text):
    _check_every_prefix(text, json.dumps(json.loads(text), ensure_ascii=False))


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(_VALUES, st.sampled_from([None, 0, 2]), st.booleans(),
       st.sampled_from([(",", ":"), (", ", ": "), (" , ", " :  ")]))
def test_every_prefix_of_any_json_in_any_style(value, indent, ensure_ascii, separators):
    text = json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators)
    if not isinstance(value, (dict, list, str)):
        text = f"[{text}]"  # a bare number is never known to have ended
        value = [value]
    _check_every_prefix(text, json.dumps(value, ensure_ascii=False))


@pytest.mark.parametrize(("text", "certain"), [
    ('{"a": 12', '{"a": '),  # 12 may go on
    ('{"a": 1.', '{"a": '),
    ('{"a": -0', '{"a": '),  # -0 is 0, -0.0 is not
    ('{"a": tru', '{"a": '),
    ('{"a": "x\\u00', '{"a": "x'),
    ('{"a": "x\\ud83d', '{"a": "x'),  # its low surrogate may follow
    ('{"a": "x\\ud83d\\ude00', '{"a": "x😀'),
    ('{"a": "x\\', '{"a": "x'),
    ('{"ke', '{"ke'),
    ('{"key"', '{"key"'),
    ('{"key":', '{"key": '),
    ('[1,', '[1, '),
    ('', ''),
])
def test_a_cut_value_gives_what_is_certain(text, certain):
    assert partial_value(text, 0) == (certain, None, *partial_value(text, 0)[2:])


@pytest.mark.parametrize(("text", "stops_at"), [
    ('{"a": 1, "a": 2}', '{"a": 1, "a"'),  # a repeated key: json.loads keeps the last
    ('{"a": NaN}', '{"a": '),
    ('{"a": "tab\there"}', '{"a": "tab'),  # a raw control character
    ('{"a": "\\x"}', '{"a": "'),
    ('{"a": 1,}', '{"a": 1, '),
    ('[1 2]', '[1'),
    ('{"a": 01}', '{"a": '),
    ('[' * (MAX_DEPTH + 5) + ']' * (MAX_DEPTH + 5), '[' * (MAX_DEPTH + 1)),
])
def test_text_that_stops_being_json_stops_the_prefix(text, stops_at):
    for end in (len(text), len(text) - 1):
        assert partial_value(text[:end] + " more", 0)[:2] == (stops_at, None), end


def test_a_reader_reads_a_text_that_does_not_go_on_afresh():
    reader = JsonReader()
    assert reader.value('{"a": [1, 2, ', 0).json == '{"a": [1, 2, '
    assert reader.value('{"b": [3', 0).json == '{"b": ['
    assert reader.value('{"b": [3]}', 0) == partial_value('{"b": [3]}', 0)


def test_members_and_items_are_read_as_far_as_written():
    got = partial_value('{"name": "f", "arguments": {"x": [1, "a', 0)
    assert list(got.members) == ["name", "arguments"]
    assert got.members["name"] == ('"f"', 12, None, None)
    arguments = got.members["arguments"]
    assert arguments.json == '{"x": [1, "a' and arguments.end is None
    assert [i.json for i in arguments.members["x"].items] == ["1", '"a']
