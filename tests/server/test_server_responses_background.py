"""Background responses (``background: true``), their cancel and the input items, through the
openai SDK on the tiny model, with the store on through vLLM's variable: a background request
is answered queued and runs to the foreground request's greedy answer; cancel, delete, the
store's bound and shutdown stop one that runs and free its KV blocks; a background stream can
be left and read again from any event. A failure, which the tiny model does not make, comes
from the scripted engine (``scripted_engine.py``)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from pagedserve.engine.core_client import EngineStepError
from tests.server.conftest import HTTP_TIMEOUT_S, LONG_TOKENS, Server, launch_server
from tests.server.scripted_engine import (
    ScriptedEngine,
    ScriptedStream,
    run_with_client,
    scripted_app,
)

pytestmark = pytest.mark.slow

MODEL = "model"
MAX_STORED = 8
RUNNING = ("queued", "in_progress")
DEADLINE_S = 60.0
STORE_ON = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}


@pytest.fixture(scope="module")
def bg_server(chat_model, tmp_path_factory) -> Iterator[Server]:
    with launch_server(chat_model, tmp_path_factory.mktemp("responses-bg"),
                       "--responses-store-max", str(MAX_STORED), env=STORE_ON) as server:
        yield server


def _respond(server: Server, **kwargs):
    kwargs.setdefault("max_output_tokens", 12)
    kwargs.setdefault("input", "hello world")
    return server.client().responses.create(model=MODEL, temperature=0, **kwargs)


def _poll(server: Server, response_id: str, done: Callable) -> openai.types.responses.Response:
    """Read the response until ``done(response)``; fail with the last one at the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not done(got := server.client().responses.retrieve(response_id)):
        if time.monotonic() > deadline:
            pytest.fail(f"response never reached the expected state: {got}")
        time.sleep(0.05)
    return got


def _finished(server: Server, response_id: str) -> openai.types.responses.Response:
    return _poll(server, response_id, lambda r: r.status not in RUNNING)


def _running_long(server: Server) -> tuple[str, dict[str, float]]:
    """A background response that runs for thousands of steps, seen running; its id and the
    metrics from before it."""
    before = server.metrics()
    created = _respond(server, input="hi", max_output_tokens=LONG_TOKENS, background=True)
    server.wait_for_metrics(lambda m: m["num_requests_running"] >= 1)
    return created.id, before


def _wait_aborted(server: Server, before: dict[str, float]) -> None:
    """One more request was aborted since ``before``, and every KV block is back."""
    aborted = before.get("request_finished_total{abort}", 0) + 1
    server.wait_for_metrics(lambda m: m.get("request_finished_total{abort}", 0) >= aborted
                            and m["kv_cache_blocks_used"] == 0
                            and m["num_requests_running"] == 0)


def _error(got: httpx.Response, status: int, param: str, words: str) -> None:
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error"), error
    assert words in error["message"], error


def test_a_background_response_is_queued_then_runs_to_the_foreground_answer(bg_server):
    foreground = _respond(bg_server)
    assert foreground.output_text
    with bg_server.core_paused():  # no step runs: it cannot finish before it is seen running
        queued = _respond(bg_server, background=True)
        assert (queued.status, queued.background, queued.store, queued.output) == (
            "queued", True, True, [])
        running = _poll(bg_server, queued.id, lambda r: r.status != "queued")
        assert running.status == "in_progress" and running.output == []
    done = _finished(bg_server, queued.id)
    assert (done.status, done.output_text) == (foreground.status, foreground.output_text)
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert (done.id, done.background, done.error) == (queued.id, True, None)
    assert bg_server.client().responses.retrieve(done.id) == done


def test_a_background_stream_can_be_left_and_read_again_from_any_event(bg_server):
    foreground = _respond(bg_server)
    stream = _respond(bg_server, background=True, stream=True)
    first = next(iter(stream))
    stream.close()  # the response runs on without its reader
    assert first.type == "response.created" and first.response.background
    done = _finished(bg_server, first.response.id)
    assert done.output_text == foreground.output_text
    client = bg_server.client()
    events = list(client.responses.retrieve(done.id, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == f"response.{done.status}" and events[-1].response == done
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == foreground.output_text
    tail = list(client.responses.retrieve(done.id, stream=True, starting_after=2))
    assert tail == events[3:]


def test_cancel_stops_a_running_response_and_frees_its_blocks(bg_server):
    response_id, before = _running_long(bg_server)
    client = bg_server.client()
    with bg_server.core_paused():  # it cannot end by itself before the cancel
        cancelled = client.responses.cancel(response_id)
    assert (cancelled.id, cancelled.status, cancelled.background) == (
        response_id, "cancelled", True)
    _wait_aborted(bg_server, before)
    assert client.responses.retrieve(response_id).status == "cancelled"
    assert client.responses.cancel(response_id).status == "cancelled"  # again: idempotent


def test_deleting_a_running_response_stops_it_first(bg_server):
    response_id, before = _running_long(bg_server)
    with bg_server.core_paused():
        deleted = httpx.delete(f"{bg_server.url}/v1/responses/{response_id}",
                               timeout=HTTP_TIMEOUT_S)
    assert deleted.json() == {"id": response_id, "object": "response.deleted", "deleted": True}
    _wait_aborted(bg_server, before)
    client = bg_server.client()
    for call in (client.responses.retrieve, client.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(response_id)


def test_a_running_response_the_store_drops_is_stopped(bg_server):
    response_id, before = _running_long(bg_server)
    for _ in range(MAX_STORED):
        _respond(bg_server, input="hi", max_output_tokens=1)
    _wait_aborted(bg_server, before)
    with pytest.raises(openai.NotFoundError):
        bg_server.client().responses.retrieve(response_id)


def test_bad_background_cancel_and_input_items_requests_are_openai_errors(bg_server):
    foreground = _respond(bg_server, max_output_tokens=2)
    finished = _finished(bg_server, _respond(bg_server, max_output_tokens=2,
                                             background=True).id)
    path, url = "/v1/responses", f"{bg_server.url}/v1/responses"
    _error(bg_server.post(f"{path}/{foreground.id}/cancel"), 400, "response_id", "synchronous")
    _error(bg_server.post(f"{path}/{finished.id}/cancel"), 400, "response_id",
           f"already {finished.status}")
    _error(bg_server.post(f"{path}/resp_unknown/cancel"), 404, "response_id", "resp_unknown")
    _error(bg_server.post(path, json={"model": MODEL, "input": "hi", "background": True,
                                     "store": False}), 400, "background", "store")
    _error(httpx.get(f"{url}/{foreground.id}?stream=true", timeout=HTTP_TIMEOUT_S), 400,
           "stream", "background")
    _error(httpx.get(f"{url}/resp_unknown/input_items", timeout=HTTP_TIMEOUT_S), 404,
           "response_id", "resp_unknown")
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"),
                         ("after=msg_unknown", "after")):
        _error(httpx.get(f"{url}/{foreground.id}/input_items?{query}",
                         timeout=HTTP_TIMEOUT_S), 400, param, param)
    with bg_server.core_paused():  # still running while it is named
        running = _respond(bg_server, background=True)
        _error(bg_server.post(path, json={"model": MODEL, "input": "hi",
                                         "previous_response_id": running.id}),
               400, "previous_response_id", "still")
    assert _finished(bg_server, running.id).output_text
    assert _respond(bg_server, max_output_tokens=2).status in ("completed", "incomplete")


def test_input_items_list_the_requests_own_input_in_openai_pages(bg_server):
    client = bg_server.client()
    first = _respond(bg_server, input="earlier turn", max_output_tokens=2)
    sent = [{"role": "user", "content": "hello world"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "the quick"}]},
            {"type": "message", "id": "msg_mine", "role": "user",
             "content": [{"type": "input_text", "text": "brown fox"}]}]
    got = _respond(bg_server, input=sent, previous_response_id=first.id, max_output_tokens=2)
    ascending = client.responses.input_items.list(got.id, order="asc").data
    assert [(i.type, i.role, i.content[0].type, i.content[0].text) for i in ascending] == [
        ("message", "user", "input_text", "hello world"),
        ("message", "assistant", "output_text", "the quick"),
        ("message", "user", "input_text", "brown fox")]
    ids = [i.id for i in ascending]
    assert ids[2] == "msg_mine" and len(set(ids)) == 3 and ids[0].startswith("msg_")
    raw = httpx.get(f"{bg_server.url}/v1/responses/{got.id}/input_items",
                    timeout=HTTP_TIMEOUT_S).json()  # OpenAI's default order: newest first
    assert [i["id"] for i in raw["data"]] == ids[::-1]
    assert (raw["object"], raw["first_id"], raw["last_id"], raw["has_more"]) == (
        "list", ids[2], ids[0], False)
    page = client.responses.input_items.list(got.id, limit=2)
    assert ([i.id for i in page.data], page.has_more) == (ids[:0:-1], True)
    assert [i.id for i in client.responses.input_items.list(got.id, limit=1)] == ids[::-1]
    after = client.responses.input_items.list(got.id, order="asc", after=ids[0])
    assert ([i.id for i in after.data], after.has_more) == (ids[1:], False)
    string = _respond(bg_server, input="just a string", max_output_tokens=2)
    (item,) = client.responses.input_items.list(string.id).data
    assert (item.role, item.content[0].text, item.status) == ("user", "just a string",
                                                              "completed")


def test_shutdown_with_background_responses_running_does_not_hang(chat_model, tmp_path):
    with launch_server(chat_model, tmp_path, env=STORE_ON) as served:
        client = served.client()
        plain = _respond(served, input="hi", max_output_tokens=LONG_TOKENS, background=True)
        streamed = _respond(served, input="hi", max_output_tokens=LONG_TOKENS, background=True,
                            stream=True)
        assert next(iter(streamed)).type == "response.created"  # its reader stays connected
        served.wait_for_metrics(lambda m: m["num_requests_running"] >= 2)
        assert client.responses.retrieve(plain.id).status in RUNNING
        stopping = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        # uvicorn ends by raising the signal again once it has shut down.
        assert served.process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert time.monotonic() - stopping < 30
        assert "Traceback" not in served.log.read_text()
        streamed.close()


# ---- the scripted engine: a failure -------------------------------------------------------
class _FailingStream(ScriptedStream):
    async def __aiter__(self):
        raise EngineStepError("the step failed")
        yield  # an async generator, as the engine's streams are


class _FailingEngine(ScriptedEngine):
    def add_requests(self, requests):
        return [_FailingStream(r, self.pieces, self.finish_reason) for r in requests]


@pytest.mark.parametrize("stream", [False, True])
def test_a_background_response_that_fails_is_stored_failed_with_its_error(stream):
    async def work(client):
        created = await client.responses.create(model="r1", input="hi", background=True,
                                                stream=stream)
        events = [e async for e in created] if stream else []
        response_id = events[0].response.id if stream else created.id
        deadline = time.monotonic() + DEADLINE_S
        while (got := await client.responses.retrieve(response_id)).status in RUNNING:
            assert time.monotonic() < deadline, got
            await asyncio.sleep(0.01)
        return got, [e.type for e in events]

    engine = _FailingEngine()
    engine.script(["a"])
    got, kinds = run_with_client(scripted_app(engine, reasoning=None, responses_store=4), work)
    assert (got.status, got.error.code, got.error.message) == (
        "failed", "server_error", "the step failed")
    assert got.output == [] and got.usage is None
    assert kinds == (["response.created", "response.in_progress", "error"] if stream else [])


class _EndlessStream(ScriptedStream):
    async def __aiter__(self):
        await asyncio.Event().wait()  # until closed (aborted)
        yield


class _EndlessEngine(ScriptedEngine):
    def __init__(self) -> None:
        super().__init__()
        self.streams: list[_EndlessStream] = []

    def add_requests(self, requests):
        self.streams += [_EndlessStream(r, self.pieces, self.finish_reason) for r in requests]
        return self.streams[-len(requests):]


def test_a_reused_request_id_stops_the_older_background_response():
    """With --enable-request-id-headers a client names the id; the newer response takes it,
    and the older, which no one can read or cancel any more, is aborted."""
    engine = _EndlessEngine()

    async def work(client):
        same = {"X-Request-Id": "same"}
        first = await client.responses.create(model="r1", input="hi", background=True,
                                              extra_headers=same)
        second = await client.responses.create(model="r1", input="hi", background=True,
                                               extra_headers=same)
        assert first.id == second.id == "resp_same"
        finished = [s.finished for s in engine.streams]
        return finished, await client.responses.cancel(second.id)

    finished, cancelled = run_with_client(
        scripted_app(engine, reasoning=None, responses_store=4, request_id_headers=True), work)
    assert finished == [True, False]
    assert cancelled.status == "cancelled" and engine.streams[1].finished
