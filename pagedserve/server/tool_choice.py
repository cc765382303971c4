"""How a chat request's ``tools`` and ``tool_choice`` shape its output.

``required`` and a named function are enforced by the grammar: the output is constrained to
a JSON array of ``{"name", "parameters"}`` calls of the given tools (vLLM's form), or to the
named function's arguments. ``auto`` leaves the model free and parses its output with the
server's ``--tool-call-parser``. ``none`` changes nothing.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagedserve.sampling_params import InvalidSamplingParam, StructuredOutputsParams
from pagedserve.server.protocol import ChatCompletionRequest, ChatTool, FunctionDefinition
from pagedserve.server.tool_parsers import ParsedCall, ParsedOutput, ToolParser, _call

# The arguments of a function declared without parameters.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[ChatTool]
    parallel: bool
    named: FunctionDefinition | None = None
    parser: ToolParser | None = None

    @classmethod
    def of(cls, request: ChatCompletionRequest, parser: ToolParser | None) -> ToolPlan:
        """Raises ``InvalidSamplingParam`` for a choice the request or server cannot honour.
        ``parser``: the server's auto tool-call parser, None unless auto choice is enabled."""
        tools, choice = request.tools or [], request.tool_choice
        parallel = request.parallel_tool_calls is not False
        if choice is None:
            choice = "auto" if tools else "none"
        if choice != "none" and not tools:
            raise InvalidSamplingParam("tool_choice", "tool_choice needs tools")
        if choice in ("required", "auto", "none"):
            if choice == "auto" and parser is None:
                raise InvalidSamplingParam(
                    "tool_choice", '"auto" tool choice needs the server started with '
                    "--enable-auto-tool-choice and --tool-call-parser")
            return cls(choice, tools, parallel, parser=parser if choice == "auto" else None)
        named = next((t.function for t in tools if t.function.name == choice.function.name),
                     None)
        if named is None:
            raise InvalidSamplingParam(
                "tool_choice", f"tool_choice names {choice.function.name!r}, which is not "
                "among the tools")
        return cls("named", tools, parallel, named=named)

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=self.named.parameters or _NO_PARAMETERS)
        if self.mode == "required":
            return StructuredOutputsParams(json=self._calls_schema())
        return None

    def _calls_schema(self) -> dict[str, Any]:
        calls = [{"type": "object", "properties": {
                     "name": {"type": "string", "enum": [t.function.name]},
                     "parameters": t.function.parameters or _NO_PARAMETERS},
                  "required": ["name", "parameters"]} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates read them (OpenAI's form)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools]

    def parse(self, text: str) -> ParsedOutput:
        """The calls in a finished output. A grammar-enforced output is all calls, even when
        ``max_tokens`` cut it short (vLLM's and OpenAI's answer): the named function gets the
        arguments as far as they were generated, ``required`` the calls whose name was."""
        if self.mode == "named":
            return ParsedOutput(None, [ParsedCall(self.named.name, text)])
        if self.mode == "required":
            return ParsedOutput(None, _required_calls(text))
        if self.mode == "auto":
            parsed = self.parser.parse(text)
            return parsed if self.parallel else ParsedOutput(parsed.content, parsed.calls[:1])
        return ParsedOutput(text, [])


_decoder = json.JSONDecoder()


def _required_calls(text: str) -> list[ParsedCall]:
    """The calls of a ``required`` output, ``[{"name": .., "parameters": {..}}, ..]``, or of
    as much of it as was generated: the complete calls, then the cut one if its name is."""
    calls, i = [], 0
    try:
        i = _skip(text, 0, "[")
        while i < len(text):
            call, i = _decoder.raw_decode(text, i)
            calls.append(_call(call, ("parameters",)))
            i = _skip(text, i, ",]")
    except ValueError:  # cut short at text[i]
        calls += _cut_call(text, i)
    return calls


def _cut_call(text: str, i: int) -> list[ParsedCall]:
    """The call cut short after ``text[i]``, with its arguments as far as they were generated;
    none if its name was not complete."""
    name, arguments = None, ""
    try:
        i = _skip(text, i, "{")
        while True:
            key, i = _decoder.raw_decode(text, i)
            i = _skip(text, i, ":")
            if key == "parameters":
                arguments = text[i:]
            value, end = _decoder.raw_decode(text, i)
            if key == "parameters":
                arguments = text[i:end]
            elif key == "name":
                name = value
            i = _skip(text, end, ",")
    except ValueError:
        pass
    return [ParsedCall(name, arguments)] if isinstance(name, str) else []


def _skip(text: str, i: int, chars: str) -> int:
    """The index after ``text[i]``, one of ``chars`` (whitespace around it skipped);
    ValueError if there is none of them there."""
    i = len(text) - len(text[i:].lstrip())
    if i == len(text) or text[i] not in chars:
        raise ValueError(f"expected one of {chars!r} at {i}")
    return len(text) - len(text[i + 1:].lstrip())


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One streamed choice of a request with tools: ``content`` deltas while the text is surely
    content, tool-call deltas as OpenAI streams them (the first delta of a call carries its
    index, id, type and name; later ones more ``arguments`` text). A named function's
    arguments stream as they are generated; other calls are known, and sent, at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_sent = 0  # characters of the text passed on (as content or arguments)
        self.called = False

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        if self.plan.mode == "named":
            return self._named(text)
        if not finished:
            parser = self.plan.parser
            return self._content(text, parser.content_length(text) if parser else 0)
        parsed = self.plan.parse(text)
        delta = {}
        if self.plan.mode == "auto":  # a required output is all calls, even cut short
            # The rest of a whole response's content, which extends what was streamed (and
            # may go on after the calls).
            rest = (parsed.content or "")[self.num_sent:]
            delta = {"content": rest} if rest else {}
        if parsed.calls:
            self.called = True
            delta["tool_calls"] = [_call_delta(i, c.name, c.arguments)
                                   for i, c in enumerate(parsed.calls)]
        return delta

    def _content(self, text: str, end: int) -> dict[str, Any]:
        piece, self.num_sent = text[self.num_sent:end], max(self.num_sent, end)
        return {"content": piece} if piece else {}

    def _named(self, text: str) -> dict[str, Any]:
        piece, self.num_sent = text[self.num_sent:], len(text)
        if not self.called:
            self.called = True
            return {"tool_calls": [_call_delta(0, self.plan.named.name, piece)]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}


def _call_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
