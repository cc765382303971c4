"""vLLM's ``priority`` request field: served under ``--scheduling-policy priority``, refused with
a 400 naming the field and the flag under fcfs (the default), by completions, chat and the
Responses API alike."""

from __future__ import annotations

import openai
import pytest

from pagedserve import SamplingParams

MESSAGES = [{"role": "user", "content": "hello there"}]


def _refusal(server, path: str, body: dict) -> dict:
    got = server.post(path, json={"model": "model", **body})
    assert got.status_code == 400, got.text
    return got.json()["error"]


def test_fcfs_refuses_a_priority_and_keeps_serving(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="model", prompt="hi", max_tokens=2,
                                  extra_body={"priority": -1})
    assert refused.value.body["param"] == "priority"
    assert "--scheduling-policy priority" in refused.value.body["message"]
    for path, body in [("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 2})]:
        error = _refusal(server, path, {**body, "priority": 3})
        assert error["param"] == "priority" and error["type"] == "invalid_request_error"
        assert "--scheduling-policy priority" in error["message"]
    # 0, the default, is every request's priority under fcfs.
    got = client.completions.create(model="model", prompt="hi", max_tokens=2, temperature=0,
                                    extra_body={"priority": 0})
    assert got.choices[0].finish_reason in ("length", "stop")


def test_a_priority_that_is_not_an_integer_is_a_400(server):
    for value in ["high", 1.5, True]:
        error = _refusal(server, "/v1/completions",
                         {"prompt": "hi", "max_tokens": 2, "priority": value})
        assert error["param"] == "priority"


def test_priority_requests_are_served_as_without_one(priority_server, offline):
    client = priority_server.client()
    expected = offline.generate(["Once upon"], SamplingParams(max_tokens=8, temperature=0.0),
                                use_tqdm=False)[0].outputs[0].text
    for priority in (-5, 0, 7):
        got = client.completions.create(model="model", prompt="Once upon", max_tokens=8,
                                        temperature=0, extra_body={"priority": priority})
        assert got.choices[0].text == expected
    chat = client.chat.completions.create(model="model", messages=MESSAGES, max_tokens=4,
                                          extra_body={"priority": -1})
    assert chat.choices[0].message.role == "assistant"
    got = priority_server.post("/v1/responses", json={
        "model": "model", "input": "hi", "max_output_tokens": 4, "priority": 2})
    assert got.status_code == 200, got.text
    # Out of the 64-bit range the core process takes: refused, and the server goes on.
    error = _refusal(priority_server, "/v1/completions",
                     {"prompt": "hi", "max_tokens": 2, "priority": 2**63})
    assert error["param"] == "priority"
    assert client.completions.create(model="model", prompt="hi", max_tokens=2,
                                     extra_body={"priority": 1}).choices
