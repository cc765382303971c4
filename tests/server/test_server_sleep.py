"""vLLM's development endpoints through HTTP: /sleep, /wake_up, /is_sleeping and
/reset_prefix_cache, with the engine core in its own process (``server/serving_dev.py``)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import HTTP_TIMEOUT_S, LONG_TOKENS, Server, launch_server
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.slow

PROMPT = random_prompts("server-sleep", [40])[0]


@pytest.fixture(scope="module")
def dev_server(chat_model, tmp_path_factory) -> Iterator[Server]:
    with launch_server(chat_model, tmp_path_factory.mktemp("sleep"), "--enable-sleep-mode",
                       env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        yield server


def _complete(server: Server) -> httpx.Response:
    return server.post("/v1/completions", json={
        "model": server.client().models.list().data[0].id, "prompt": PROMPT,
        "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})


def _is_sleeping(server: Server) -> bool:
    answer = httpx.get(server.url + "/is_sleeping", timeout=HTTP_TIMEOUT_S)
    assert answer.status_code == 200
    return answer.json()["is_sleeping"]


def _hits(server: Server) -> float:
    return server.metrics()["prefix_cache_hits_total"]


def test_the_routes_are_404s_without_dev_mode(server):
    for path in ("/sleep", "/wake_up", "/reset_prefix_cache"):
        assert server.post(path).status_code == 404
    assert httpx.get(server.url + "/is_sleeping", timeout=HTTP_TIMEOUT_S).status_code == 404


def test_sleep_refuses_requests_and_wake_up_serves_the_same_tokens(dev_server):
    first = _complete(dev_server)
    assert first.status_code == 200 and not _is_sleeping(dev_server)
    assert dev_server.post("/sleep", params={"level": 1}).status_code == 200
    assert _is_sleeping(dev_server)
    refused = _complete(dev_server)
    assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
    assert dev_server.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
    assert _is_sleeping(dev_server)  # the KV cache still sleeps
    assert dev_server.post("/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
    assert not _is_sleeping(dev_server)
    hits = _hits(dev_server)
    again = _complete(dev_server)
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert _hits(dev_server) == hits  # the pool came back empty: nothing to hit


def test_reset_prefix_cache_drops_the_hits(dev_server):
    assert _complete(dev_server).status_code == 200
    hits = _hits(dev_server)
    assert _complete(dev_server).status_code == 200
    assert _hits(dev_server) > hits  # a hit before the reset
    assert dev_server.post("/reset_prefix_cache").status_code == 200
    hits = _hits(dev_server)
    assert _complete(dev_server).status_code == 200
    assert _hits(dev_server) == hits  # none after


def test_bad_levels_and_tags_are_400s(dev_server):
    bad = dev_server.post("/sleep", params={"level": 3})
    assert bad.status_code == 400 and "level" in bad.json()["error"]["message"]
    assert dev_server.post("/wake_up", params={"tags": ["kv"]}).status_code == 400
    assert not _is_sleeping(dev_server)


def test_sleep_and_reset_are_refused_while_a_request_runs(dev_server):
    body = {"model": dev_server.client().models.list().data[0].id, "prompt": PROMPT,
            "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", dev_server.url + "/v1/completions", json=body,
                      timeout=HTTP_TIMEOUT_S) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the response
        assert next(lines).startswith("data: ")  # it runs
        refused = dev_server.post("/sleep")
        assert refused.status_code == 400
        assert "requests are running" in refused.json()["error"]["message"]
        assert dev_server.post("/reset_prefix_cache").status_code == 400
    assert not _is_sleeping(dev_server)
    # The hang-up aborts the request in the core; then the calls go through.
    deadline = time.monotonic() + 60
    while dev_server.post("/reset_prefix_cache").status_code != 200:
        assert time.monotonic() < deadline, "the aborted request never left the engine"
        time.sleep(0.1)
    assert _complete(dev_server).status_code == 200
