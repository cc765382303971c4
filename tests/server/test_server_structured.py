"""Structured output and tool calling through the openai SDK, against a real server on the
default model (started with ``--enable-auto-tool-choice --tool-call-parser hermes``).

The 135M default model rarely calls a tool by itself, so the ``auto`` path is driven
deterministically: the request also carries ``structured_outputs`` with a regex that spells
out one Hermes tool call, so the model's output is exactly a call in the format the parser
reads, and the server's parsing, ids and streamed deltas are what is tested.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from tests.server.conftest import HTTP_TIMEOUT_S, launch_server
from tests.server.tool_call_deltas import add_up

# Room for every sequence of the concurrent schema run.
KV_BYTES = str(256 << 20)
USER = [{"role": "user", "content": "Reply with the JSON object asked for."}]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smol(default_model_folder, tmp_path_factory):
    with launch_server(default_model_folder, tmp_path_factory.mktemp("logs"),
                       "--kv-cache-memory-bytes", KV_BYTES, "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes") as server:
        assert server.client().models.list().data[0].id == MODEL
        yield server


def _string(max_length: int = 12) -> dict:
    return {"type": "string", "maxLength": max_length}


def _int() -> dict:
    """Bounded, as a small model may otherwise write digits until max_tokens."""
    return {"type": "integer", "minimum": -999, "maximum": 999}


def _object(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **extra}


SCHEMAS = [
    _object({"name": _string(), "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    _object({"ok": {"type": "boolean"}}),
    _object({"color": {"type": "string", "enum": ["red", "green", "blue"]}}),
    _object({"score": {"type": "number", "minimum": -1, "maximum": 1}}),
    _object({"tags": {"type": "array", "items": _string(8), "minItems": 2, "maxItems": 3}}),
    _object({"point": _object({"x": _int(), "y": _int()})}),
    _object({"user": _object({"name": _string(), "address": _object(
        {"city": _string(), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
    _object({"id": _int(), "note": _string()}, required=["id"]),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 1, "maxItems": 4},
    _object({"level": {"type": "integer", "enum": [1, 2, 3]},
             "mode": {"const": "fast"}}),
    _object({"value": {"anyOf": [_int(), {"type": "null"}]}}),
    _object({"items": {"type": "array", "minItems": 1, "maxItems": 2,
                       "items": _object({"sku": _string(6), "qty": {
                           "type": "integer", "minimum": 1, "maximum": 99}})}}),
    {"$defs": {"pet": _object({"kind": {"enum": ["cat", "dog"]}, "name": _string(8)})},
     **_object({"owner": _string(), "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"},
                                              "minItems": 1, "maxItems": 2}})},
    _object({"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": _int()}}}),
    _object({"percent": {"type": "integer", "minimum": 0, "maximum": 100},
             "label": _string(5)}),
    _object({"flags": _object({"a": {"type": "boolean"}, "b": {"type": "boolean"}},
                              required=["a"])}),
    _object({"temperature": {"type": "number", "exclusiveMinimum": 0,
                             "exclusiveMaximum": 10}}),
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    _object({"title": _string(20), "year": {"type": "integer", "minimum": 1900,
                                            "maximum": 2100}, "genres": {
        "type": "array", "items": {"enum": ["drama", "comedy"]}, "maxItems": 2}},
        required=["title", "year"]),
    {"$defs": {"node": _object({"v": _int()})},
     **_object({"root": {"$ref": "#/$defs/node"}, "kids": {
         "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}})},
]
assert len(SCHEMAS) == 20


def _schema_request(schema: dict, stream: bool) -> dict:
    return dict(model=MODEL, messages=USER, n=3, max_tokens=96, temperature=0.8, seed=5,
                stream=stream, response_format={"type": "json_schema", "json_schema": {
                    "name": "answer", "schema": schema, "strict": True}})


async def _texts(client, schema: dict, stream: bool) -> list[tuple[str, str]]:
    """(text, finish_reason) of each of the n choices."""
    kwargs = _schema_request(schema, stream)
    if not stream:
        response = await client.chat.completions.create(**kwargs)
        return [(c.message.content, c.finish_reason) for c in response.choices]
    texts, reasons = [""] * 3, [None] * 3
    async for chunk in await client.chat.completions.create(**kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    return list(zip(texts, reasons))


def test_twenty_schemas_streamed_and_not_at_n3(smol):
    async def run():
        client = smol.async_client()
        jobs = [_texts(client, s, stream) for s in SCHEMAS for stream in (False, True)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for i, choices in enumerate(results):
        schema = SCHEMAS[i // 2]
        assert len(choices) == 3
        for text, reason in choices:
            assert reason == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)


class Weather(BaseModel):
    city: str
    celsius: int
    sunny: bool


def test_parse_returns_a_pydantic_object(smol):
    completion = smol.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "The weather in Paris as JSON."}],
        response_format=Weather, max_tokens=80, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather)
    assert parsed == Weather.model_validate_json(completion.choices[0].message.content)


def test_json_object_regex_choice_and_grammar(smol):
    client = smol.client()
    chat = dict(model=MODEL, messages=USER, max_tokens=60, temperature=0)
    # A prompt the model answers with a short object: json_object bounds nothing, and USER's
    # answer loops on one string past any max_tokens (a truncated object would not parse).
    obj = client.chat.completions.create(
        **{**chat, "messages": [{"role": "user",
                                 "content": "Give a JSON object with a name and an age."}]},
        response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    date = r"\d{4}-\d{2}-\d{2}"
    for body in ({"structured_outputs": {"regex": date}}, {"guided_regex": date}):
        out = client.completions.create(model=MODEL, prompt="The date:", max_tokens=20,
                                        extra_body=body, temperature=0)
        assert re.fullmatch(date, out.choices[0].text), out.choices[0].text
    choices = ["Paris", "Lyon", "Nice, France"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        out = client.chat.completions.create(**{**chat, "temperature": 1.0}, extra_body=body,
                                             n=2, seed=3)
        assert all(c.message.content in choices for c in out.choices)
    grammar = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [1-9] [0-9]?'
    for body in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
        out = client.completions.create(model=MODEL, prompt="2+2=", max_tokens=20,
                                        extra_body=body, temperature=0.7, seed=1)
        text = out.choices[0].text
        assert re.fullmatch(r"[1-9][0-9]?([+-][1-9][0-9]?)*", text), text


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_bytes_of_split_characters_join_to_the_content(smol, stream):
    """Each emoji is several byte-level tokens whose texts are U+FFFD; their ``bytes`` are
    their own, so the content tokens' bytes join to the content's UTF-8."""
    emoji = "🚀✨🎉"
    response = smol.client().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=20, temperature=0, logprobs=True,
        top_logprobs=2, stream=stream, extra_body={"structured_outputs": {"choice": [emoji]}})
    chunks = response if stream else [response]
    content = [t for c in chunks for choice in c.choices if choice.logprobs
               for t in choice.logprobs.content]
    assert content[-1].token == "<|im_end|>"  # the end-of-sequence token has its logprob too
    assert "\ufffd" in [t.token for t in content]
    assert b"".join(bytes(t.bytes) for t in content[:-1]) == emoji.encode()
    for t in content:  # the sampled token among the top ones carries the same bytes
        assert all(top.bytes == t.bytes for top in t.top_logprobs if top.logprob == t.logprob)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": _object({"city": _string(16), "unit": {"enum": ["C", "F"]}})}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": _object({"tz": {"enum": ["UTC", "CET", "PST"]}})}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, tools=TOOLS) -> None:
    schema = next(t["function"]["parameters"] for t in tools
                  if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id.startswith("call_") and call.type == "function"


def test_required_and_named_tool_choice_give_valid_arguments(smol):
    client = smol.client()
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              tool_choice="required", max_tokens=80, n=3,
                                              temperature=0.9, seed=2)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call)
    single = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=80, temperature=0)
    assert len(single.choices[0].message.tool_calls) == 1
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                         max_tokens=40, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and out.choices[0].message.content is None
    _check_call(call)


def test_streamed_tool_calls_accumulate_as_the_sdk_expects(smol):
    client = smol.client()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        calls: dict[int, dict] = {}
        reason = None
        for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                    stream=True, tool_choice=choice,
                                                    max_tokens=80, temperature=0):
            delta = chunk.choices[0].delta
            for d in delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": d.function.name,
                                                   "arguments": ""})
                assert d.id is None or d.id == entry["id"]
                entry["arguments"] += d.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        assert reason == "tool_calls" and calls
        for entry in calls.values():
            assert entry["id"].startswith("call_")
            schema = next(t["function"]["parameters"] for t in TOOLS
                          if t["function"]["name"] == entry["name"])
            jsonschema.validate(json.loads(entry["arguments"]), schema)


# The model's whole output, forced: a sentence, then one Hermes tool call.
FORCED_CALL = (r'Let me check\. <tool_call>\{"name": "get_weather", "arguments": '
               r'\{"city": "Paris", "unit": "C"\}\}</tool_call>')


def test_auto_tool_choice_parses_hermes_calls(smol):
    client = smol.client()
    # A forced string is often spelled a character at a time: room for that.
    request = dict(messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=150,
                   temperature=0, extra_body={"structured_outputs": {"regex": FORCED_CALL}})
    message = client.chat.completions.create(model=MODEL, **request).choices[0]
    assert message.finish_reason == "tool_calls"
    assert message.message.content == "Let me check."
    (call,) = message.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris", "unit": "C"})
    chunks = list(client.chat.completions.create(model=MODEL, **request, stream=True))
    added = add_up([c.choices[0].delta.model_dump(exclude_none=True) for c in chunks],
                   [(call.function.name, call.function.arguments)])
    # The same content, whitespace and all: the stream had the space before the call too.
    assert "".join(added.contents) == message.message.content
    # The call came as it was written: its arguments in pieces that add up to the whole
    # response's, exactly (add_up checked every piece against them as it came).
    assert added.calls == [(call.function.name, call.function.arguments)]
    assert added.pieces[0] > 3, added
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Plain text stays content.
    free = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                          temperature=0)
    assert free.choices[0].message.content and not free.choices[0].message.tool_calls


def test_auto_tool_choice_streams_the_logprobs_a_whole_response_has(smol):
    """Streamed through the tool parser, the chunks' logprobs add up to the whole response's
    (a held-back token's come with the chunk that sends its text)."""
    client = smol.client()
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=150,
                   temperature=0, logprobs=True, top_logprobs=2,
                   extra_body={"structured_outputs": {"regex": FORCED_CALL}})
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls"
    chunks = [c.choices[0] for c in client.chat.completions.create(**request, stream=True)
              if c.choices]
    streamed = [t for c in chunks if c.logprobs for t in c.logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == \
        [(t.token, t.bytes) for t in whole.logprobs.content]
    for got, expected in zip(streamed, whole.logprobs.content, strict=True):
        assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)
        assert len(got.top_logprobs) == len(expected.top_logprobs) == 2
    # The content's tokens came with the content, before the call's.
    first = next(c for c in chunks if c.delta.content)
    assert first.logprobs and first.logprobs.content


def test_conversation_with_tool_results_continues(smol):
    client = smol.client()
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id,
                 "content": '{"temperature": 21, "sky": "clear"}'}]
    follow = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            max_tokens=16, temperature=0)
    assert follow.choices[0].message.content
    # The tool's result reached the prompt through the chat template.
    tokens = httpx.post(f"{smol.url}/tokenize", json={"messages": messages},
                        timeout=HTTP_TIMEOUT_S).json()
    assert tokens["count"] == follow.usage.prompt_tokens
    text = httpx.post(f"{smol.url}/detokenize", json={"tokens": tokens["tokens"]},
                      timeout=HTTP_TIMEOUT_S).json()["prompt"]
    assert '{"temperature": 21, "sky": "clear"}' in text


def test_tokenize_and_detokenize_match_the_tokenizer(smol, default_model_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_folder)
    prompt = "Structured output, tokenized: ünïcode too."
    got = httpx.post(f"{smol.url}/tokenize", json={"prompt": prompt, "return_token_strs": True},
                     timeout=HTTP_TIMEOUT_S).json()
    ids = tokenizer.encode(prompt)
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert got["max_model_len"] > 0
    back = httpx.post(f"{smol.url}/detokenize", json={"tokens": ids}, timeout=HTTP_TIMEOUT_S)
    assert back.json() == {"prompt": tokenizer.decode(ids)}
    bad = httpx.post(f"{smol.url}/detokenize", json={"tokens": [-1]}, timeout=HTTP_TIMEOUT_S)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


CHAT = {"messages": USER, "max_tokens": 4}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format", ["objectx"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", ["schema"]),
    ({"guided_json": '{"type": '}, "guided_json", ["json"]),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", ["regex"]),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs",
     ["missing"]),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     ["exactly one"]),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}], "tool_choice": "required"}, "tools", ["objectx"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", ["nope"]),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", ["response_format"]),
])
def test_invalid_structured_requests_are_400(smol, body, param, words):
    response = smol.post("/v1/chat/completions", json={**CHAT, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert all(w in error["message"] for w in words), error["message"]


def test_nothing_left_running(smol):
    """Every request above finished and returned its blocks."""
    smol.wait_for_metrics(lambda m: m.get("num_requests_running") == 0
                          and m.get("num_requests_waiting") == 0)
