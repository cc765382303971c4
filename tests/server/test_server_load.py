"""Many clients at once, clients that hang up, and what /metrics says about both; the load
and hang-up tests run against the server twice, one step at a time and with async
scheduling."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedserve import SamplingParams
from tests.server.conftest import LONG_TOKENS, raw_request

WORDS = "the quick brown fox jumps over lazy dog hello world paged attention serving".split()


@pytest.fixture(params=["server", "ahead_server"])
def served(request):
    return request.getfixturevalue(request.param)


def _prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 7)) for i in range(n)]


def test_32_concurrent_clients_all_get_their_own_answer(served, offline):
    prompts = _prompts(32)
    expected = offline.generate(prompts, SamplingParams(max_tokens=10, temperature=0),
                                use_tqdm=False)

    async def one(client, i: int) -> str:
        if i % 2:  # half stream, half don't
            stream = await client.completions.create(model="model", prompt=prompts[i],
                                                     max_tokens=10, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])
        got = await client.completions.create(model="model", prompt=prompts[i],
                                              max_tokens=10, temperature=0)
        return got.choices[0].text

    async def run_all() -> list[str]:
        async with served.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(run_all()) == [e.outputs[0].text for e in expected]
    served.wait_for_metrics(lambda m: m["kv_cache_blocks_used"] == 0)


def _long_request(stream: bool) -> dict:
    # Far longer than it takes the server to notice the client is gone, on any machine.
    return {"model": "model", "prompt": "hello world", "max_tokens": LONG_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": stream}


def test_client_leaving_mid_stream_aborts_and_frees_blocks(served):
    before = served.metrics()
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{served.url}/v1/completions",
                           json=_long_request(True)) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["text"] is not None
                    break
    # Leaving the block closed the connection after one chunk.
    _assert_aborted_with_blocks_back(served, before)


def _assert_aborted_with_blocks_back(server, before: dict) -> None:
    """One more request was aborted, every KV block is free again, and generation stopped
    well before the request's full length."""
    aborted = before.get("request_finished_total{abort}", 0) + 1
    after = server.wait_for_metrics(
        lambda m: m.get("request_finished_total{abort}", 0) >= aborted
        and m["kv_cache_blocks_used"] == 0 and m["num_requests_running"] == 0)
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < LONG_TOKENS


def test_client_leaving_a_plain_request_it_is_waiting_for_aborts_it(served):
    """The client gives up (as on its own timeout) once the server reports the request running
    with KV blocks held: no client timer decides whether it left in time."""
    before = served.metrics()
    body = json.dumps(_long_request(False)).encode()
    with served.connect() as sock:
        sock.sendall(raw_request("POST", "/v1/completions", body))
        served.wait_for_metrics(lambda m: m["num_requests_running"] == 1
                                and m["kv_cache_blocks_used"] > 0)
    _assert_aborted_with_blocks_back(served, before)


def test_metrics_exposes_engine_state_and_latencies(server):
    server.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    text = httpx.get(f"{server.url}/metrics").text
    served_name = server.client().models.list().data[0].id  # every sample is labelled by it
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "kv_cache_usage_perc", "kv_cache_blocks_used", "kv_cache_blocks_free",
                 "prefix_cache_hit_rate", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total"):  # engine state: by engine too, as in vLLM
        assert f'pagedserve:{name}{{engine="0",model_name="{served_name}"}} ' in text, name
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"):  # what the server times
        assert f'pagedserve:{name}{{model_name="{served_name}"}} ' in text, name
    values = server.metrics()
    assert values["e2e_request_latency_seconds_count"] >= 1
    assert values["generation_tokens_total"] >= 3
