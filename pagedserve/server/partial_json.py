"""A JSON value that is still being written, read as far as it goes: the part of its canonical
form that no continuation can change.

A stream of tool-call arguments sends ``json.dumps(value, ensure_ascii=False)`` of the
finished value (what a whole response holds) a piece at a time. ``partial_value`` returns
that form's certain prefix for the text written so far: brackets and separators as they are
written, a string a character at a time, a number or ``true``/``false``/``null`` once it is
whole (a number once the character after it shows it has ended: ``1.`` may become ``1.5``,
and ``-0`` is ``0`` but ``-0.0`` is not). Appending text only ever extends the prefix, and for
a text that is JSON it is the whole canonical form.

Where the text stops being JSON, the prefix stops growing for good. So it does at a key that
repeats one of its object's: JSON leaves what that means open (RFC 8259, section 4), and
``json.loads`` keeps the last value where the prefix already holds the first; the tool-call
parsers reject such an object (``tool_parsers.DECODER``). So does it at NaN and Infinity,
which are no JSON, and past ``MAX_DEPTH`` nested containers; there the finished parse, which
reads them, is the one to trust.

A stream reads its text again at each token with one ``JsonReader``, which goes on from
where it stopped (see there for the cost).
"""

from __future__ import annotations

import json
import re
from itertools import islice
from json.decoder import scanstring
from typing import NamedTuple

# Deeper than any real call's arguments; it bounds the recursion, and the work on hostile
# nesting (each level joins its children's text).
MAX_DEPTH = 64

_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace, which json.loads skips too
# A string's characters up to its closing quote, or up to what may not be JSON yet: a cut
# or invalid escape, or a raw control character (never JSON).
_STRING_BODY = re.compile(r'[^"\\\x00-\x1f]*(?:(?:\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
                          r'[^"\\\x00-\x1f]*)*')
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_LITERALS = ("true", "false", "null")


class Partial(NamedTuple):
    json: str  # the canonical JSON of the value, as far as it is certain
    end: int | None  # the index after the value once it is whole; None while it is not
    members: dict[str, Partial] | None = None  # an object's, each once its ``:`` is written
    items: list[Partial] | None = None  # an array's


_NOTHING = Partial("", None)


class JsonReader:
    """Reads the JSON values in a text that grows (a stream's output) each time it has grown,
    from where the last read stopped: a value that was whole is not read again, nor are the
    whole members of a container still open. So the Python work of a read is the text added
    and the path of open containers; what stays O(n) a read runs in C (checking that the
    text extends the last one, copying the open containers' members and joining their JSON,
    decoding a string still open). A text that does not extend the last one is read afresh.

    The containers' copies keep what a read returned as it was."""

    def __init__(self) -> None:
        self._text = ""
        self._whole: dict[int, Partial] = {}  # the values that ended, by where they start
        # The containers still open, by where they start: the JSON of their whole members
        # (each with the separator after it), those members, and where the next one starts.
        self._open: dict[int, tuple[list[str], dict[str, Partial] | list[Partial], int]] = {}

    def value(self, text: str, i: int, depth: int = 0) -> Partial:
        """The JSON value at ``text[i:]`` (JSON whitespace first skipped)."""
        if text is not self._text:
            if not text.startswith(self._text):
                self._whole.clear()
                self._open.clear()
            self._text = text
        i = skip_space(text, i)
        value = self._whole.get(i)
        if value is not None:
            return value
        if i == len(text) or depth > MAX_DEPTH:
            return _NOTHING
        if text[i] == '"':
            string, end = _string(text, i)
            value = Partial(_quoted(string, end), end)
        elif text[i] in "{[":
            value = self._container(text, i, depth)
        else:
            value = _scalar(text, i)
        if value.end is not None:
            self._whole[i] = value
            self._open.pop(i, None)
        return value

    def _container(self, text: str, i: int, depth: int) -> Partial:
        is_object = text[i] == "{"
        close, read = ("}", self._member) if is_object else ("]", self._item)
        out, children, j = self._open.get(i, ([text[i]], {} if is_object else [], i + 1))
        out, children, saved = out.copy(), children.copy(), None
        j = skip_space(text, j)
        if not children and text.startswith(close, j):
            out.append(close)
            j += 1
        else:
            while True:
                j, closed = _after(text, read(text, j, depth, out, children), close, out)
                if j is None or closed:
                    break
                saved = (len(out), len(children), j)
                j = skip_space(text, j)
        if j is None and saved is not None:
            self._open[i] = (out[:saved[0]], _first(children, saved[1]), saved[2])
        if is_object:
            return Partial("".join(out), j, members=children)
        return Partial("".join(out), j, items=children)

    def _member(self, text: str, j: int, depth: int, out: list[str],
                members: dict[str, Partial]) -> int | None:
        """Read the member at ``text[j]`` into ``out`` and ``members``: the index after it,
        or None if it is not whole (or never will be)."""
        if not text.startswith('"', j):
            return None
        key, end = _string(text, j)
        out.append(_quoted(key, end))
        if end is None or key in members:
            return None
        j = skip_space(text, end)
        if not text.startswith(":", j):
            return None
        out.append(": ")
        value = members[key] = self.value(text, j + 1, depth + 1)
        out.append(value.json)
        return value.end

    def _item(self, text: str, j: int, depth: int, out: list[str],
              items: list[Partial]) -> int | None:
        item = self.value(text, j, depth + 1)
        items.append(item)
        out.append(item.json)
        return item.end


def partial_value(text: str, i: int) -> Partial:
    """The JSON value at ``text[i:]``, read once."""
    return JsonReader().value(text, i)


def skip_space(text: str, i: int) -> int:
    return _SPACE.match(text, i).end()


def _string(text: str, i: int) -> tuple[str, int | None]:
    """The string at ``text[i]`` (its opening quote), decoded as far as it is certain, and the
    index after it once it is whole."""
    end = _STRING_BODY.match(text, i + 1).end()
    if text.startswith('"', end):
        return scanstring(text, i + 1)[0], end + 1
    value = scanstring(text[i + 1:end] + '"', 0)[0]
    # A high surrogate's escape may be followed by its low one's: one character in all.
    return (value[:-1] if value and "\ud800" <= value[-1] <= "\udbff" else value), None


def _quoted(value: str, end: int | None) -> str:
    """``value`` as JSON: without the closing quote while the string goes on. JSON escapes each
    character alone, so a string's prefix is the prefix of its JSON."""
    quoted = json.dumps(value, ensure_ascii=False)
    return quoted if end is not None else quoted[:-1]


def _first(children: dict[str, Partial] | list[Partial], n: int):
    return children[:n] if isinstance(children, list) else dict(islice(children.items(), n))


def _after(text: str, end: int | None, close: str, out: list[str]) -> tuple[int | None, bool]:
    """After a container's member that ends at ``end``: the index past the ``,`` that follows
    it (``", "`` written to ``out``) or past the container's ``close`` (written; True), or
    None if neither is there (yet)."""
    i = None if end is None else skip_space(text, end)
    for mark, canonical in ((close, close), (",", ", ")):
        if i is not None and text.startswith(mark, i):
            out.append(canonical)
            return i + 1, mark == close
    return None, False


def _scalar(text: str, i: int) -> Partial:
    for literal in _LITERALS:
        if text.startswith(literal, i):
            return Partial(literal, i + len(literal))
    end = _NUMBER_CHARS.match(text, i).end()
    if end == len(text) or _NUMBER.fullmatch(text, i, end) is None:
        return _NOTHING  # more of the number may come; or it is no JSON
    try:
        number = json.loads(text[i:end])
    except ValueError:  # an integer past Python's limit on digits
        return _NOTHING
    return Partial(json.dumps(number), end)
