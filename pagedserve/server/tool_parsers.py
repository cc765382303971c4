"""Tool calls in a model's own output format (``tool_choice: "auto"``), chosen by
``--tool-call-parser``: a parser finds the calls in the finished text, and tells a stream how
much of the text so far is surely plain content (the rest is held back until the end)."""

from __future__ import annotations

import json
import re
from typing import NamedTuple, Protocol

from pagedserve.server.stream_markers import held_back


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # JSON text


class ParsedOutput(NamedTuple):
    content: str | None  # the text outside the tool calls; None if there is none
    calls: list[ParsedCall]


class ToolParser(Protocol):
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
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.START)
        if start < 0:
            return ParsedOutput(text, [])
        try:
            calls = [_call(json.loads(body), ("arguments", "parameters"))
                     for body in self._BLOCK.findall(text, start)]
        except ValueError:  # json.JSONDecodeError is one
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
        except ValueError:
            return ParsedOutput(text, [])
        return ParsedOutput(None, calls)

    def content_length(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or self.TAG.startswith(head[:len(self.TAG)]):
            return 0  # it may still become a tool call
        return len(text)


TOOL_PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; valid: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
