"""The auto tool-call parsers on outputs in the formats real tool-calling models write
(Hermes 2 Pro / Qwen2.5 for ``hermes``, Llama 3.1 / 3.2 for ``llama3_json``; Mistral, Llama
3.2 / 4 pythonic, Granite 3.x and Phi-4-mini in their chat templates' formats), whole and fed
to a stream in every split, which sends the calls as they are written."""

from __future__ import annotations

import json
import os

import pytest

from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.tool_choice import ToolCallStream, ToolPlan
from pagedserve.server.tool_parsers import tool_parser
from tests.server.tool_call_deltas import add_up

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

# Written as a model may write JSON, not in its canonical form (``json.dumps``), which calls'
# arguments are in: a stream must not send a number, or an escaped character, early.
CANONICAL_ONLY_AT_THE_END = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"lo":-0.5,"hi" : 1E-2, "n": 10, '
     '"s": "\\u00e9\\ud83d\\ude00\\/", "t": [true, null]}}</tool_call>', None,
     [("f", {"lo": -0.5, "hi": 0.01, "n": 10, "s": "é😀/", "t": [True, None]})]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"lo":-0.0,"hi":2e1}', None, [("f", {"lo": -0.0, "hi": 20.0})]),
]

# Written in the formats of the models' chat templates (and vLLM's parsers), not recorded.
SEARCH = {"query": {"text": "café ☕ \"quoted\"", "filters": {"lang": ["fr", "日本語"],
                                                                "max": 3.5, "on": None}}}
SEARCH_JSON = json.dumps(SEARCH, ensure_ascii=False)
WEATHER_JSON = json.dumps(WEATHER)
TIME = ("get_current_time", {"city": "Orlando"})
FORMATS = [
    # Mistral 7B v0.3 / Nemo: one JSON list after [TOOL_CALLS].
    ("mistral", f'[TOOL_CALLS][{{"name": "get_current_weather", "arguments": {WEATHER_JSON}}}]',
     None, [("get_current_weather", WEATHER)]),
    ("mistral", 'Let me check both.[TOOL_CALLS] [{"name": "get_current_time", "arguments": '
     f'{{"city": "Orlando"}}}}, {{"name": "search", "arguments": {SEARCH_JSON}}}]',
     "Let me check both.", [TIME, ("search", SEARCH)]),
    # [TOOL_CALLS] dropped as a special token: the bare list.
    ("mistral", '[{"name": "get_current_time", "arguments": {"city": "Orlando"}}]', None, [TIME]),
    # Tokenizer v11+ (Mistral Small 3.1+): a marker per call, [CALL_ID] optional, and the
    # arguments after [ARGS] (or straight after the name, if [ARGS] was dropped).
    ("mistral", f"[TOOL_CALLS]get_current_weather[ARGS]{WEATHER_JSON}[TOOL_CALLS]search"
     f"[CALL_ID]a1B2c3D4e[ARGS]{SEARCH_JSON}[TOOL_CALLS]get_current_time{{\"city\": "
     '"Orlando"}', None, [("get_current_weather", WEATHER), ("search", SEARCH), TIME]),
    ("mistral", '\nSure.\n[TOOL_CALLS]get_current_time[ARGS]{"city": "Orlando"}\nI will tell '
     "you.", "\nSure.\nI will tell you.", [TIME]),
    ("mistral", "It is sunny [1].", "It is sunny [1].", []),
    ("mistral", "[1] says it is sunny.", "[1] says it is sunny.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_current_time", "arguments": {', None, []),
    ("mistral", '[TOOL_CALLS]get_current_time[ARGS]{"city": ', None, []),
    ("mistral", '[TOOL_CALLS][{"arguments": {}}]', None, []),  # no name
    # Llama 3.2: the whole output a Python list of calls; Llama 4 between its tags.
    ("pythonic", '[get_current_weather(city="Dallas", state="TX", unit="fahrenheit")]', None,
     [("get_current_weather", WEATHER)]),
    ("pythonic", '<|python_start|>[get_current_time(city="Orlando"), search(query={"text": '
     '"café ☕ \\"quoted\\"", "filters": {"lang": ("fr", "日本語"), "max": 3.5, "on": None}})]'
     "<|python_end|>", None, [TIME, ("search", SEARCH)]),
    ("pythonic", " \n[get_current_time()]\n", None, [("get_current_time", {})]),
    ("pythonic", "It is sunny in Dallas today.", "It is sunny in Dallas today.", []),
    # Not the whole output, not literals, positional, unclosed, not calls: content.
    ("pythonic", 'Sure: [get_current_time(city="Orlando")]', None, []),
    ("pythonic", '[get_current_time(city=__import__("os").system("ls"))]', None, []),
    ("pythonic", '[get_current_time(city=ORLANDO)]', None, []),
    ("pythonic", '[get_current_time("Orlando")]', None, []),
    ("pythonic", '[get_current_time(**{"city": "Orlando"})]', None, []),
    ("pythonic", '[os.system(cmd="ls")]', None, []),
    ("pythonic", '[get_current_time(city="Orlando")', None, []),
    ("pythonic", "[1, 2, 3]", None, []),
    ("pythonic", "[f(x=1e999)]", None, []),  # infinity is no JSON
    ("pythonic", "[f(x={1, 2})]", None, []),  # nor is a set
    # Granite 3.0 (<|tool_call|>, or nothing once skipped as a special token), 3.1+
    # (<tool_call>).
    ("granite", f'<|tool_call|>[{{"name": "get_current_weather", "arguments": {WEATHER_JSON}}}]',
     None, [("get_current_weather", WEATHER)]),
    ("granite", '[{"name": "get_current_time", "arguments": {"city": "Orlando"}}, {"name": '
     f'"search", "arguments": {SEARCH_JSON}}}]', None, [TIME, ("search", SEARCH)]),
    ("granite", 'Checking.\n<tool_call>[{"name": "get_current_time", "arguments": {"city": '
     '"Orlando"}}] I will report back.', "Checking. I will report back.", [TIME]),
    ("granite", "The weather in Dallas is sunny.", "The weather in Dallas is sunny.", []),
    ("granite", '<|tool_call|>[{"name": "get_current_time", "arguments": {"city": ]', None, []),
    # A Hermes-style block is not Granite's list: content.
    ("granite", '<tool_call>{"name": "get_current_time", "arguments": {}}</tool_call>', None,
     []),
    # Phi-4-mini: functools is plain text, so prose may mention it.
    ("phi4_mini_json", f'functools[{{"name": "get_current_weather", "arguments": '
     f'{WEATHER_JSON}}}]', None, [("get_current_weather", WEATHER)]),
    ("phi4_mini_json", 'Both, then. functools[{"name": "get_current_time", "parameters": '
     f'{{"city": "Orlando"}}}}, {{"name": "search", "arguments": {SEARCH_JSON}}}]\nDone.',
     "Both, then.\nDone.", [TIME, ("search", SEARCH)]),
    ("phi4_mini_json", "Python's functools has lru_cache; functools [] is no call.",
     "Python's functools has lru_cache; functools [] is no call.", []),
    ("phi4_mini_json", "Use functools.", "Use functools.", []),
    ("phi4_mini_json", 'functools[{"name": "get_current_time"', None, []),
]
ALL = RECORDED + CANONICAL_ONLY_AT_THE_END + FORMATS


@pytest.mark.parametrize(("name", "text", "content", "calls"), ALL)
def test_parser_on_recorded_output(name, text, content, calls):
    parsed = tool_parser(name).parse(text)
    if not calls and content is None:  # unparseable: the whole text stays content
        content = text
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


def _plan(name: str, parallel: bool = True) -> ToolPlan:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "get_current_weather"}}],
        parallel_tool_calls=parallel)
    return ToolPlan.of(request, tool_parser(name))


def _stream(plan: ToolPlan, text: str, ends) -> tuple[list[dict], ToolCallStream]:
    """The deltas of ``text`` streamed up to each of ``ends`` (the last is the whole text,
    which finishes it)."""
    stream = ToolCallStream(plan)
    return [stream.delta(text[:end], finished=end == len(text)) for end in ends], stream


def _splits(text: str):
    yield list(range(1, len(text) + 1))  # a character at a time
    for cut in range(len(text)):  # two pieces, cut anywhere
        yield [cut, len(text)]


@pytest.mark.parametrize(("name", "text", "content", "calls"), ALL)
def test_stream_in_every_split_adds_up_to_the_parse(name, text, content, calls):
    """Split anywhere, a stream sends the content before the calls as it comes, and the calls
    as they are written; each call's pieces add up to a whole response's arguments, exactly,
    and no piece is ever wrong (``add_up`` checks each against them). An output that breaks
    off inside a call begun (these are cut short) ends with it as sent."""
    parsed = tool_parser(name).parse(text)
    # The text before the first call: the part of the content a stream may send early.
    before = os.path.commonprefix([text, parsed.content or ""]) if parsed.calls else text
    for ends in _splits(text):
        deltas, stream = _stream(_plan(name), text, ends)
        added = add_up(deltas, parsed.calls)
        early = "".join(added.contents[:-1])
        assert before.startswith(early), (ends, early)
        if parsed.calls or not added.calls:
            assert "".join(added.contents) == (parsed.content or ""), ends
            assert added.calls == parsed.calls, ends
        else:
            assert "".join(added.contents) == early and not calls, ends
        assert stream.called == bool(parsed.calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), [c for c in ALL if c[3]])
def test_calls_stream_as_they_are_written(name, text, content, calls):
    """A character at a time, every call has begun before the output ends, and the JSON
    formats' arguments come in pieces as they are written (Hermes 2 Pro writes them before
    the name: they come with it); a pythonic call comes whole, once written."""
    deltas, _ = _stream(_plan(name), text, range(1, len(text) + 1))
    added = add_up(deltas[:-1])
    assert len(added.calls) == len(calls)
    if name == "pythonic":
        assert added.calls == tool_parser(name).parse(text).calls
    elif '{"arguments"' not in text:
        assert all(n > 1 for n, (_, arguments) in zip(added.pieces, calls) if arguments), added


def test_without_parallel_tool_calls_only_the_first_call_streams():
    text = RECORDED[1][1]  # a sentence, then two calls
    plan = _plan("hermes", parallel=False)
    for ends in _splits(text):
        deltas, stream = _stream(plan, text, ends)
        assert add_up(deltas).calls == plan.parse(text).calls, ends
        assert len(plan.parse(text).calls) == 1


@pytest.mark.parametrize("body", [
    '{"name": "f", "parameters": {"a": 1}, "arguments": {"a": 2}}',
    '{"name": "f", "arguments": {"a": 1, "a": 2}}',
    '{"name": "f", "name": "g", "arguments": {}}',
])
def test_a_call_that_gives_a_key_twice_is_no_call(body):
    """Which one would count is unknown while the call is written (json.loads keeps the
    last, a stream has sent the first)."""
    for name, text in [("hermes", f"<tool_call>{body}</tool_call>"), ("llama3_json", body),
                       ("granite", f"<tool_call>[{body}]")]:
        assert tool_parser(name).parse(text) == (text, []), name


def test_arguments_written_as_a_json_string_stream_once_the_string_is_whole():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'
    (call,) = tool_parser("hermes").parse(text).calls
    assert call.arguments == '{"a": [1, 2]}'
    deltas, _ = _stream(_plan("hermes"), text, range(1, len(text) + 1))
    assert add_up(deltas).calls == [call]


def test_plain_content_streams_as_it_comes():
    """What cannot start a call is not held back to the end."""
    for name, text in [("mistral", "It is sunny, I read [1] today."),
                       ("granite", "Sunny <tool today."),
                       ("phi4_mini_json", "Use functools, it helps."),
                       ("pythonic", "It is sunny.")]:
        deltas, _ = _stream(_plan(name), text, list(range(1, len(text) + 1)))
        early = "".join(d.get("content", "") for d in deltas[:-1])
        assert len(early) >= len(text) - len("functools"), name


def test_stream_holds_back_what_may_start_a_call():
    stream = ToolCallStream(ToolPlan.of(ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f"}}]), tool_parser("hermes")))
    assert stream.delta("Sure <tool", finished=False) == {"content": "Sure"}
    assert stream.delta("Sure <tool_c", finished=False) == {}
    assert stream.delta("Sure <tools are", finished=False) == {"content": " <tools are"}


def test_unknown_parser_lists_the_valid_ones():
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nonesuch")
