"""Bad input gets an OpenAI error object with the right status, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import (
    HTTP_TIMEOUT_S,
    MAX_MODEL_LEN,
    raw_request,
    read_response,
)

GOOD = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (path, body, status, param); every body is GOOD or CHAT with one thing wrong.
BAD_REQUESTS = [
    ("/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "best_of": 1, "n": 2}, 400, "best_of"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**GOOD, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {**GOOD, "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "n": [1]}, 400, "n"),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, -2]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["hi", ""]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": {"text": "hi"}}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", [GOOD], 400, None),
    ("/v1/completions", {**GOOD, "n": 2000}, 400, "n"),
    ("/v1/completions", {**GOOD, "n": 1000}, 400, "n"),
    ("/v1/completions", {**GOOD, "n": 2, "best_of": 1000}, 400, "best_of"),
    ("/v1/completions", {**GOOD, "prompt": [[5]] * 1100}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {**GOOD, "stream": True, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": -1}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": MAX_MODEL_LEN}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 1000}, 400, "n"),
    ("/v1/completions", {**GOOD, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {**GOOD, "allowed_token_ids": [5, 10**6]}, 400, "allowed_token_ids"),
    ("/v1/completions", {**GOOD, "allowed_token_ids": [5] * 5000}, 400, "allowed_token_ids"),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": ["5"]}, 400, "allowed_token_ids"),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": [-1]}, 400, "allowed_token_ids"),
    ("/v1/completions", {**GOOD, "bad_words": "word"}, 400, "bad_words"),
    ("/v1/completions", {**GOOD, "bad_words": ["w"] * 65}, 400, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "bad_words": [" "]}, 400, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "bad_words": [7]}, 400, "bad_words"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
    # Strict types, as in OpenAI's schema: no strings, booleans or floats for integers.
    ("/v1/completions", {**GOOD, "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 4.0}, 400, "max_tokens"),
    ("/v1/completions", {**GOOD, "prompt": [1, 2, 3.0]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [[1, 2], [True]]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "temperature": "0.5"}, 400, "temperature"),
    ("/v1/completions", {**GOOD, "stream": "false"}, 400, "stream"),
    ("/v1/completions", {**GOOD, "echo": 1}, 400, "echo"),
    ("/v1/completions", {**GOOD, "seed": "7"}, 400, "seed"),
    ("/v1/completions", {**GOOD, "stop": 5}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "true"}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "n": "2"}, 400, "n"),
    # A repetition penalty whose division overflows float32 made NaN logprobs.
    ("/v1/completions", {**GOOD, "repetition_penalty": 1e-38, "logprobs": 1}, 400,
     "repetition_penalty"),
    ("/v1/completions", {**GOOD, "repetition_penalty": 1e38}, 400, "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 1e-38}, 400,
     "repetition_penalty"),
    # max_tokens 0 only scores the prompt, which needs the prompt echoed.
    ("/v1/completions", {**GOOD, "max_tokens": 0, "logprobs": 1}, 400, "max_tokens"),
    # Fields of OpenAI or vLLM that this server does not implement.
    *[("/v1/completions", {**GOOD, field: value}, 400, field) for field, value in [
        ("suffix", "x"), ("prompt_logprobs", 1), ("use_beam_search", True),
        ("temprature", 0.5)]],
    *[("/v1/chat/completions", {**CHAT, field: value}, 400, field) for field, value in [
        ("functions", [{"name": "f"}]), ("function_call", "auto"),
        ("chat_template", "{{ 1 }}"), ("echo", True), ("reasoning_effort", "low"),
        ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": ""})]],
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "hi", "tool_calls": []}]}, 400, "messages"),
    # vLLM's template fields: the last message continued, or a new turn opened, not both;
    # the template's variables, not the call's own arguments.
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT["messages"], "chat_template_kwargs": [1]}, 400,
     "chat_template_kwargs"),
    # Structured output and tools this server refuses (more in test_server_structured.py).
    ("/v1/completions", {**GOOD, "guided_regex": "a(b"}, 400, "guided_regex"),
    ("/v1/completions", {**GOOD, "guided_choice": ["a"], "guided_regex": "a"}, 400,
     "guided_choice"),
    # Started without --enable-auto-tool-choice: tools default to "auto", which it refuses.
    ("/v1/chat/completions", {**CHAT, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    # min_tokens past the room the prompt leaves in the context, with max_tokens unset: the
    # choice ran to the context's end and came back short of min_tokens.
    ("/v1/completions", {**GOOD, "prompt": [5] * 4000, "max_tokens": None, "min_tokens": 200},
     400, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 4000}],
                              "max_tokens": None, "min_tokens": 200}, 400, "min_tokens"),
    # truncate_prompt_tokens keeps the last k tokens (k >= 1), or -1: all that fit.
    *[(path, {**body, "truncate_prompt_tokens": value}, 400, "truncate_prompt_tokens")
      for path, body in [("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)]
      for value in (0, -2, "5", True, 1.5)],
    # A function without a name: "required" made a call named "".
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": ""}}],
                              "tool_choice": "required"}, 400, "tools"),
]


def _assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


def _assert_still_serving(server) -> None:
    response = server.post("/v1/completions", json=GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_request_gets_openai_error(server, path, body, status, param):
    error = _assert_error(server.post(path, json=body), status)
    assert error["param"] == param


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {**GOOD, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**GOOD, "logprobs": 21, "echo": True}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs")])
def test_more_logprobs_than_max_logprobs_is_a_400_naming_the_option(server, path, body,
                                                                    param):
    """The server runs with the default --max-logprobs, 20: 21 is refused, 20 served."""
    error = _assert_error(server.post(path, json=body), 400)
    assert error["param"] == param and "--max-logprobs" in error["message"], error
    response = server.post(path, json={**body, param: 20})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "hi \\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "\\ud83d"}]}], "max_tokens": 2}', "messages"),
])
def test_lone_surrogate_is_a_400_and_the_connection_stays_usable(server, path, body, param):
    """JSON may escape a lone surrogate, which no UTF-8 tokenizer can encode; the pipelined
    request behind it must still get its answer on the same connection."""
    good = json.dumps(GOOD).encode()
    with server.connect() as sock, sock.makefile("rb") as stream:
        sock.sendall(raw_request("POST", path, body)
                     + raw_request("POST", "/v1/completions", good))
        refused = read_response(stream)
        assert refused is not None and refused.status == 400, refused
        error = json.loads(refused.body)["error"]
        assert error["param"] == param and "surrogate" in error["message"]
        served = read_response(stream)
        assert served is not None and served.status == 200, served
        assert json.loads(served.body)["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("key", [" 5", "5 ", "+5", "-5", "٥", "1_0", "0x5", "5.0", ""])
def test_logit_bias_key_of_anything_but_digits_is_a_400_naming_it(server, key):
    """``int`` reads " 5", "+5", "1_0" and the Arabic-Indic "٥" as token ids; OpenAI's keys
    are decimal digits."""
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        response = server.post(path, json={**body, "logit_bias": {"7": 1, key: 1}})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "logit_bias")
        assert f"logit_bias key {key!r} is not a token id" in error["message"]


@pytest.mark.parametrize("stop", ["", [""], ["", ""], ["x", ""]])
def test_an_empty_stop_string_is_a_400_alone_or_in_a_list(server, stop):
    """``stop: ""`` was dropped as if absent while ``[""]`` was refused."""
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        response = server.post(path, json={**body, "stop": stop})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "stop")
        assert error["message"] == "stop strings must be non-empty"


def test_unsupported_field_is_named_in_the_message(server):
    error = _assert_error(server.post("/v1/chat/completions",
                                      json={**CHAT, "functions": [], "suffix": "x"}), 400)
    assert "functions" in error["message"] and "not supported" in error["message"]


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "x"}},
                                  {"type": "input_audio", "input_audio": {"data": ""}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_a_content_part_other_than_text_is_a_400_naming_its_type(server, part):
    """An image sent to this text-only server got pydantic's union report ("content.str:
    Input should be a valid string (and 3 more errors)"), which names neither the part nor
    what is wrong with it."""
    content = [{"type": "text", "text": "what is this?"}, part]
    error = _assert_error(server.post("/v1/chat/completions", json={
        **CHAT, "messages": [{"role": "user", "content": content}]}), 400)
    assert error["param"] == "messages"
    assert error["message"].startswith("messages.0.content: ")
    assert error["message"].endswith(f"content part 1 is of type {part['type']!r}; this server "
                                     "reads text parts only")


def test_unimplemented_openai_fields_sent_as_null_are_accepted(server):
    """The openai SDK sends ``"suffix": null`` for ``suffix=None``: null is these fields'
    default and asks for nothing, so only a value is refused (as vLLM does); null was a 400."""
    client = server.client()
    got = client.completions.create(model="model", prompt="hello", max_tokens=2, suffix=None)
    assert got.usage.completion_tokens == 2
    got = client.chat.completions.create(
        model="model", messages=CHAT["messages"], max_tokens=2, functions=None,
        function_call=None, audio=None, modalities=None, prediction=None,
        reasoning_effort=None, web_search_options=None, verbosity=None)
    assert got.usage.completion_tokens == 2


@pytest.mark.parametrize("parameters", [[{"type": "string"}], "object", {"type": "string"}])
def test_tool_parameters_other_than_an_object_schema_are_a_400_naming_the_tool(
        server, parameters):
    """A function's arguments are a JSON object; any other schema was accepted."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": parameters}}
    error = _assert_error(server.post("/v1/chat/completions", json={
        **CHAT, "tools": [tool], "tool_choice": "none"}), 400)
    assert error["param"] == "tools"
    assert "'lookup'" in error["message"] and "parameters" in error["message"]
    # Without parameters, or with an object's, the tool is fine.
    for function in ({"name": "lookup"}, {"name": "lookup", "parameters": {"type": "object"}}):
        response = server.post("/v1/chat/completions", json={
            **CHAT, "tools": [{"type": "function", "function": function}],
            "tool_choice": "none"})
        assert response.status_code == 200, response.text


def test_harmless_openai_fields_are_accepted(server):
    """Fields that change nothing in the output: who asks, and OpenAI's storage and routing
    hints. Accepted and ignored, as clients send them routinely."""
    harmless = {"user": "tester", "store": False, "metadata": {"team": "a"},
                "service_tier": "auto", "safety_identifier": "hash", "prompt_cache_key": "k"}
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        response = server.post(path, json={**body, **harmless})
        assert response.status_code == 200, response.text
    chat = {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "ann"}]}
    assert server.post("/v1/chat/completions", json=chat).status_code == 200


def test_fields_openai_allows_null_read_null_as_their_default(server):
    """OpenAI's schema makes stream, echo and chat's logprobs nullable, and clients that
    send every field send them as null."""
    for path, body in (("/v1/completions", {**GOOD, "stream": None, "echo": None}),
                       ("/v1/chat/completions", {**CHAT, "stream": None, "logprobs": None})):
        response = server.post(path, json=body)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/json"  # not a stream
        choice = response.json()["choices"][0]
        assert choice["logprobs"] is None
        assert not choice.get("text", "").startswith(GOOD["prompt"])  # not echoed


def test_every_bad_request_left_the_server_healthy(server):
    for path, body, status, param in BAD_REQUESTS:
        if isinstance(body, dict) and param not in ("stream", "stream_options"):
            assert server.post(path, json={**body, "stream": True}).status_code == status
    _assert_still_serving(server)
    values = server.wait_for_metrics(lambda m: m["kv_cache_blocks_used"] == 0)
    assert values["num_requests_running"] == 0


def test_too_long_prompt_names_both_lengths(server):
    prompt = list(range(10, 10 + MAX_MODEL_LEN + 5))
    error = _assert_error(server.post("/v1/completions", json={**GOOD, "prompt": prompt}), 400)
    assert str(MAX_MODEL_LEN + 5) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    assert error["code"] == "context_length_exceeded"
    prompt = list(range(10, 110))
    body = {**GOOD, "prompt": prompt, "max_tokens": MAX_MODEL_LEN - 50}
    error = _assert_error(server.post("/v1/completions", json=body), 400)
    assert "100" in error["message"] and str(MAX_MODEL_LEN) in error["message"]


def test_malformed_bodies_and_unknown_routes(server):
    headers = {"Content-Type": "application/json"}
    _assert_error(server.post("/v1/completions", content=b'{"prompt": "hi",', headers=headers),
                  400)
    _assert_error(server.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)
    _assert_error(server.post("/v1/completions", content=b"\xff\xfe", headers=headers), 400)
    for value in (b"NaN", b"-Infinity", b"Infinity"):  # Python's JSON parser accepts these
        body = b'{"prompt": "hi", "temperature": ' + value + b"}"
        error = _assert_error(server.post("/v1/completions", content=body, headers=headers), 400)
        assert error["param"] == "temperature"
    _assert_error(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    _assert_error(httpx.delete(f"{server.url}/v1/models"), 405)
    _assert_still_serving(server)


def test_oversized_body_is_413(server):
    huge = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    headers = {"Content-Type": "application/json"}
    error = _assert_error(server.post("/v1/completions", content=huge, headers=headers), 413)
    assert error["code"] == "request_too_large"

    def chunks():  # no Content-Length: the cap must hold while reading
        for i in range(0, len(huge), 1 << 20):
            yield huge[i:i + (1 << 20)]

    try:
        response = server.post("/v1/completions", content=chunks(), headers=headers)
        _assert_error(response, 413)
    except httpx.HTTPError:
        pass  # the server may close the connection before the upload ends: also a refusal
    _assert_still_serving(server)


def test_sdk_raises_bad_request_and_not_found(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="model", prompt="hi", temperature=-1)
    assert excinfo.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=CHAT["messages"])


def test_api_key_is_enforced(keyed_server):
    url = keyed_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-key"},
                    {"Authorization": "Bearer s3cret-key-and-more"}):
        response = httpx.post(f"{url}/v1/completions", json=GOOD, headers=headers,
                              timeout=HTTP_TIMEOUT_S)
        assert _assert_error(response, 401)["code"] == "invalid_api_key"
        _assert_error(httpx.get(f"{url}/v1/models", headers=headers), 401)
    # Malformed bodies are refused for the key before anything reads them.
    _assert_error(httpx.post(f"{url}/v1/completions", content=b"{", timeout=HTTP_TIMEOUT_S),
                  401)
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    got = keyed_server.client().completions.create(model="model", prompt="hi", max_tokens=2)
    assert got.usage.completion_tokens == 2


def test_a_streamed_error_event_has_every_field_of_an_error_object():
    """The event that ends a failed stream (a core that died, a grammar the engine refused) is
    the same object a non-streamed error is: param and code were left out when null."""
    from pagedserve.sampling_params import InvalidSamplingParam
    from pagedserve.server.errors import stream_error
    from pagedserve.server.protocol import sse

    for exc, expected in [
            (RuntimeError("the core exited"), {"message": "the core exited",
                                               "type": "server_error"}),
            (InvalidSamplingParam("structured_outputs", "no grammar"),
             {"type": "invalid_request_error", "param": "structured_outputs"})]:
        event = sse(stream_error(exc))
        assert event.startswith("data: ") and event.endswith("\n\n")
        error = json.loads(event.removeprefix("data: "))["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert expected.items() <= error.items()


def test_logprobs_that_json_cannot_carry_are_sent_as_the_minimum():
    """A NaN logprob (non-finite logits from a broken checkpoint) failed the whole response
    with a 500 when encoded; -inf was already sent as OpenAI's -9999. Both response builders,
    chat's and the legacy completions', through the JSON encoder."""
    import math

    from pagedserve.outputs import Logprob
    from pagedserve.server.protocol import MIN_LOGPROB, ChatLogprobs
    from pagedserve.server.serving_chat import _token_logprob
    from pagedserve.server.serving_completion import _LogprobsBuilder

    class Bytes:
        def of(self, token: int, text: str) -> list[int]:
            return list(text.encode())

    entry = {7: Logprob(math.nan, 1, "a"), 9: Logprob(-math.inf, 2, "b"),
             3: Logprob(-0.5, 3, "c")}
    chat = ChatLogprobs(content=[_token_logprob(7, entry, 3, Bytes())])
    sent = json.loads(chat.model_dump_json())["content"][0]
    assert sent["logprob"] == MIN_LOGPROB
    assert [top["logprob"] for top in sent["top_logprobs"]] == [MIN_LOGPROB, MIN_LOGPROB, -0.5]
    legacy = _LogprobsBuilder()
    legacy.add_entry(7, entry)
    sent = json.loads(legacy.logprobs.model_dump_json())
    assert sent["token_logprobs"] == [MIN_LOGPROB]
    assert sent["top_logprobs"] == [{"a": MIN_LOGPROB, "b": MIN_LOGPROB, "c": -0.5}]
