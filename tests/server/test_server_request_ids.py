"""``--enable-request-id-headers`` (vLLM's): ``X-Request-Id`` echoed on every response, the
client's own naming its completion; off by default."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest

from tests.server.conftest import HTTP_TIMEOUT_S, Server, launch_server

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served(chat_model, tmp_path_factory) -> Iterator[Server]:
    with launch_server(chat_model, tmp_path_factory.mktemp("request-ids"),
                       "--enable-request-id-headers") as s:
        yield s


def test_the_clients_id_is_echoed_and_names_the_completion(served):
    client = served.client()
    headers = {"X-Request-Id": "client-id-7"}
    raw = client.completions.with_raw_response.create(
        model="model", prompt="hi", max_tokens=2, extra_headers=headers)
    assert raw.headers["x-request-id"] == "client-id-7"
    assert raw.parse().id == "cmpl-client-id-7"
    with client.chat.completions.with_streaming_response.create(
            model="model", messages=CHAT, max_tokens=2, stream=True,
            extra_headers=headers) as stream:
        assert stream.headers["x-request-id"] == "client-id-7"
        assert {chunk.id for chunk in stream.parse()} == {"chatcmpl-client-id-7"}


def test_without_the_clients_id_the_servers_is_echoed(served):
    raw = served.client().chat.completions.with_raw_response.create(
        model="model", messages=CHAT, max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id
    assert raw.parse().id.startswith("chatcmpl-")
    models = httpx.get(f"{served.url}/v1/models", timeout=HTTP_TIMEOUT_S)
    assert models.status_code == 200 and models.headers["x-request-id"]
    refused = served.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1},
                          headers={"X-Request-Id": "refused-1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "refused-1"


def test_requests_in_flight_with_the_same_id_both_run(served):
    """Streams answer once their requests are in the engine, which is held still meanwhile,
    so that both are in flight at once under the one id."""
    client = served.client()
    with ExitStack() as streams:
        with served.core_paused():
            opened = [streams.enter_context(client.completions.with_streaming_response.create(
                model="model", prompt="hi", max_tokens=3, stream=True,
                extra_headers={"X-Request-Id": "twice"})) for _ in range(2)]
        for stream in opened:
            assert stream.headers["x-request-id"] == "twice"
            chunks = list(stream.parse())
            assert {c.id for c in chunks} == {"cmpl-twice"} and chunks[-1].choices


@pytest.mark.parametrize("value", ["x" * 129, "tab\there"])
def test_a_malformed_id_is_a_400(served, value):
    response = served.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                           headers={"X-Request-Id": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request_id" and "X-Request-Id" in error["message"]
    made = response.headers["x-request-id"]  # the refusal carries the server's own id
    assert made != value and re.fullmatch(r"[0-9a-f]{32}", made)


def test_off_by_default(server):
    client = server.client()
    raw = client.completions.with_raw_response.create(
        model="model", prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "ignored"})
    assert "x-request-id" not in raw.headers and raw.parse().id != "cmpl-ignored"
    with pytest.raises(openai.NotFoundError):  # the header is not even read
        client.models.retrieve("absent", extra_headers={"X-Request-Id": "x" * 500})
