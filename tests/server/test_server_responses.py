"""``POST /v1/responses`` through the openai SDK: against the server on the tiny model, checked
against ``/v1/chat/completions`` on the same conversation (the Responses API runs as that chat
request), and against the scripted engine (``scripted_engine.py``) for what the tiny model
does not write by itself: auto tool calls and reasoning."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response

from pagedserve.server.protocol import ChatCompletionRequest, ResponsesRequest
from pagedserve.server.tool_parsers import tool_parser
from tests.server.conftest import LONG_TOKENS, raw_request
from tests.server.scripted_engine import ScriptedEngine, run_with_client, scripted_app

MODEL = "model"
INSTRUCTIONS = "be brief"
TURNS = [{"role": "user", "content": "hello world"},
         {"role": "assistant", "content": "the quick"},
         {"role": "user", "content": [{"type": "input_text", "text": "brown fox"}]}]
CHAT = [{"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the quick"},
        {"role": "user", "content": "brown fox"}]
# Bounded arguments, so that a greedy call ends well within its tokens.
PARAMETERS = {"type": "object", "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}}}
WEATHER = {"type": "function", "name": "get_weather", "parameters": PARAMETERS}
SCHEMA = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
PERSON = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather",
                                                 "parameters": PARAMETERS}}


def _chat(server, messages=CHAT, **kwargs):
    return server.client().chat.completions.create(model=MODEL, messages=messages,
                                                   temperature=0, **kwargs)


def _respond(server, **kwargs):
    kwargs.setdefault("input", TURNS)
    return server.client().responses.create(model=MODEL, temperature=0, **kwargs)


def _events(server, **kwargs) -> list:
    return list(_respond(server, stream=True, **kwargs))


def test_greedy_text_equals_chat_with_instructions_as_the_system_message(server):
    chat = _chat(server, max_tokens=12)
    got = _respond(server, instructions=INSTRUCTIONS, max_output_tokens=12)
    assert got.output_text == chat.choices[0].message.content and got.output_text
    assert got.id.startswith("resp_") and got.object == "response"
    cut = chat.choices[0].finish_reason == "length"
    assert got.status == ("incomplete" if cut else "completed") and got.store is False
    (message,) = got.output
    assert (message.type, message.role, message.content[0].annotations) == (
        "message", "assistant", [])
    usage = got.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (got.instructions, got.max_output_tokens, got.temperature, got.tool_choice) == (
        INSTRUCTIONS, 12, 0.0, "auto")


def test_the_response_validates_as_the_sdk_model(server):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "metadata": {"k": "v"},
            "user": "u", "store": True, "reasoning": {"effort": "low"}}
    raw = server.post("/v1/responses", json=body)
    assert raw.status_code == 200, raw.text
    data = raw.json()
    data["usage"]["input_tokens_details"].setdefault("cache_write_tokens", 0)  # newer SDK's
    got = Response.model_validate(data)
    assert (got.metadata, got.user, got.reasoning.effort) == ({"k": "v"}, "u", "low")
    assert data["store"] is False and data["text"] == {"format": {"type": "text"}}


def test_streamed_events_are_in_order_and_add_up_to_the_response(server):
    whole = _respond(server, instructions=INSTRUCTIONS, max_output_tokens=16)
    events = _events(server, instructions=INSTRUCTIONS, max_output_tokens=16)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *[d.type for d in deltas], "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        f"response.{whole.status}"]
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text == events[-4].text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and events[-2].item.id == item_id
    final = events[-1].response
    assert final.output_text == text and final.usage == whole.usage
    assert events[0].response.status == "in_progress" and events[0].response.output == []


def test_the_sdk_stream_helper_gives_the_whole_response(server):
    """The helper's final response needs ``response.completed``: a grammar ends the answer."""
    text = {"format": PERSON}
    whole = _respond(server, max_output_tokens=60, text=text)
    with server.client().responses.stream(model=MODEL, input=TURNS, temperature=0,
                                          max_output_tokens=60, text=text) as stream:
        joined = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert whole.status == "completed"
    assert joined == final.output_text == whole.output_text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_max_output_tokens_cut_is_incomplete(server, stream):
    chat = _chat(server, max_tokens=3)
    assert chat.choices[0].finish_reason == "length"  # the greedy answer runs past 3 tokens
    got = _events(server, max_output_tokens=3, instructions=INSTRUCTIONS)[-1].response \
        if stream else _respond(server, max_output_tokens=3, instructions=INSTRUCTIONS)
    assert got.status == "incomplete"
    assert got.incomplete_details.reason == "max_output_tokens"
    assert got.output_text == chat.choices[0].message.content and got.usage.output_tokens == 3
    if stream:
        assert _events(server, max_output_tokens=3)[-1].type == "response.incomplete"


def test_named_function_tool_is_a_function_call_item_as_chat_calls_it(server):
    named = {"type": "function", "name": "get_weather"}
    chat = _chat(server, tools=[CHAT_WEATHER], max_tokens=80,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    expected = chat.choices[0].message.tool_calls[0].function.arguments
    got = _respond(server, tools=[WEATHER], tool_choice=named, max_output_tokens=80,
                   instructions=INSTRUCTIONS)
    (call,) = got.output
    assert (call.type, call.name, call.arguments) == ("function_call", "get_weather", expected)
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), PARAMETERS)
    events = _events(server, tools=[WEATHER], tool_choice=named, max_output_tokens=80,
                     instructions=INSTRUCTIONS)
    added = next(e for e in events if e.type == "response.output_item.added")
    assert (added.item.type, added.item.name, added.item.arguments) == (
        "function_call", "get_weather", "")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == expected
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == expected and done.item_id == added.item.id
    assert not any("output_text" in e.type for e in events)


def test_function_call_and_its_output_render_as_chat_renders_them(chat_model):
    """The earlier turn's call and result become the assistant's tool call and the tool
    message, in a template that writes both."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                "{% for c in m.get('tool_calls') or [] %}[{{ c['id'] }} {{ c['function']['name'] }}"
                " {{ c['function']['arguments'] | tojson }}]{% endfor %}"
                "{{ m.get('tool_call_id', '') }}\n{% endfor %}<|assistant|>")
    responses = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"}],
        "instructions": "be brief"}).to_chat()
    chat = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]})
    # As the server renders a conversation: the template's text, then its token ids.
    ids = [tokenizer.encode(tokenizer.apply_chat_template(
               [m.for_template() for m in r.messages], chat_template=template, tokenize=False),
               add_special_tokens=False) for r in (responses, chat)]
    assert ids[0] == ids[1]
    assert "[c2 get_weather" in tokenizer.decode(ids[0])


def test_function_call_turns_answer_as_the_chat_equivalent(server):
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = _chat(server, messages=[{"role": "user", "content": "weather?"},
                                   {"role": "assistant", "content": None, "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                 max_tokens=8)
    got = _respond(server, max_output_tokens=8, input=[
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    assert got.output_text == chat.choices[0].message.content
    assert got.usage.input_tokens == chat.usage.prompt_tokens


def test_json_schema_format_is_enforced_as_chat_response_format(server):
    schema = PERSON["schema"]
    got = _respond(server, text={"format": PERSON}, max_output_tokens=60)
    jsonschema.validate(json.loads(got.output_text), schema)
    chat = _chat(server, messages=[*CHAT[1:3], {"role": "user", "content": "brown fox"}],
                 max_tokens=60, response_format={"type": "json_schema", "json_schema": {
                     "name": "person", "schema": schema, "strict": True}})
    assert got.output_text == chat.choices[0].message.content
    assert got.text.format.type == "json_schema" and got.text.format.name == "person"
    json.loads(_respond(server, text={"format": {"type": "json_object"}},
                        max_output_tokens=60).output_text)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "'input_image'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'item_reference'"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "--enable-responses-store"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
     "tool_choice", "'other'"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"background": True}, "background", "--enable-responses-store"),
    ({"max_output_tokens": 1 << 20}, "max_output_tokens", "max_output_tokens"),
    ({"input": []}, "input", "no message"),
    ({"frequency": 1}, "frequency", "not supported"),
])
def test_unsupported_requests_are_openai_400s_and_the_server_keeps_serving(server, body, param,
                                                                           words):
    got = server.post("/v1/responses", json={"model": MODEL, "input": "hi", **body})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert _respond(server, input="hi", max_output_tokens=2).status in ("completed",
                                                                        "incomplete")


def test_sdk_raises_bad_request(server):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        _respond(server, previous_response_id="resp_1")


def test_nothing_is_stored_without_the_flag(server):
    got = _respond(server, input="hi", max_output_tokens=2)
    assert got.store is False
    with pytest.raises(openai.NotFoundError):
        server.client().responses.retrieve(got.id)
    with pytest.raises(openai.NotFoundError):
        server.client().responses.delete(got.id)
    with pytest.raises(openai.NotFoundError):
        server.client().responses.cancel(got.id)
    with pytest.raises(openai.NotFoundError):
        server.client().responses.input_items.list(got.id)


def test_a_client_that_hangs_up_has_its_response_aborted(server):
    # Greedy, so that the request runs as long as the one seen below (Responses takes no
    # ignore_eos): one that met its end-of-sequence before a poll saw it run would never show.
    assert _respond(server, input="hi", max_output_tokens=64).status == "incomplete"
    before = server.metrics()
    body = {"model": MODEL, "input": "hi", "max_output_tokens": LONG_TOKENS, "temperature": 0}
    for stream in (False, True):
        with server.connect() as sock:
            sock.sendall(raw_request("POST", "/v1/responses",
                                     json.dumps({**body, "stream": stream}).encode()))
            server.wait_for_metrics(lambda m: m["num_requests_running"] >= 1)
    aborted = before.get("request_finished_total{abort}", 0) + 2
    server.wait_for_metrics(lambda m: m.get("request_finished_total{abort}", 0) >= aborted
                            and m["kv_cache_blocks_used"] == 0
                            and m["num_requests_running"] == 0)


# ---- the scripted engine: auto tool calls and reasoning ----------------------------------
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "The user wants Paris.\n</think>"


def _scripted(pieces: list[str], work, finish_reason: str = "stop"):
    engine = ScriptedEngine()
    engine.script(pieces, finish_reason)
    return run_with_client(scripted_app(engine, tool_parser=tool_parser("hermes")), work)


async def _scripted_both(client, **kwargs):
    whole = await client.responses.create(model="r1", input="hi", tools=[WEATHER], **kwargs)
    stream = await client.responses.create(model="r1", input="hi", tools=[WEATHER],
                                           stream=True, **kwargs)
    return whole, [e async for e in stream]


@pytest.mark.parametrize("pieces", [[THOUGHT + "Sure. " + CALL],
                                    list(THOUGHT + "Sure. " + CALL)], ids=["whole", "by-char"])
def test_reasoning_text_and_auto_call_are_items_in_order(pieces):
    whole, events = _scripted(pieces, _scripted_both)
    assert [i.type for i in whole.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = whole.output
    assert reasoning.content[0].text == "The user wants Paris.\n" and reasoning.summary == []
    assert message.content[0].text == "Sure."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert whole.usage.output_tokens_details.reasoning_tokens == \
        (1 if len(pieces) == 1 else len(THOUGHT))
    joined = {kind: "".join(e.delta for e in events if e.type == kind) for kind in (
        "response.reasoning_text.delta", "response.output_text.delta",
        "response.function_call_arguments.delta")}
    assert joined == {"response.reasoning_text.delta": "The user wants Paris.\n",
                      "response.output_text.delta": "Sure.",
                      "response.function_call_arguments.delta": call.arguments}
    final = events[-1].response
    assert [i.model_dump(exclude={"id", "call_id"}) for i in final.output] == \
        [i.model_dump(exclude={"id", "call_id"}) for i in whole.output]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call"]
    assert final.usage == whole.usage


@pytest.mark.parametrize("by_char", [False, True], ids=["whole", "by-char"])
@pytest.mark.parametrize("parser", ["granite", "mistral"])
def test_auto_calls_stream_their_arguments_and_text_after_them_is_a_message(parser, by_char):
    """A call's arguments come in deltas as they are written; text after the calls is a
    message item after them, whole and streamed."""
    marker = {"granite": "<tool_call>", "mistral": "[TOOL_CALLS]"}[parser]
    text = (f'Checking.{marker}[{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}, '
            '{"name": "get_weather", "arguments": {"city": "Lyon"}}] Back soon.')
    engine = ScriptedEngine()
    engine.script(list(text) if by_char else [text])
    whole, events = run_with_client(
        scripted_app(engine, reasoning=None, tool_parser=tool_parser(parser)), _scripted_both)
    assert [i.type for i in whole.output] == ["message", "function_call", "function_call",
                                              "message"]
    assert [i.arguments for i in whole.output[1:3]] == ['{"city": "Paris"}', '{"city": "Lyon"}']
    assert (whole.output[0].content[0].text, whole.output[3].content[0].text) == (
        "Checking.", " Back soon.")
    final = events[-1].response
    assert [i.model_dump(exclude={"id", "call_id"}) for i in final.output] == \
        [i.model_dump(exclude={"id", "call_id"}) for i in whole.output]
    deltas = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            deltas.setdefault(e.output_index, []).append(e.delta)
    assert {i: "".join(d) for i, d in deltas.items()} == {1: '{"city": "Paris"}',
                                                          2: '{"city": "Lyon"}'}
    assert min(map(len, deltas.values())) > (5 if by_char else 0)


def test_reasoning_tokens_count_in_chat_usage_too():
    async def work(client):
        return await client.chat.completions.create(
            model="r1", messages=[{"role": "user", "content": "hi"}])
    chat = _scripted(list(THOUGHT + "Yes."), work)
    assert chat.usage.completion_tokens_details.reasoning_tokens == len(THOUGHT)
    assert chat.usage.completion_tokens == len(THOUGHT + "Yes.")


def test_output_cut_inside_the_reasoning_is_incomplete_and_all_reasoning():
    async def work(client):
        return await client.responses.create(model="r1", input="hi")
    got = _scripted(list("Still thinking"), work, finish_reason="length")
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    (reasoning,) = got.output
    assert reasoning.status == "incomplete" and reasoning.content[0].text == "Still thinking"
    assert got.usage.output_tokens_details.reasoning_tokens == len("Still thinking")


@pytest.mark.parametrize("by_char", [False, True], ids=["whole", "by-char"])
@pytest.mark.parametrize(("reasoning", "text", "thought", "answer"), [
    ("granite", "Here is my thought process:\nParis.\nHere is my response:\nSunny.",
     "\nParis.\n", "\nSunny."),
    ("mistral", "[THINK]Paris.[/THINK]Sunny.", "Paris.", "Sunny.")])
def test_granite_and_magistral_reasoning_are_reasoning_items(reasoning, text, thought, answer,
                                                             by_char):
    engine = ScriptedEngine()
    engine.script(list(text) if by_char else [text])

    async def work(client):
        whole = await client.responses.create(model="r1", input="hi")
        stream = await client.responses.create(model="r1", input="hi", stream=True)
        return whole, [e async for e in stream]
    whole, events = run_with_client(scripted_app(engine, reasoning=reasoning), work)
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == thought
    assert whole.output_text == answer
    assert whole.usage.output_tokens_details.reasoning_tokens == \
        (len(text) - len(answer) if by_char else 1)
    joined = {kind: "".join(e.delta for e in events if e.type == kind) for kind in (
        "response.reasoning_text.delta", "response.output_text.delta")}
    assert joined == {"response.reasoning_text.delta": thought,
                      "response.output_text.delta": answer}


def test_an_error_mid_stream_is_an_error_event():
    """A grammar the engine refuses once it runs fails the stream after its 200 went out."""
    from pagedserve.sampling_params import InvalidSamplingParam

    engine = ScriptedEngine()
    engine.script(["x"])

    def refused(requests):
        raise InvalidSamplingParam("structured_outputs", "grammar did not compile")

    class _Refusing:
        def __init__(self, request) -> None:
            self.finished = False

        async def __aiter__(self):
            refused(None)
            yield

        def close(self) -> None:
            self.finished = True

    engine.add_requests = lambda requests: [_Refusing(r) for r in requests]

    async def work(client):
        stream = await client.responses.create(model="r1", input="hi", stream=True,
                                               text={"format": {"type": "json_object"}})
        return [e async for e in stream]
    events = run_with_client(scripted_app(engine, reasoning=None), work)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1].message == "grammar did not compile" and events[-1].param == "text"
