"""A tool call cut short by ``max_tokens`` is still a tool call (as in vLLM and OpenAI): the
named function's ``tool_calls`` entry carries the arguments as far as they were generated,
``finish_reason`` is ``"length"``, and a stream's deltas add up to the same.

The reference is the same greedy request with room to finish; every shorter ``max_tokens`` is
tried, so the cut lands at every point of the output, inside the arguments and before them.
"""

from __future__ import annotations

import json

import pytest

MODEL = "model"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Bounded arguments, so the greedy reference finishes well within its max_tokens.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["tz"], "properties": {"tz": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ROOM = 200


def _create(server, max_tokens: int, **kwargs):
    return server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=max_tokens, temperature=0, **kwargs)


def _streamed(server, max_tokens: int, **kwargs) -> tuple[str | None, list[dict], str | None]:
    """The joined content, the calls as the SDK's users accumulate them, the finish reason."""
    content, calls, reason = None, {}, None
    for chunk in _create(server, max_tokens, stream=True, **kwargs):
        (choice,) = chunk.choices
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:  # the first delta of a call names it
                assert d.id.startswith("call_") and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def _reference(server, **kwargs) -> tuple[list[tuple[str, str]], int]:
    full = _create(server, ROOM, **kwargs)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    json.loads(calls[-1][1])  # complete arguments
    return calls, full.usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_cut_by_max_tokens_is_a_tool_call(server, stream):
    ((name, arguments),), num_tokens = _reference(server, tool_choice=NAMED)
    assert name == "get_weather" and num_tokens > 2
    got = []
    for max_tokens in range(1, num_tokens):
        if stream:
            content, calls, reason = _streamed(server, max_tokens, tool_choice=NAMED)
            (call,) = calls
        else:
            choice = _create(server, max_tokens, tool_choice=NAMED).choices[0]
            content, reason = choice.message.content, choice.finish_reason
            (tool_call,) = choice.message.tool_calls
            call = {"name": tool_call.function.name, "arguments": tool_call.function.arguments}
            assert tool_call.id.startswith("call_") and tool_call.type == "function"
        assert (reason, content, call["name"]) == ("length", None, "get_weather")
        assert arguments.startswith(call["arguments"]), (max_tokens, call, arguments)
        got.append(call["arguments"])
    # Each token more is more of the arguments (the reference's last token is its end of
    # sequence, so the longest cut holds them all).
    assert got == sorted(got, key=len) and 0 < len(got[0]) < len(arguments)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_tool_choice_cut_by_max_tokens_returns_what_was_parsed(server, stream):
    """``required`` writes ``[{"name": ..., "parameters": {...}}, ...]``: a cut gives the calls
    whose name was written, the last with its arguments so far; no content."""
    kwargs = dict(tool_choice="required", parallel_tool_calls=False)
    ((name, arguments),), num_tokens = _reference(server, **kwargs)
    num_calls = []
    for max_tokens in range(1, num_tokens):
        if stream:
            content, calls, reason = _streamed(server, max_tokens, **kwargs)
        else:
            choice = _create(server, max_tokens, **kwargs).choices[0]
            content, reason = choice.message.content, choice.finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in choice.message.tool_calls]
        assert (reason, content) == ("length", None)
        for call in calls:
            assert call["name"] == name
            assert arguments.startswith(call["arguments"]), (max_tokens, call, arguments)
        num_calls.append(len(calls))
    # Cut before the name is complete: nothing parsed yet; after it: the call.
    assert num_calls == sorted(num_calls) and num_calls[0] == 0 and num_calls[-1] == 1


WHOLE = ('[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}, '
         '{"name": "get_time", "parameters": {"tz": "UTC"}}]')
PARIS = '{"city": "Paris", "unit": "C"}'


@pytest.mark.parametrize(("text", "calls"), [
    ("", []),
    ("[", []),
    ('[{"name": "get_wea', []),
    ('[{"name": "get_weather"', [("get_weather", "")]),
    ('[{"name": "get_weather", "parameters": {"city": "Pa', [("get_weather", '{"city": "Pa')]),
    ('[{"name": "get_weather", "parameters": ' + PARIS, [("get_weather", PARIS)]),
    (WHOLE[:WHOLE.index('{"tz"') + 3], [("get_weather", PARIS), ("get_time", '{"t')]),
    (WHOLE[:-1], [("get_weather", PARIS), ("get_time", '{"tz": "UTC"}')]),
    (WHOLE, [("get_weather", PARIS), ("get_time", '{"tz": "UTC"}')]),
])
def test_required_output_cut_anywhere_parses_to_its_calls(text, calls):
    """And streamed, split anywhere, the calls come as they are written and add up to the
    same (``add_up`` checks that no piece is wrong)."""
    from pagedserve.server.protocol import ChatCompletionRequest
    from pagedserve.server.tool_choice import ToolCallStream, ToolPlan
    from tests.server.tool_call_deltas import add_up

    plan = ToolPlan.of(ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="required"),
                       None)
    assert plan.parse(text) == (None, calls)
    for ends in [range(1, len(text) + 1), *([cut, len(text)] for cut in range(len(text)))]:
        stream = ToolCallStream(plan)
        added = add_up([stream.delta(text[:end], finished=end == len(text)) for end in ends],
                       plan.parse(text).calls)
        assert (added.calls, "".join(added.contents)) == (plan.parse(text).calls, "")
    if len(calls) == 2:  # the first call came whole before the second was written
        early = ToolCallStream(plan).delta(text[:text.index('"get_time"')], finished=False)
        assert add_up([early]).calls == calls[:1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("tool_choice", "stop"), [(NAMED, '"'), ("required", '"parameters"')],
                         ids=["named", "required"])
def test_a_stop_string_inside_an_enforced_call_is_no_finished_call(server, stream, tool_choice,
                                                                   stop):
    """A stop string cuts a grammar-enforced output where it appears: the arguments are as
    incomplete as a ``max_tokens`` cut's, so ``finish_reason`` stays ``"stop"`` (with the
    string as ``stop_reason``); ``"tool_calls"`` told the client the call was whole."""
    kwargs = dict(tool_choice=tool_choice, stop=[stop])  # before the arguments are whole
    if stream:
        _, _, reason = _streamed(server, ROOM, **kwargs)
    else:
        choice = _create(server, ROOM, **kwargs).choices[0]
        reason = choice.finish_reason
        assert choice.model_extra["stop_reason"] == stop
    assert reason == "stop"
