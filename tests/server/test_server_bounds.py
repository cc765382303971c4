"""Numbers the engine cannot carry get a 400 naming their field, on a connection that goes on
serving: every integer field at 64 bits and past (the engine core's wire holds int64), and
temperatures that overflow float32. A top_k of 2**64 was a 500 that closed the connection and
left the request in the API server for good."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import raw_request, read_response

GOOD = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _int_fields(big: int) -> list[tuple[str, dict, str]]:
    """(path, body, param): one integer field of each request model set to ``big``."""
    completions = [
        ("top_k", {"top_k": big}), ("min_tokens", {"min_tokens": big, "max_tokens": None}),
        ("max_tokens", {"max_tokens": big}), ("n", {"n": big}),
        ("best_of", {"n": 1, "best_of": big}), ("logprobs", {"logprobs": big}),
        ("seed", {"seed": big}), ("stop_token_ids", {"stop_token_ids": [big]}),
        ("logit_bias", {"logit_bias": {str(big): 1}}), ("prompt", {"prompt": [1, big]}),
        ("prompt", {"prompt": [1, big], "echo": True}), ("prompt", {"prompt": [[1, 2], [big]]})]
    chat = [
        ("top_k", {"top_k": big}), ("min_tokens", {"min_tokens": big}),
        ("max_tokens", {"max_tokens": big}),
        ("max_completion_tokens", {"max_completion_tokens": big}), ("n", {"n": big}),
        ("top_logprobs", {"logprobs": True, "top_logprobs": big}), ("seed", {"seed": big}),
        ("stop_token_ids", {"stop_token_ids": [big]})]
    chat_body = {**CHAT, "max_tokens": None}  # min_tokens had no bound without max_tokens
    return ([("/v1/completions", {**GOOD, **f}, param) for param, f in completions]
            + [("/v1/chat/completions", {**chat_body, **f}, param) for param, f in chat]
            + [("/detokenize", {"tokens": [1, big]}, "tokens")])


@pytest.mark.parametrize(("path", "body", "param"),
                         [*_int_fields(2**64), *_int_fields(2**63), *_int_fields(-(2**64))])
def test_integer_past_64_bits_is_a_400_naming_its_field(server, path, body, param):
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {**GOOD, "temperature": 1e308}),
    ("/v1/completions", {**GOOD, "temperature": 3.5e38}),
    ("/v1/completions", {**GOOD, "temperature": 1e308, "guided_choice": ["yes", "no"]}),
    ("/v1/chat/completions", {**CHAT, "temperature": 1e308}),
    ("/v1/chat/completions", {**CHAT, "temperature": 1e308, "response_format":
                              {"type": "json_object"}}),
])
def test_temperature_beyond_float32_is_a_400(server, path, body):
    """It became inf in the sampler, then NaN: structured output answered 200 with empty text
    and finish_reason "error"."""
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "temperature"


def test_the_largest_temperature_still_answers(server):
    body = {**GOOD, "max_tokens": 16, "temperature": 3.4028234663852886e38,
            "guided_choice": ["yes", "no"]}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop", choice


def test_the_connection_serves_the_next_request(server):
    """The issue's repro, pipelined with a good request on one keep-alive connection."""
    bad = b'{"prompt": "Hi", "top_k": 18446744073709551616}'
    with server.connect() as sock, sock.makefile("rb") as stream:
        for _ in range(3):
            sock.sendall(raw_request("POST", "/v1/completions", bad)
                         + raw_request("POST", "/v1/completions", json.dumps(GOOD).encode()))
            refused = read_response(stream)
            assert refused is not None and refused.status == 400, refused
            assert json.loads(refused.body)["error"]["param"] == "top_k"
            served = read_response(stream)
            assert served is not None and served.status == 200, served
            assert json.loads(served.body)["usage"]["completion_tokens"] == 2
