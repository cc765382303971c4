"""``pagedserve serve --data-parallel-size 2`` on the CPU: two engine-core replicas behind one
API server (``engine/dp_client.py``), seen through the OpenAI SDK and /metrics' ``engine``
label."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import (
    HTTP_TIMEOUT_S,
    LONG_TOKENS,
    MAX_MODEL_LEN,
    Server,
    launch_server,
    raw_request,
)
from tests.tiny_models import random_prompts

pytestmark = pytest.mark.slow

REPLICAS = (0, 1)
PROMPTS = [" ".join(["paged", "attention", "serving", "hello"][: 1 + i % 4]) + f" {i}"
           for i in range(8)]
SHARED = random_prompts("data-parallel", [48])[0]  # long enough to fill prefix-cache blocks
# The replica killed must be noticed, and its streams failed, well within this.
FAIL_FAST_S = 10.0


@pytest.fixture(scope="module")
def dp_server(chat_model, tmp_path_factory) -> Iterator[Server]:
    with launch_server(chat_model, tmp_path_factory.mktemp("dp"), "--data-parallel-size", "2",
                       "--enable-sleep-mode", env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        yield server


def _per_replica(server: Server, name: str) -> list[float]:
    return [server.metrics(engine=e).get(name, 0.0) for e in REPLICAS]


def _complete_all(server: Server, prompts: list[str]) -> list[str]:
    """Every prompt's greedy completion, all sent at once."""
    async def run() -> list[str]:
        async with server.async_client() as client:
            answers = await asyncio.gather(*(
                client.completions.create(model="model", prompt=p, max_tokens=12,
                                          temperature=0) for p in prompts))
        return [a.choices[0].text for a in answers]
    return asyncio.run(run())


def test_concurrent_requests_spread_over_both_replicas(dp_server):
    before = _per_replica(dp_server, "generation_tokens_total")
    _complete_all(dp_server, PROMPTS)
    after = _per_replica(dp_server, "generation_tokens_total")
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert all(tokens > 0 for tokens in served), served


def test_greedy_answers_equal_a_single_replica_servers(dp_server, server):
    assert _complete_all(dp_server, PROMPTS) == _complete_all(server, PROMPTS)
    messages = [{"role": "user", "content": "hello there"}]
    chats = [s.client().chat.completions.create(model="model", messages=messages,
                                                max_tokens=10, temperature=0)
             for s in (dp_server, server)]
    assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
    assert dp_server.client().models.list().data[0].max_model_len == MAX_MODEL_LEN


def test_a_client_leaving_frees_the_blocks_of_its_own_replica(dp_server):
    aborted = dp_server.metrics().get("request_finished_total{abort}", 0) + 1
    body = {"model": "model", "prompt": "hello world", "max_tokens": LONG_TOKENS,
            "ignore_eos": True, "stream": True}
    with dp_server.connect() as sock:
        sock.sendall(raw_request("POST", "/v1/completions", json.dumps(body).encode()))
        running = _wait(dp_server, lambda: _per_replica(dp_server, "num_requests_running"),
                        lambda counts: sum(counts) == 1)
        replica = running.index(1)
        blocks = _per_replica(dp_server, "kv_cache_blocks_used")
        assert blocks[replica] > 0 and blocks[1 - replica] == 0, blocks
    dp_server.wait_for_metrics(lambda m: m.get("request_finished_total{abort}", 0) >= aborted)
    _wait(dp_server, lambda: _per_replica(dp_server, "kv_cache_blocks_used"),
          lambda used: used == [0, 0])


def test_sleep_wake_up_and_the_reset_reach_every_replica(dp_server):
    assert dp_server.post("/sleep", params={"level": 1}).status_code == 200
    assert httpx.get(f"{dp_server.url}/is_sleeping", timeout=HTTP_TIMEOUT_S).json() == \
        {"is_sleeping": True}
    for _ in REPLICAS:  # an awake replica would take one of them
        refused = _complete(dp_server, SHARED)
        assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
    assert dp_server.post("/wake_up").status_code == 200
    assert not httpx.get(f"{dp_server.url}/is_sleeping", timeout=HTTP_TIMEOUT_S).json()[
        "is_sleeping"]
    # One after another, the requests take turns: each replica sees the prompt twice.
    hits = _per_replica(dp_server, "prefix_cache_hits_total")
    for _ in range(4):
        assert _complete(dp_server, SHARED).status_code == 200
    after = _per_replica(dp_server, "prefix_cache_hits_total")
    assert all(a > h for a, h in zip(after, hits, strict=True)), (hits, after)
    assert dp_server.post("/reset_prefix_cache").status_code == 200
    for _ in REPLICAS:
        assert _complete(dp_server, SHARED).status_code == 200
    assert _per_replica(dp_server, "prefix_cache_hits_total") == after


def test_a_killed_replica_fails_its_own_streams_and_turns_health_red(dp_server):
    """The module's last test: it leaves the server with one replica."""
    cores = dp_server.core_pids()
    assert len(cores) == 2
    body = {"model": "model", "prompt": [5, 6, 7], "max_tokens": LONG_TOKENS,
            "ignore_eos": True, "stream": True}
    # Two at once: the second goes to the replica the first left idle.
    with httpx.stream("POST", f"{dp_server.url}/v1/completions", json=body,
                      timeout=HTTP_TIMEOUT_S) as one, \
            httpx.stream("POST", f"{dp_server.url}/v1/completions", json=body,
                         timeout=HTTP_TIMEOUT_S) as two:
        lines = [one.iter_lines(), two.iter_lines()]
        for stream in lines:
            assert len(_events(stream, 2)) == 2
        assert _per_replica(dp_server, "num_requests_running") == [1, 1]
        os.kill(cores[0], signal.SIGKILL)
        ends = _read_both_until_an_error(lines)
    # One stream ended with the single core's error event; the other was still going.
    failed = [e for e in ends if e and "error" in e[-1]]
    assert len(failed) == 1, [e[-1:] for e in ends]
    assert failed[0][-1]["error"]["type"] == "server_error"
    assert "exited with code -9" in failed[0][-1]["error"]["message"]
    health = httpx.get(f"{dp_server.url}/health", timeout=HTTP_TIMEOUT_S)
    assert health.status_code == 503
    assert re.search(r"replica [01] of 2: the engine core process of 'model' exited with "
                     r"code -9", health.json()["error"]["message"])
    # The other replica still serves.
    answer = dp_server.client().completions.create(model="model", prompt="hi", max_tokens=3)
    assert answer.usage.completion_tokens == 3


def _complete(server: Server, prompt) -> httpx.Response:
    return server.post("/v1/completions", json={"model": "model", "prompt": prompt,
                                                "max_tokens": 4, "temperature": 0})


def _events(lines: Iterator[str], count: int) -> list[dict]:
    """Up to ``count`` more data events of a stream (fewer if it ends)."""
    events = []
    for line in lines:
        if line.startswith("data: {"):
            events.append(json.loads(line[6:]))
            if len(events) == count or "error" in events[-1]:
                break
    return events


def _read_both_until_an_error(streams: list[Iterator[str]]) -> list[list[dict]]:
    """Each stream's events, read side by side (the one still running has no end) until one
    ends in an error event, and the other's next event; fail unless that takes less than
    ``FAIL_FAST_S``."""
    ended = threading.Event()
    events: list[list[dict]] = [[] for _ in streams]

    def read(lines: Iterator[str], into: list[dict]) -> None:
        for line in lines:
            if line.startswith("data: {"):
                into.append(json.loads(line[6:]))
                if "error" in into[-1]:
                    ended.set()
                if ended.is_set():
                    return

    readers = [threading.Thread(target=read, args=pair, daemon=True)
               for pair in zip(streams, events, strict=True)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + FAIL_FAST_S
    for reader in readers:
        reader.join(max(0.0, deadline - time.monotonic()))
    assert not any(r.is_alive() for r in readers), "no stream failed in time"
    return events


def _wait(server: Server, read, done, timeout: float = 60.0):
    """Poll ``read()`` until ``done`` of it; fail with the last value on timeout."""
    deadline = time.monotonic() + timeout
    while not done(value := read()):
        if time.monotonic() > deadline:
            pytest.fail(f"never reached the expected state: {value}")
        time.sleep(0.1)
    return value
