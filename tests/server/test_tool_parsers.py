"""The auto tool-call parsers on outputs in the formats real tool-calling models write
(Hermes 2 Pro / Qwen2.5 for ``hermes``, Llama 3.1 / 3.2 for ``llama3_json``), whole and fed to
a stream a few characters at a time."""

from __future__ import annotations

import json

import pytest

from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.tool_choice import ToolCallStream, ToolPlan
from pagedserve.server.tool_parsers import tool_parser

WEATHER = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}

# (parser, model output, expected content, expected [(name, arguments)])
RECORDED = [
    # Qwen2.5-7B-Instruct, one call.
    ("hermes", '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Dallas", '
     '"state": "TX", "unit": "fahrenheit"}}\n</tool_call>', None,
     [("get_current_weather", WEATHER)]),
    # Hermes-2-Pro-Llama-3-8B: a sentence, then two calls.
    ("hermes", "I'll look both up for you.\n<tool_call>\n{\"arguments\": {\"city\": \"Dallas\", "
     "\"state\": \"TX\", \"unit\": \"fahrenheit\"}, \"name\": \"get_current_weather\"}\n"
     "</tool_call>\n<tool_call>\n{\"arguments\": {\"city\": \"Orlando\"}, \"name\": "
     "\"get_current_time\"}\n</tool_call>", "I'll look both up for you.",
     [("get_current_weather", WEATHER), ("get_current_time", {"city": "Orlando"})]),
    # The whitespace before a call is dropped, the rest kept: a stream cannot tell leading
    # whitespace from that of plain content.
    ("hermes", "\n Let me  check.\n\n<tool_call>\n{\"name\": \"get_current_time\", "
     "\"arguments\": {\"city\": \"Orlando\"}}\n</tool_call>", "\n Let me  check.",
     [("get_current_time", {"city": "Orlando"})]),
    ("hermes", ' \n<tool_call>{"name": "get_current_time", "arguments": {}}</tool_call>', None,
     [("get_current_time", {})]),
    # Stopped at </tool_call> as a stop string: the last block has no closing tag.
    ("hermes", '<tool_call>\n{"name": "get_current_time", "arguments": {}}\n', None,
     [("get_current_time", {})]),
    ("hermes", "The weather in Dallas is 85 degrees and sunny.",
     "The weather in Dallas is 85 degrees and sunny.", []),
    # A broken block is content, not a half call.
    ("hermes", '<tool_call>\n{"name": "get_current_time", "arguments": {', None, []),
    # Llama-3.2-3B-Instruct.
    ("llama3_json", '{"name": "get_current_weather", "parameters": {"city": "Dallas", '
     '"state": "TX", "unit": "fahrenheit"}}', None, [("get_current_weather", WEATHER)]),
    # Llama-3.1-8B-Instruct with its python tag, two calls separated by ";".
    ("llama3_json", '<|python_tag|>{"name": "get_current_weather", "parameters": {"city": '
     '"Dallas", "state": "TX", "unit": "fahrenheit"}}; {"name": "get_current_time", '
     '"parameters": {"city": "Orlando"}}', None,
     [("get_current_weather", WEATHER), ("get_current_time", {"city": "Orlando"})]),
    ("llama3_json", "It is sunny in Dallas today.", "It is sunny in Dallas today.", []),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_parser_on_recorded_output(name, text, content, calls):
    parsed = tool_parser(name).parse(text)
    if not calls and content is None:  # unparseable: the whole text stays content
        content = text
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED)
def test_streamed_deltas_add_up_to_the_parse(name, text, content, calls):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "get_current_weather"}}])
    stream = ToolCallStream(ToolPlan.of(request, tool_parser(name)))
    streamed_content, streamed_calls = "", []
    for end in [*range(0, len(text), 3), len(text)]:
        delta = stream.delta(text[:end], finished=end == len(text))
        streamed_content += delta.get("content", "")
        streamed_calls += delta.get("tool_calls", [])
    expected = tool_parser(name).parse(text)
    # The same content as a whole response's: the whitespace before a call was streamed.
    assert streamed_content == (expected.content or "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]), c["index"])
            for c in streamed_calls] == [(n, a, i) for i, (n, a) in enumerate(calls)]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in streamed_calls)


def test_stream_holds_back_what_may_start_a_call():
    stream = ToolCallStream(ToolPlan.of(ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f"}}]), tool_parser("hermes")))
    assert stream.delta("Sure <tool", finished=False) == {"content": "Sure"}
    assert stream.delta("Sure <tool_c", finished=False) == {}
    assert stream.delta("Sure <tools are", finished=False) == {"content": " <tools are"}


def test_unknown_parser_lists_the_valid_ones():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("mistral")
