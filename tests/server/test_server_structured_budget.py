"""A hostile JSON schema against a real server: it gets an OpenAI-format 400 once its compile
exceeds ``--max-grammar-compile-seconds``, and a different schema sent while it compiles is
answered meanwhile (another compile worker takes it)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import HTTP_TIMEOUT_S, launch_server
from tests.structured.test_compile_budget import FAST

# A budget far beyond the fast schema's whole request (a second or two, a few under a loaded
# CI machine's other tests), and a slow schema far beyond the budget on any machine: 300
# bounded strings of 50 to 349 characters, over twenty times the states of test_compile_budget's
# 40 that take 18 s on a quiet core here. With a 10 s budget, the fast request once came back
# after the slow one's refusal on a loaded machine.
BUDGET_S = 30
SLOW_SCHEMA = {"type": "object", "required": [f"p{i}" for i in range(300)],
               "properties": {f"p{i}": {"type": "string", "maxLength": 50 + i}
                              for i in range(300)}}


@pytest.fixture(scope="module")
def server(default_model_folder, tmp_path_factory):
    with launch_server(default_model_folder, tmp_path_factory.mktemp("logs"),
                       "--max-model-len", "64",  # the default model's KV in the small cache
                       "--max-grammar-compile-seconds", str(BUDGET_S),
                       "--grammar-compile-workers", "2") as server:
        yield server


def _body(schema: dict) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "JSON please"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": schema}}}


def test_another_schema_is_answered_while_a_slow_one_compiles_then_it_gets_a_400(server):
    """One slow compile for both checks (each costs the budget): the first in this module, so
    that both compile workers are up (a worker killed at the budget starts again)."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=HTTP_TIMEOUT_S) as client:
            # Streamed, so that its headers say it reached the engine before the fast one.
            request = client.build_request("POST", "/v1/chat/completions",
                                           json={**_body(SLOW_SCHEMA), "stream": True})
            slow = await client.send(request, stream=True)
            assert slow.status_code == 200
            slow_body = asyncio.ensure_future(slow.aread())
            fast = await client.post("/v1/chat/completions", json=_body(json.loads(FAST.text)))
            assert fast.status_code == 200, fast.text
            assert not slow_body.done()  # still compiling: it cannot end before its budget
            assert b"--max-grammar-compile-seconds" in await slow_body

    asyncio.run(run())
    # Asked again, the refused schema is a 400 at once, in the OpenAI format.
    response = httpx.post(f"{server.url}/v1/chat/completions", json=_body(SLOW_SCHEMA),
                          timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "response_format"  # the field the client sent
    assert (f"did not compile within {BUDGET_S} s (--max-grammar-compile-seconds)"
            in error["message"])


def test_a_schema_that_accepts_nothing_gets_a_400(server):
    """Not a 200 whose choice ends with an invented finish reason; streamed, whose 200 went
    out before the grammar compiled, the stream ends with the same error."""
    schema = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    url = f"{server.url}/v1/chat/completions"
    response = httpx.post(url, json=_body(schema), timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and "accepts no output" in error["message"]
    streamed = httpx.post(url, json={**_body(schema), "stream": True}, timeout=HTTP_TIMEOUT_S)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    last = events[-1]["error"]
    assert (last["type"], last["param"], last["message"]) == (
        "invalid_request_error", "response_format", error["message"])
    assert '"finish_reason":"' not in streamed.text  # no choice ended before the error
