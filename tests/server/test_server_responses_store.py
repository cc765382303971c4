"""Stored responses (``--enable-responses-store``) through the openai SDK, on the tiny model:
``previous_response_id`` runs the chat request of the whole conversation, checked against
``/v1/chat/completions`` on the same explicit messages; responses are read and deleted by id,
and the oldest created is dropped past ``--responses-store-max``. Without the flag
(``test_server_responses.py``), nothing is kept and ``previous_response_id`` is a 400."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.conftest import HTTP_TIMEOUT_S, Server, launch_server

pytestmark = pytest.mark.slow

MODEL = "model"
MAX_STORED = 3


@pytest.fixture(scope="module")
def store_server(chat_model, tmp_path_factory) -> Iterator[Server]:
    with launch_server(chat_model, tmp_path_factory.mktemp("responses-store"),
                       "--enable-responses-store", "--responses-store-max",
                       str(MAX_STORED)) as server:
        yield server


def _respond(server: Server, **kwargs):
    kwargs.setdefault("max_output_tokens", 6)
    return server.client().responses.create(model=MODEL, temperature=0, **kwargs)


def test_a_second_turn_runs_the_whole_conversation_as_chat_does(store_server):
    """Turn 2's prompt is the template of [turn-1 input, turn-1 output, turn-2 input]: the
    same prompt tokens as chat's and, greedy, the same answer. Turn 1's instructions are not
    carried over."""
    first = _respond(store_server, instructions="be brief", input="hello world")
    second = _respond(store_server, input="brown fox", previous_response_id=first.id)
    assert first.output_text and second.previous_response_id == first.id and second.store
    chat = store_server.client().chat.completions.create(
        model=MODEL, temperature=0, max_tokens=6, messages=[
            {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "brown fox"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    tokens = store_server.post("/tokenize", json={"model": MODEL, "messages": [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "brown fox"}], "add_generation_prompt": True}).json()
    assert tokens["count"] == second.usage.input_tokens


def test_a_stored_response_reads_back_as_created_until_deleted(store_server):
    client = store_server.client()
    created = _respond(store_server, input="hello world")
    assert client.responses.retrieve(created.id) == created
    *_, last = _respond(store_server, input="hi", stream=True)  # completed or incomplete
    streamed = last.response
    assert client.responses.retrieve(streamed.id) == streamed
    deleted = httpx.delete(f"{store_server.url}/v1/responses/{created.id}",
                           timeout=HTTP_TIMEOUT_S)
    assert deleted.json() == {"id": created.id, "object": "response.deleted", "deleted": True}
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            call(created.id)
    with pytest.raises(openai.NotFoundError) as caught:
        _respond(store_server, input="hi", previous_response_id=created.id)
    assert caught.value.body["param"] == "previous_response_id"


def test_an_unknown_previous_response_is_a_404_and_the_server_keeps_serving(store_server):
    got = store_server.post("/v1/responses", json={
        "model": MODEL, "input": "hi", "previous_response_id": "resp_unknown"})
    assert got.status_code == 404, got.text
    error = got.json()["error"]
    assert (error["param"], error["type"]) == ("previous_response_id", "invalid_request_error")
    assert "resp_unknown" in error["message"]
    assert _respond(store_server, input="hi").status in ("completed", "incomplete")


def test_store_false_is_not_kept(store_server):
    got = _respond(store_server, input="hi", store=False)
    assert got.store is False
    with pytest.raises(openai.NotFoundError):
        store_server.client().responses.retrieve(got.id)


def test_the_oldest_created_is_dropped_past_the_bound(store_server):
    ids = [_respond(store_server, input="hi", max_output_tokens=1).id
           for _ in range(MAX_STORED + 1)]
    store_server.client().responses.retrieve(ids[1])  # reading does not keep one longer
    _respond(store_server, input="hi", max_output_tokens=1)
    client = store_server.client()
    for gone in ids[:2]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
    assert [client.responses.retrieve(i).id for i in ids[2:]] == ids[2:]

