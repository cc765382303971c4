"""``--reasoning-parser`` through the openai SDK, against the app in this process over a
stand-in engine that generates scripted text, a delta per scripted piece: the exact outputs of
reasoning models (tags split across deltas anywhere, no end tag, empty reasoning, tool calls
after the reasoning) without a model that writes them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import openai
import pytest

from pagedserve.engine.input_processor import InputLimits
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.server.reasoning_parsers import REASONING_PARSERS
from pagedserve.server.tool_parsers import tool_parser

LIMITS = InputLimits(vocab_size=100, max_model_len=4096, max_num_seqs=4,
                     eos_token_ids=frozenset({0}), num_kv_blocks=16, block_size=16,
                     max_grammar_bytes=1 << 16, max_logprobs=20)
USER = [{"role": "user", "content": "Which is greater, 9.11 or 9.8?"}]
R1 = "Compare the tenths: 8 > 1.\n</think>\n\n9.8 is greater."
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


class _Tokenizer:
    """A token a character, but for ``tags``, each one token."""

    chat_template = "any"
    tags = {"<think>": [7], "</think>": [8]}

    def apply_chat_template(self, messages: list[dict], **_) -> str:
        return "".join(m["content"] for m in messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tags.get(text, [1] * len(text))


class _ScriptedStream:
    """A request's cumulative outputs: the scripted pieces one after another, a token each."""

    def __init__(self, request, pieces: list[str]) -> None:
        self.request, self.pieces, self.finished = request, pieces, False

    async def __aiter__(self):
        for i in range(len(self.pieces)):
            self.finished = i == len(self.pieces) - 1
            out = CompletionOutput(0, "".join(self.pieces[:i + 1]), [5] * (i + 1), None, None,
                                   "stop" if self.finished else None)
            yield RequestOutput(self.request.request_id, None, self.request.prompt_token_ids,
                                None, [out], self.finished,
                                RequestMetrics(0.0, num_generated_tokens=i + 1))

    def close(self) -> None:
        self.finished = True


class _ScriptedEngine:
    """Writes ``pieces`` for every request."""

    def __init__(self) -> None:
        self.facts = SimpleNamespace(model_name="r1", limits=LIMITS, lora=None,
                                     sampling_defaults={})
        self.tokenizer, self.is_running, self.stats = _Tokenizer(), True, None
        self.pieces: list[str] = []

    def add_requests(self, requests):
        self.requests = requests
        return [_ScriptedStream(r, self.pieces) for r in requests]


def _app(engine: _ScriptedEngine, reasoning: str | None = "deepseek_r1", **options):
    from pagedserve.server.app import create_app

    parser = REASONING_PARSERS[reasoning] if reasoning else None
    return create_app([engine], reasoning_parser=parser, **options)


def _run(app, work):
    """``work(client)`` with an openai client of the in-process ``app``."""
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            return await work(openai.AsyncOpenAI(base_url="http://localhost/v1", api_key="-",
                                                 http_client=http, max_retries=0))
    return asyncio.run(run())


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
])
def test_message_has_the_reasoning_apart(reasoning, text, expected_reasoning,
                                         expected_content):
    engine = _ScriptedEngine()
    engine.pieces = [text]
    choice = _run(_app(engine, reasoning), _message)
    assert choice.message.content == expected_content
    assert choice.message.model_extra == {"reasoning_content": expected_reasoning,
                                          "reasoning": expected_reasoning}
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("text", [R1, "<think>Hmm.</think>Yes.", "Compare </thi", "</think>",
                                  "<think>x</think>"])
def test_streamed_cut_anywhere_adds_up_to_the_message(text):
    """Two deltas cut at each point, a tag split across them at most, and a delta per
    character: reasoning deltas, then content deltas, adding up to the whole message."""
    engine = _ScriptedEngine()
    app = _app(engine)

    async def work(client):
        engine.pieces = [text]
        whole = (await _message(client)).message
        for pieces in [*([text[:cut], text[cut:]] for cut in range(len(text) + 1)), [*text]]:
            engine.pieces = pieces
            deltas, reason = await _streamed(client)
            assert reason == "stop"
            assert _joined(deltas, "reasoning_content") == whole.model_extra["reasoning_content"]
            assert _joined(deltas, "reasoning") == whole.model_extra["reasoning"]
            assert _joined(deltas, "content") == whole.content
            # No reasoning after the answer began (a delta may carry the end of one and the
            # start of the other).
            first = next((i for i, d in enumerate(deltas) if "content" in d), len(deltas))
            assert not any("reasoning" in d for d in deltas[first + 1:]), pieces

    _run(app, work)


def test_tool_calls_are_parsed_from_the_answer_alone():
    engine = _ScriptedEngine()
    app = _app(engine, tool_parser=tool_parser("hermes"))
    thought = f"I could answer with {CALL} but a call is not needed.\n"

    async def work(client):
        engine.pieces = [f"The user wants Paris.\n</think>\n\n{CALL}"]
        called = await _message(client, tools=TOOLS)
        engine.pieces = list(engine.pieces[0])
        called_deltas, called_reason = await _streamed(client, tools=TOOLS)
        engine.pieces = [f"{thought}</think>It is sunny."]
        answered = await _message(client, tools=TOOLS)
        return called, called_deltas, called_reason, answered

    called, deltas, reason, answered = _run(app, work)
    assert called.finish_reason == "tool_calls" and called.message.content is None
    assert called.message.model_extra["reasoning"] == "The user wants Paris.\n"
    assert [(c.function.name, c.function.arguments) for c in called.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert reason == "tool_calls" and _joined(deltas, "reasoning") == "The user wants Paris.\n"
    assert _joined(deltas, "content") is None
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"] for c in calls] == [{"name": "get_weather",
                                               "arguments": '{"city": "Paris"}'}]
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
    engine = _ScriptedEngine()
    answer = '{"city": "Paris"}'
    if fields.get("tool_choice") == "required":  # a list of calls
        answer = f'[{{"name": "get_weather", "parameters": {answer}}}]'
    engine.pieces = ["<think>", "Hmm.", "</think>", answer]
    choice = _run(_app(engine, reasoning=reasoning), lambda client: _message(client, **fields))
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
    monkeypatch.setattr(_Tokenizer, "tags", {"</think>": [8]})
    engine = _ScriptedEngine()
    engine.pieces = ["{}"]

    async def work(client):
        with pytest.raises(openai.BadRequestError) as exc:
            await _message(client, **fields)
        return exc.value

    error = _run(_app(engine, reasoning="qwen3"), work)
    assert error.body["param"] == param and "one token" in error.body["message"]
    # deepseek_r1 reads only the end tag.
    engine.pieces = ["</think>{}"]
    _run(_app(engine), lambda client: _message(client, **fields))
    assert engine.requests[0].params.structured_outputs.reasoning_end_token_ids == [8]


def test_without_a_reasoning_parser_the_tags_are_content():
    engine = _ScriptedEngine()
    engine.pieces = [R1]
    choice = _run(_app(engine, reasoning=None), _message)
    assert choice.message.content == R1 and choice.message.model_extra == {}

