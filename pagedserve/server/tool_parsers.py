"""Tool calls in a model's own output format (``tool_choice: "auto"``), chosen by
``--tool-call-parser``: a parser finds the calls in the finished text, and tells a stream how
much of the text so far is surely plain content (the rest is held back until the end)."""

from __future__ import annotations

import ast
import json
import re
from typing import NamedTuple, Protocol

from pagedserve.server.stream_markers import held_back

# What a model may write that breaks a parse: bad JSON or Python (ValueError, SyntaxError),
# nesting deeper than the parser recurses, a Python literal JSON cannot hold (TypeError).
_UNPARSEABLE = (ValueError, SyntaxError, RecursionError, MemoryError, TypeError)


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text


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


def _call(obj, arguments_keys: tuple[str, ...]) -> ParsedCall:
    """A call from ``{"name": ..., <arguments key>: {...}}``; ValueError if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call")
    arguments = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


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
            calls = [_call(json.loads(body), ("arguments", "parameters"))
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


class Llama3JsonParser:
    """Llama 3.1 / 3.2 JSON tool calls: the whole output is ``{"name": .., "parameters":
    {..}}`` objects separated by ``;``, optionally after ``<|python_tag|>``."""

    TAG = "<|python_tag|>"
    keeps_special_tokens = False
    _decoder = json.JSONDecoder()

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        calls, i = [], 0
        try:
            while i < len(body):
                obj, i = self._decoder.raw_decode(body, i)
                calls.append(_call(obj, ("parameters", "arguments")))
                while i < len(body) and body[i] in "; \n\t":
                    i += 1
        except _UNPARSEABLE:
            return ParsedOutput(text, [])
        return ParsedOutput(None, calls)

    def content_length(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or self.TAG.startswith(head[:len(self.TAG)]):
            return 0  # it may still become a tool call
        return len(text)


_decoder = json.JSONDecoder()


def _skip_space(text: str, i: int) -> int:
    return len(text) - len(text[i:].lstrip())


def _json_calls(text: str, i: int) -> tuple[list[ParsedCall], int]:
    """The non-empty JSON array of ``{"name", "arguments"}`` calls at ``text[i:]`` (whitespace
    first skipped) and the index after it; ValueError if there is none."""
    calls, end = _decoder.raw_decode(text, _skip_space(text, i))
    if not isinstance(calls, list) or not calls:
        raise ValueError("not a list of tool calls")
    return [_call(c, ("arguments", "parameters")) for c in calls], end


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
            arguments, i = _decoder.raw_decode(text, _skip_space(text, name.end()))
            if not isinstance(arguments, dict):
                raise ValueError("tool arguments are not an object")
            calls.append(ParsedCall(name[1], json.dumps(arguments, ensure_ascii=False)))
            following = _skip_space(text, i)
            if not text.startswith(self.MARKERS[0], following):
                return calls, i
            i = following + len(self.MARKERS[0])


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
        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not body.startswith("["):
            return ParsedOutput(text, [])
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                raise ValueError("not a list of calls")
            return ParsedOutput(None, [self._call(node) for node in tree.elts])
        except _UNPARSEABLE:
            return ParsedOutput(text, [])

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
