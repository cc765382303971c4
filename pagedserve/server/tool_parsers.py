"""Tool calls in a model's own output format (``tool_choice: "auto"``), chosen by
``--tool-call-parser``: a parser finds the calls in the finished text, and tells a stream how
much of the text so far is surely plain content (the rest is held back), and which calls it
has begun, as far as they are certain (``partial_calls``).

A call's arguments are the canonical JSON of the arguments written (``json.dumps``), so a
stream can send them as they are written: ``partial_json`` reads the part of that form that
no continuation changes. For that, a call object that names a key twice, or gives both
``arguments`` and ``parameters``, is no call: which one counts would be a guess while it is
written.
"""

from __future__ import annotations

import ast
import json
import re
from typing import NamedTuple, Protocol

from pagedserve.server.partial_json import JsonReader, Partial
from pagedserve.server.stream_markers import held_back

# What a model may write that breaks a parse: bad JSON or Python (ValueError, SyntaxError),
# nesting deeper than the parser recurses, a Python literal JSON cannot hold (TypeError).
_UNPARSEABLE = (ValueError, SyntaxError, RecursionError, MemoryError, TypeError)


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text; for a call still being written, the start of it


class ParsedOutput(NamedTuple):
    content: str | None  # the text outside the tool calls; None if there is none
    calls: list[ParsedCall]


class ToolParser(Protocol):
    # Its marker is a special token it cannot do without (Mistral v11's [TOOL_CALLS]name[ARGS]
    # has nothing else to tell it from prose): an auto request keeps special tokens, as vLLM's
    # parser has it.
    keeps_special_tokens: bool

    def parse(self, text: str) -> ParsedOutput:
        """The content and calls of a finished output; no calls if none parses."""

    def content_length(self, text: str) -> int:
        """How many leading characters of a partial output are surely content."""

    def partial_calls(self, text: str, reader: JsonReader) -> list[ParsedCall]:
        """The calls a partial output has begun, as far as they are certain: if a longer text
        parses, its first calls have these names and arguments that start with these.
        ``reader`` has read the stream's shorter texts (a fresh one for a text alone)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        raise ValueError("a key is repeated")
    return obj


# json.loads, but an object that repeats a key is no JSON (``partial_json`` says why).
DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)
# The keys a call object may give its arguments under (one of them at most).
ARGUMENTS = ("arguments", "parameters")


def parse_call(obj, arguments_keys: tuple[str, ...]) -> ParsedCall:
    """A call from ``{"name": ..., <arguments key>: {...}}``; ValueError if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call")
    given = [obj[k] for k in arguments_keys if k in obj]
    if len(given) > 1:
        raise ValueError("tool arguments given twice")
    return ParsedCall(obj["name"], _arguments_json(given[0] if given else {}))


def _arguments_json(arguments) -> str:
    if isinstance(arguments, str):  # JSON written as a JSON string
        arguments = DECODER.decode(arguments)
    return json.dumps(arguments, ensure_ascii=False)


def partial_call(obj: Partial, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """``parse_call`` of a call object still being written: None until its name is whole
    (and for what is no call); its arguments as far as they are certain (with none given,
    ``{}`` once the object is whole)."""
    members = obj.members or {}
    name = members.get("name")
    given = [members[k] for k in arguments_keys if k in members]
    if name is None or name.end is None or not name.json.startswith('"') or len(given) > 1:
        return None
    if given:
        arguments = _partial_arguments(given[0])
    else:
        arguments = "{}" if obj.end is not None else ""
    return ParsedCall(json.loads(name.json), arguments)


def _partial_arguments(value: Partial) -> str:
    if not value.json.startswith('"'):
        return value.json
    if value.end is None:  # JSON written as a JSON string: known once the string is whole
        return ""
    try:
        return _arguments_json(json.loads(value.json))
    except _UNPARSEABLE:  # no call: the finished parse fails too
        return ""


def partial_call_list(text: str, i: int, arguments_keys: tuple[str, ...],
                      reader: JsonReader) -> list[ParsedCall]:
    """The calls begun in the JSON array of call objects at ``text[i:]`` (whitespace first
    skipped), as far as they are certain."""
    calls = []
    for item in reader.value(text, _skip_space(text, i)).items or ():
        call = partial_call(item, arguments_keys)
        if call is None:
            break
        calls.append(call)
    return calls


class HermesParser:
    """Hermes / Qwen / SmolLM-style: ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``
    blocks after optional content; the last block may lack its closing tag (the model stopped
    at the end of it)."""

    START = "<tool_call>"
    keeps_special_tokens = False
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return ParsedOutput(text, [])
        try:
            calls = [parse_call(DECODER.decode(body), ARGUMENTS)
                     for body in self._BLOCK.findall(text, start)]
        except _UNPARSEABLE:
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start].rstrip() or None, calls)

    def content_length(self, text: str) -> int:
        start = text.find(self.START)
        end = start if start >= 0 else len(text) - held_back(text, self.START)
        # The whitespace before a call is not content (``parse`` drops it), so a stream holds
        # it back until more text follows; leading whitespace is content either way, as a
        # stream cannot know yet whether a call will come.
        return len(text[:end].rstrip())

    def partial_calls(self, text: str, reader: JsonReader) -> list[ParsedCall]:
        calls, start = [], text.find(self.START)
        while start >= 0:
            obj = reader.value(text, start + len(self.START))
            call = partial_call(obj, ARGUMENTS)
            if call is None:
                break
            calls.append(call)
            start = -1 if obj.end is None else text.find(self.START, obj.end)
        return calls


class Llama3JsonParser:
    """Llama 3.1 / 3.2 JSON tool calls: the whole output is ``{"name": .., "parameters":
    {..}}`` objects separated by ``;``, optionally after ``<|python_tag|>``."""

    TAG = "<|python_tag|>"
    keeps_special_tokens = False
    KEYS = ("parameters", "arguments")

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        calls, i = [], 0
        try:
            while i < len(body):
                obj, i = DECODER.raw_decode(body, i)
                calls.append(parse_call(obj, self.KEYS))
                i = self._next(body, i)
        except _UNPARSEABLE:
            return ParsedOutput(text, [])
        return ParsedOutput(None, calls)

    def partial_calls(self, text: str, reader: JsonReader) -> list[ParsedCall]:
        calls, i = [], _skip_space(text, 0)
        if text.startswith(self.TAG, i):
            i = _skip_space(text, i + len(self.TAG))
        while i is not None:
            obj = reader.value(text, i)
            call = partial_call(obj, self.KEYS)
            if call is None:
                break
            calls.append(call)
            i = None if obj.end is None else self._next(text, obj.end)
        return calls

    @staticmethod
    def _next(text: str, i: int) -> int:
        """Past the separators after a call."""
        while i < len(text) and text[i] in "; \n\t":
            i += 1
        return i

    def content_length(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or self.TAG.startswith(head[:len(self.TAG)]):
            return 0  # it may still become a tool call
        return len(text)


def _skip_space(text: str, i: int) -> int:
    return len(text) - len(text[i:].lstrip())


def _json_calls(text: str, i: int) -> tuple[list[ParsedCall], int]:
    """The non-empty JSON array of ``{"name", "arguments"}`` calls at ``text[i:]`` (whitespace
    first skipped) and the index after it; ValueError if there is none."""
    calls, end = DECODER.raw_decode(text, _skip_space(text, i))
    if not isinstance(calls, list) or not calls:
        raise ValueError("not a list of tool calls")
    return [parse_call(c, ARGUMENTS) for c in calls], end


def _around(text: str, start: int, end: int) -> str | None:
    """The content of an output whose calls are ``text[start:end]``: the text before them (but
    the whitespace that ends it) and after them (but the whitespace at its ends). A stream has
    sent at most the text before, so the content always extends what it streamed."""
    before, after = text[:start].rstrip(), text[end:].rstrip()
    return (before + after if before else after.lstrip()) or None


class _MarkedCallsParser:
    """Calls after a marker, with content before them (and after them, for a model that goes
    on writing). A marker counts only where ``_opens`` what follows it, so the word in prose
    (Phi-4-mini's ``functools``) stays content; with ``BARE``, an output that opens with the
    call list is calls too (the marker was a special token, dropped by
    ``skip_special_tokens``)."""

    MARKERS: tuple[str, ...] = ()
    keeps_special_tokens = False
    BARE = False

    def _opens(self, rest: str) -> bool:
        rest = rest.lstrip()
        return not rest or rest.startswith("[")

    def _calls(self, text: str, i: int) -> tuple[list[ParsedCall], int]:
        return _json_calls(text, i)

    def _partial_calls(self, text: str, i: int, reader: JsonReader) -> list[ParsedCall]:
        return partial_call_list(text, i, ARGUMENTS, reader)

    def _find(self, text: str) -> tuple[int, int] | None:
        """Where the calls start, and where the text after their marker does; None if no
        marker (or, with ``BARE``, no opening ``[``) is there yet."""
        found = [(i, i + len(m)) for m in self.MARKERS for i in _occurrences(text, m)
                 if self._opens(text[i + len(m):])]
        if not found and self.BARE and text.lstrip().startswith("["):
            return 0, 0
        return min(found, default=None)

    def parse(self, text: str) -> ParsedOutput:
        found = self._find(text)
        if found is None:
            return ParsedOutput(text, [])
        try:
            calls, end = self._calls(text, found[1])
        except _UNPARSEABLE:
            return ParsedOutput(text, [])
        return ParsedOutput(_around(text, found[0], end), calls)

    def content_length(self, text: str) -> int:
        found = self._find(text)
        if found is not None:
            end = found[0]
        else:
            end = len(text) - max(held_back(text, m) for m in self.MARKERS)
        # As with Hermes: the whitespace before a call is not content, leading whitespace is.
        return len(text[:end].rstrip())

    def partial_calls(self, text: str, reader: JsonReader) -> list[ParsedCall]:
        # The calls' start, once found, stays: what follows an earlier marker is written.
        # (A bare list is the exception: a marker written after it would win, but a model
        # that lost its marker as a special token does not write it later.)
        found = self._find(text)
        return [] if found is None else self._partial_calls(text, found[1], reader)


def _occurrences(text: str, marker: str):
    i = text.find(marker)
    while i >= 0:
        yield i
        i = text.find(marker, i + 1)


class MistralParser(_MarkedCallsParser):
    """Mistral: ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`` (7B v0.3, Nemo, Small
    before 3.1), or, from tokenizer v11 (Small 3.1+, Ministral, Devstral), a call per marker:
    ``[TOOL_CALLS]name[ARGS]{..}`` (``[CALL_ID]id`` may precede ``[ARGS]``, and ``[ARGS]``
    may be missing). ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, which an auto request
    keeps; an output that lost them anyway is calls only as a bare JSON list."""

    MARKERS = ("[TOOL_CALLS]",)
    BARE = True
    keeps_special_tokens = True
    _NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?")

    def _opens(self, rest: str) -> bool:
        return True  # a name or a list follows; either may still be coming

    def _calls(self, text: str, i: int) -> tuple[list[ParsedCall], int]:
        if text[i:].lstrip().startswith("["):
            return _json_calls(text, i)
        calls = []
        while True:
            name = self._NAME.match(text, i)
            if name is None:
                raise ValueError("no tool name after [TOOL_CALLS]")
            arguments, end = DECODER.raw_decode(text, _skip_space(text, name.end()))
            if not isinstance(arguments, dict):
                raise ValueError("tool arguments are not an object")
            calls.append(ParsedCall(name[1], json.dumps(arguments, ensure_ascii=False)))
            i = self._next_call(text, end)
            if i is None:
                return calls, end

    def _partial_calls(self, text: str, i: int, reader: JsonReader) -> list[ParsedCall]:
        if text[i:].lstrip().startswith("["):
            return partial_call_list(text, i, ARGUMENTS, reader)
        calls, start = [], i
        while start is not None:
            name = self._NAME.match(text, start)
            if name is None or name.end(1) == len(text):  # the name may go on
                break
            arguments = reader.value(text, _skip_space(text, name.end()))
            calls.append(ParsedCall(name[1], arguments.json if arguments.members is not None
                                    else ""))
            start = None if arguments.end is None else self._next_call(text, arguments.end)
        return calls

    def _next_call(self, text: str, end: int) -> int | None:
        """Where the next call's name starts, after the marker that follows the arguments
        ending at ``end``; None if no marker does."""
        following = _skip_space(text, end)
        if not text.startswith(self.MARKERS[0], following):
            return None
        return following + len(self.MARKERS[0])


class GraniteParser(_MarkedCallsParser):
    """Granite 3.x: ``<|tool_call|>[{"name": .., "arguments": {..}}, ..]`` (3.0; the marker
    is a special token, so without ``skip_special_tokens: false`` the output opens with the
    list) or ``<tool_call>[..]`` (3.1+)."""

    MARKERS = ("<|tool_call|>", "<tool_call>")
    BARE = True


class Phi4MiniJsonParser(_MarkedCallsParser):
    """Phi-4-mini: ``functools[{"name": .., "arguments": {..}}, ..]``, ``functools`` being
    plain text (so not followed by ``[``, it is prose)."""

    MARKERS = ("functools",)


class PythonicParser:
    """Llama 3.2 / Llama 4 / Toolace: the whole output is a Python list of calls,
    ``[get_weather(city="Paris"), get_time()]``, keyword arguments only, optionally between
    Llama 4's ``<|python_start|>`` and ``<|python_end|>``. It is parsed with ``ast`` and its
    values read by ``ast.literal_eval``: literals only, nothing is evaluated; anything else
    (a variable, an expression, a positional argument) leaves the output content."""

    START, END = "<|python_start|>", "<|python_end|>"
    keeps_special_tokens = False

    def parse(self, text: str) -> ParsedOutput:
        body = self._body(text)
        if not body.startswith("["):
            return ParsedOutput(text, [])
        try:
            return ParsedOutput(None, self._calls(body))
        except _UNPARSEABLE:
            return ParsedOutput(text, [])

    def partial_calls(self, text: str, reader: JsonReader) -> list[ParsedCall]:
        """Each call once it is whole: the JSON of a Python literal is known only then (a
        string's quotes, a tuple that becomes a list, a number's digits). A call is whole at
        the ``)`` that ends it, as nothing after it keeps it a call (``f(x=1)(y=2)``,
        ``f(x=1).y``, ``f(x=1) if a else b`` are none): the list closed there holds the calls
        written. Each try parses the text again, only where it ends at a ``)``."""
        body = self._body(text).removesuffix("]").rstrip().removesuffix(",").rstrip()
        if not (body.startswith("[") and body.endswith(")")):
            return []
        try:
            return self._calls(body + "]")
        except _UNPARSEABLE:
            return []

    def _body(self, text: str) -> str:
        return text.strip().removeprefix(self.START).removesuffix(self.END).strip()

    def _calls(self, body: str) -> list[ParsedCall]:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("not a list of calls")
        return [self._call(node) for node in tree.elts]

    @staticmethod
    def _call(node: ast.expr) -> ParsedCall:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args \
                or any(k.arg is None for k in node.keywords):
            raise ValueError("not a call of a name with keyword arguments")
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False,
                                                   allow_nan=False))

    def content_length(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("[") or self.START.startswith(head[:len(self.START)]):
            return 0  # it may still become a list of calls
        return len(text)


TOOL_PARSERS: dict[str, type] = {
    "granite": GraniteParser, "hermes": HermesParser, "llama3_json": Llama3JsonParser,
    "mistral": MistralParser, "phi4_mini_json": Phi4MiniJsonParser, "pythonic": PythonicParser}


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; valid: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
