"""``--reasoning-parser`` through the openai SDK, against the app in this process over a
stand-in engine that generates scripted text (``scripted_engine.py``): the exact outputs of
reasoning models (tags split across deltas anywhere, no end tag, empty reasoning, tool calls
after the reasoning) without a model that writes them."""

from __future__ import annotations

import openai
import pytest

from pagedserve.server.tool_parsers import tool_parser
from tests.server.scripted_engine import (
    ScriptedEngine,
    ScriptedTokenizer,
    run_with_client,
    scripted_app,
)
from tests.server.tool_call_deltas import add_up

USER = [{"role": "user", "content": "Which is greater, 9.11 or 9.8?"}]
R1 = "Compare the tenths: 8 > 1.\n</think>\n\n9.8 is greater."
GRANITE = ("Here is my thought process:\nCompare the tenths: 8 > 1.\nHere is my response:\n"
           "9.8 is greater.")
MAGISTRAL = "[THINK]Compare the tenths: 8 > 1.[/THINK]9.8 is greater."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


async def _message(client, **kwargs):
    response = await client.chat.completions.create(model="r1", messages=USER, **kwargs)
    return response.choices[0]


async def _streamed(client, **kwargs) -> tuple[list[dict], str | None]:
    """The deltas of a streamed choice (the opening role chunk left out), as sent, and its
    finish_reason."""
    deltas, reason = [], None
    stream = await client.chat.completions.create(model="r1", messages=USER, stream=True,
                                                  **kwargs)
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role is None:
                deltas.append(choice.delta.model_dump(exclude_none=True))
            reason = choice.finish_reason or reason
    return deltas, reason


def _joined(deltas: list[dict], key: str) -> str | None:
    pieces = [d[key] for d in deltas if key in d]
    return "".join(pieces) if pieces else None


@pytest.mark.parametrize(("reasoning", "text", "expected_reasoning", "expected_content"), [
    ("deepseek_r1", R1, "Compare the tenths: 8 > 1.\n", "\n\n9.8 is greater."),
    ("deepseek_r1", "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    # max_tokens ran out inside the reasoning.
    ("deepseek_r1", "Compare the tenths", "Compare the tenths", None),
    ("deepseek_r1", "<think></think>Yes.", None, "Yes."),
    ("qwen3", "<think>\nA greeting.\n</think>\n\nHello!", "\nA greeting.\n", "\n\nHello!"),
    ("qwen3", "Hello!", None, "Hello!"),
    ("granite", GRANITE, "\nCompare the tenths: 8 > 1.\n", "\n9.8 is greater."),
    ("granite", "Here's my thought process: Hmm. Here's my response: Yes.", " Hmm. ", " Yes."),
    ("granite", "9.8 is greater.", None, "9.8 is greater."),
    ("granite", "Here is my thought process: cut short", " cut short", None),
    ("mistral", MAGISTRAL, "Compare the tenths: 8 > 1.", "9.8 is greater."),
    ("mistral", "9.8 is greater.", None, "9.8 is greater."),
    ("mistral", "[THINK]cut short", "cut short", None),
])
def test_message_has_the_reasoning_apart(reasoning, text, expected_reasoning,
                                         expected_content):
    engine = ScriptedEngine()
    engine.script([text])
    choice = run_with_client(scripted_app(engine, reasoning), _message)
    assert choice.message.content == expected_content
    assert choice.message.model_extra == {"reasoning_content": expected_reasoning,
                                          "reasoning": expected_reasoning}
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize(("reasoning", "text"), [
    *(("deepseek_r1", t) for t in [R1, "<think>Hmm.</think>Yes.", "Compare </thi", "</think>",
                                   "<think>x</think>"]),
    *(("granite", t) for t in [GRANITE, "Here's my thought process: a Here's my response: b",
                               "Here is my thought process: cut at Here is my",
                               "Here is my", "Hello!"]),
    *(("mistral", t) for t in [MAGISTRAL, "[THINK]cut at [/THI", "[THI", "Hello!"])])
def test_streamed_cut_anywhere_adds_up_to_the_message(reasoning, text):
    """Two deltas cut at each point, a tag split across them at most, and a delta per
    character: reasoning deltas, then content deltas, adding up to the whole message."""
    engine = ScriptedEngine()
    app = scripted_app(engine, reasoning)

    async def work(client):
        engine.script([text])
        whole = (await _message(client)).message
        for pieces in [*([text[:cut], text[cut:]] for cut in range(len(text) + 1)), [*text]]:
            engine.script(pieces)
            deltas, reason = await _streamed(client)
            assert reason == "stop"
            assert _joined(deltas, "reasoning_content") == whole.model_extra["reasoning_content"]
            assert _joined(deltas, "reasoning") == whole.model_extra["reasoning"]
            assert _joined(deltas, "content") == whole.content
            # No reasoning after the answer began (a delta may carry the end of one and the
            # start of the other).
            first = next((i for i, d in enumerate(deltas) if "content" in d), len(deltas))
            assert not any("reasoning" in d for d in deltas[first + 1:]), pieces

    run_with_client(app, work)


def test_tool_calls_are_parsed_from_the_answer_alone():
    engine = ScriptedEngine()
    app = scripted_app(engine, tool_parser=tool_parser("hermes"))
    thought = f"I could answer with {CALL} but a call is not needed.\n"

    async def work(client):
        engine.script([f"The user wants Paris.\n</think>\n\n{CALL}"])
        called = await _message(client, tools=TOOLS)
        engine.script(list(engine.pieces[0]))
        called_deltas, called_reason = await _streamed(client, tools=TOOLS)
        engine.script([f"{thought}</think>It is sunny."])
        answered = await _message(client, tools=TOOLS)
        return called, called_deltas, called_reason, answered

    called, deltas, reason, answered = run_with_client(app, work)
    assert called.finish_reason == "tool_calls" and called.message.content is None
    assert called.message.model_extra["reasoning"] == "The user wants Paris.\n"
    assert [(c.function.name, c.function.arguments) for c in called.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert reason == "tool_calls" and _joined(deltas, "reasoning") == "The user wants Paris.\n"
    assert _joined(deltas, "content") is None
    assert add_up(deltas).calls == [("get_weather", '{"city": "Paris"}')]
    # A call written inside the reasoning is reasoning, not a call.
    assert answered.message.tool_calls == [] and answered.finish_reason == "stop"
    assert (answered.message.model_extra["reasoning"], answered.message.content) == (
        thought, "It is sunny.")


STRUCTURED = [{"response_format": {"type": "json_object"}},
              {"extra_body": {"guided_regex": "[a-z]+"}},
              {"tools": TOOLS, "tool_choice": "required"},
              {"tools": TOOLS,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}]


@pytest.mark.parametrize(("reasoning", "start"), [("deepseek_r1", None), ("qwen3", 7)])
@pytest.mark.parametrize("fields", STRUCTURED)
def test_structured_output_applies_after_the_reasoning(fields, reasoning, start):
    """The request's grammar waits for the reasoning: it carries the end tag's ids (and, for
    qwen3's optional think block, the start tag's); the answer is parsed as usual."""
    engine = ScriptedEngine()
    answer = '{"city": "Paris"}'
    if fields.get("tool_choice") == "required":  # a list of calls
        answer = f'[{{"name": "get_weather", "parameters": {answer}}}]'
    engine.script(["<think>", "Hmm.", "</think>", answer])
    choice = run_with_client(scripted_app(engine, reasoning=reasoning),
                             lambda client: _message(client, **fields))
    structured = engine.requests[0].params.structured_outputs
    assert (structured.reasoning_end_token_ids, structured.reasoning_start_token_id) == \
        ([8], start)
    assert choice.message.model_extra["reasoning"] == "Hmm."
    if "tools" in fields:
        assert choice.message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    else:
        assert choice.message.content == answer


@pytest.mark.parametrize(("fields", "param"), zip(
    STRUCTURED, ["response_format", "guided_regex", "tools", "tools"], strict=True))
def test_structured_output_needs_a_one_token_start_tag_for_qwen3(monkeypatch, fields, param):
    """qwen3's output may or may not open with <think>; the engine follows that by its first
    token only."""
    monkeypatch.setattr(ScriptedTokenizer, "tags", {"</think>": [8]})
    engine = ScriptedEngine()
    engine.script(["{}"])

    async def work(client):
        with pytest.raises(openai.BadRequestError) as exc:
            await _message(client, **fields)
        return exc.value

    error = run_with_client(scripted_app(engine, reasoning="qwen3"), work)
    assert error.body["param"] == param and "one token" in error.body["message"]
    # deepseek_r1 reads only the end tag.
    engine.script(["</think>{}"])
    run_with_client(scripted_app(engine), lambda client: _message(client, **fields))
    assert engine.requests[0].params.structured_outputs.reasoning_end_token_ids == [8]


def test_without_a_reasoning_parser_the_tags_are_content():
    engine = ScriptedEngine()
    engine.script([R1])
    choice = run_with_client(scripted_app(engine, reasoning=None), _message)
    assert choice.message.content == R1 and choice.message.model_extra == {}



@pytest.mark.parametrize(("reasoning", "kept"), [
    ("mistral", True), ("granite", False), ("qwen3", False), ("deepseek_r1", False)])
def test_mistral_requests_keep_special_tokens(reasoning, kept):
    """[THINK] and [/THINK] are special tokens: without them in the text the mistral parser
    would see the reasoning as content."""
    engine = ScriptedEngine()
    engine.script([MAGISTRAL])
    run_with_client(scripted_app(engine, reasoning=reasoning), _message)
    assert engine.requests[0].params.skip_special_tokens is not kept


def test_structured_output_follows_magistral_markers_by_their_ids(monkeypatch):
    monkeypatch.setattr(ScriptedTokenizer, "tags", {"[THINK]": [5], "[/THINK]": [6]})
    engine = ScriptedEngine()
    engine.script(["[THINK]", "Hmm.", "[/THINK]", "{}"])
    choice = run_with_client(scripted_app(engine, reasoning="mistral"), lambda client: _message(
        client, response_format={"type": "json_object"}))
    structured = engine.requests[0].params.structured_outputs
    assert (structured.reasoning_end_token_ids, structured.reasoning_start_token_id) == ([6], 5)
    assert (choice.message.model_extra["reasoning"], choice.message.content) == ("Hmm.", "{}")


def test_structured_output_is_refused_with_granite():
    """Granite's markers are plain text of several tokens, in two spellings: the engine cannot
    tell by token ids where the reasoning ends."""
    engine = ScriptedEngine()
    engine.script(["{}"])

    async def work(client):
        with pytest.raises(openai.BadRequestError) as exc:
            await _message(client, response_format={"type": "json_object"})
        return exc.value

    error = run_with_client(scripted_app(engine, reasoning="granite"), work)
    assert error.body["param"] == "response_format" and "one token" in error.body["message"]
