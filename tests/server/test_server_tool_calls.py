"""Auto tool calls through the openai SDK with each model family's parser, against the app in
this process over a stand-in engine that writes the family's format (``scripted_engine.py``):
whole, and streamed a character at a time, the calls as they are written."""

from __future__ import annotations

import json

import pytest

from pagedserve.server.tool_parsers import ParsedCall, tool_parser
from tests.server.scripted_engine import ScriptedEngine, run_with_client, scripted_app
from tests.server.tool_call_deltas import add_up

USER = [{"role": "user", "content": "Weather in Paris and the time in Orlando?"}]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
    for n in ("get_weather", "get_current_time")]
# -0.5 and 1.25 would be sent wrong as soon as "-0" and "1.2" are written.
CALLS = [("get_weather", {"city": "Paris ☀", "days": {"from": 1, "to": [2, 3]}, "min": -0.5,
                          "max": 1.25}),
         ("get_current_time", {"city": "Orlando"})]
ARGS = [json.dumps(a, ensure_ascii=False) for _, a in CALLS]

# (parser, output, content)
OUTPUTS = [
    ("hermes", f'On it.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS[0]}}}\n'
     f'</tool_call>\n<tool_call>\n{{"name": "get_current_time", "arguments": {ARGS[1]}}}\n'
     "</tool_call>", "On it."),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS[0]}}}; '
     f'{{"name": "get_current_time", "parameters": {ARGS[1]}}}', None),
    ("mistral", f'Checking.[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS[0]}}}, '
     f'{{"name": "get_current_time", "arguments": {ARGS[1]}}}]', "Checking."),
    ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{ARGS[0]}[TOOL_CALLS]get_current_time[ARGS]"
     f"{ARGS[1]}", None),
    ("pythonic", '[get_weather(city="Paris ☀", days={"from": 1, "to": (2, 3)}, min=-0.5, '
     'max=1.25), get_current_time(city="Orlando")]', None),
    ("granite", f'<|tool_call|>[{{"name": "get_weather", "arguments": {ARGS[0]}}}, '
     f'{{"name": "get_current_time", "arguments": {ARGS[1]}}}] Back soon.', "Back soon."),
    ("phi4_mini_json", f'Sure. functools[{{"name": "get_weather", "arguments": {ARGS[0]}}}, '
     f'{{"name": "get_current_time", "arguments": {ARGS[1]}}}]', "Sure."),
]


async def _both(client):
    whole = await client.chat.completions.create(model="r1", messages=USER, tools=TOOLS)
    stream = await client.chat.completions.create(model="r1", messages=USER, tools=TOOLS,
                                                  stream=True)
    return whole.choices[0], [c async for c in stream]


@pytest.mark.parametrize(("parser", "text", "content"), OUTPUTS,
                         ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(OUTPUTS)])
def test_calls_whole_and_streamed(parser, text, content):
    """Streamed, the calls come as they are written: a call's arguments in many chunks (a
    pythonic call's whole, before the output ends), which add up to the whole response's
    arguments exactly."""
    engine = ScriptedEngine()
    engine.script(list(text))
    choice, chunks = run_with_client(
        scripted_app(engine, reasoning=None, tool_parser=tool_parser(parser)), _both)
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    whole = [ParsedCall(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert [(name, json.loads(arguments)) for name, arguments in whole] == CALLS
    deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
    added = add_up(deltas, whole)
    assert "".join(added.contents) == (content or "")
    assert added.calls == whole
    assert add_up(deltas[:-1]).calls[0].name == "get_weather"  # begun before the end
    if parser == "pythonic":
        assert added.pieces == [1, 1]
    else:
        assert min(added.pieces) > 10, added.pieces
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("text", [
    "[" * 100_000, '[get_weather(city=open("/etc/passwd").read())]', "[f(x=" + "9" * 5000 + ")]",
    "[TOOL_CALLS]" + "{" * 50_000, "functools[" + '{"a": ' * 50_000,
    "<tool_call>" + "[" * 100_000, "{\"a\": " + "[" * 100_000])
def test_hostile_output_is_content(text):
    """An output a client could provoke (deep nesting, code, huge numbers) is content, and the
    server answers."""
    engine = ScriptedEngine()
    engine.script([text])
    for parser in ("pythonic", "mistral", "phi4_mini_json", "granite", "hermes", "llama3_json"):
        choice, _ = run_with_client(
            scripted_app(engine, reasoning=None, tool_parser=tool_parser(parser)), _both)
        assert (choice.message.content, choice.message.tool_calls) == (text, []), parser
        assert choice.finish_reason == "stop"


@pytest.mark.parametrize(("parser", "choice", "kept"), [
    ("mistral", "auto", True), ("mistral", "none", False), ("hermes", "auto", False),
    ("granite", "auto", False)])
def test_mistral_auto_request_keeps_special_tokens(parser, choice, kept):
    """[TOOL_CALLS] and [ARGS] are special tokens the mistral parser reads (vLLM's rule)."""
    engine = ScriptedEngine()
    engine.script(["Hi."])

    async def work(client):
        await client.chat.completions.create(model="r1", messages=USER, tools=TOOLS,
                                             tool_choice=choice)
    run_with_client(scripted_app(engine, reasoning=None, tool_parser=tool_parser(parser)), work)
    assert engine.requests[0].params.skip_special_tokens is not kept
