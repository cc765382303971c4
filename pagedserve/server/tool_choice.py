"""How a chat request's ``tools`` and ``tool_choice`` shape its output.

``required`` and a named function are enforced by the grammar: the output is constrained to
a JSON array of ``{"name", "parameters"}`` calls of the given tools (vLLM's form), or to the
named function's arguments. ``auto`` leaves the model free and parses its output with the
server's ``--tool-call-parser``. ``none`` changes nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pagedserve.sampling_params import InvalidSamplingParam, StructuredOutputsParams
from pagedserve.server.partial_json import JsonReader, partial_value
from pagedserve.server.protocol import ChatCompletionRequest, ChatTool, FunctionDefinition
from pagedserve.server.tool_parsers import (
    DECODER,
    ParsedCall,
    ParsedOutput,
    ToolParser,
    parse_call,
    partial_call,
    partial_call_list,
)

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

    def partial_calls(self, text: str, reader: JsonReader) -> list[ParsedCall]:
        """The calls a partial output has begun, as far as they are certain (as a parser's
        ``partial_calls``): a named function's arguments are the text itself."""
        if self.mode == "named":
            return self.parse(text).calls
        if self.mode == "required":
            return partial_call_list(text, 0, _REQUIRED_ARGUMENTS, reader)
        if self.mode == "auto":
            calls = self.parser.partial_calls(text, reader)
            return calls if self.parallel else calls[:1]
        return []


_REQUIRED_ARGUMENTS = ("parameters",)


def _required_calls(text: str) -> list[ParsedCall]:
    """The calls of a ``required`` output, ``[{"name": .., "parameters": {..}}, ..]``, or of
    as much of it as was generated: the complete calls, then the cut one if its name is, with
    its arguments as far as they are certain (``partial_call``, as a stream sent them)."""
    calls, i = [], 0
    try:
        i = _skip(text, 0, "[")
        while i < len(text):
            call, i = DECODER.raw_decode(text, i)
            calls.append(parse_call(call, _REQUIRED_ARGUMENTS))
            i = _skip(text, i, ",]")
    except (ValueError, RecursionError):  # cut short at text[i] (or nested past parsing)
        cut = partial_call(partial_value(text, i), _REQUIRED_ARGUMENTS)
        calls += [] if cut is None else [cut]
    return calls


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
    content, and tool-call deltas as OpenAI streams them, as the calls are written: a call's
    first delta carries its index, id, type and name, once the name is whole; later ones more
    ``arguments`` text, only what is certain (``ToolPlan.partial_calls``), so that a call's
    pieces add up to a whole response's arguments. The rest comes when the output ends: the
    rest of each call, the calls not begun, and the content after the calls.

    A call begun is never taken back. If the finished output does not parse to the calls
    begun (cut by ``max_tokens`` inside an ``auto`` call, or not valid after all), they end as
    they were sent, with nothing more: a whole response would have the text as content."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_content = 0  # characters of the text passed on as content
        self.sent: list[ParsedCall] = []  # the calls begun, with their arguments sent so far
        self.called = False  # the finished output's calls are those sent
        self.reader = JsonReader()  # the text's JSON, read on from where it was at each delta

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        if finished:
            return self._finish(text)
        parser = self.plan.parser
        delta = self._content(text, parser.content_length(text) if parser else 0)
        calls = self._calls(self.plan.partial_calls(text, self.reader))
        return (delta | {"tool_calls": calls}) if calls else delta

    def _finish(self, text: str) -> dict[str, Any]:
        parsed = self.plan.parse(text)
        if len(parsed.calls) < len(self.sent) or \
                not all(map(_extends, parsed.calls, self.sent)):
            return {}
        self.called = bool(parsed.calls)
        delta = {}
        if self.plan.mode == "auto":  # a required or named output is all calls, even cut short
            # The rest of a whole response's content, which extends what was streamed (and
            # may go on after the calls).
            delta = self._content(parsed.content or "", len(parsed.content or ""))
        calls = self._calls(parsed.calls)
        return (delta | {"tool_calls": calls}) if calls else delta

    def _content(self, text: str, end: int) -> dict[str, Any]:
        piece, self.num_content = text[self.num_content:end], max(self.num_content, end)
        return {"content": piece} if piece else {}

    def _calls(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        """The deltas from the calls sent to ``calls``: the arguments added to those begun, and
        the calls new. Where one does not extend what was sent (the output is not turning out
        as calls), nothing more is."""
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.sent):
                deltas.append(_call_delta(index, call.name, call.arguments))
                self.sent.append(call)
                continue
            if not _extends(call, self.sent[index]):
                break
            piece = call.arguments[len(self.sent[index].arguments):]
            if piece:
                deltas.append({"index": index, "function": {"arguments": piece}})
                self.sent[index] = call
        return deltas


def _extends(call: ParsedCall, sent: ParsedCall) -> bool:
    return call.name == sent.name and call.arguments.startswith(sent.arguments)


def _call_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"index": index, "id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
