"""The HTTP layer against hostile or unusual clients: the API key on every endpoint, tokenizing
off the event loop, OpenAI error bodies below the routes (malformed HTTP, the connection cap),
a body without a Content-Type, Host names against DNS rebinding, and a client that half-closes
its side after sending its request."""

from __future__ import annotations

import asyncio
import functools
import gzip
import io
import json
import re
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from pagedserve.engine.input_processor import InputLimits
from tests.server.conftest import HTTP_TIMEOUT_S, launch_server, raw_request, read_response

GOOD = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
ALLOWED = ("example.test", "other.test", "third.test")
MAX_CONNECTIONS = 2
WRITE_TIMEOUT_S = 1.0
LONG = 1000


def _error(response: httpx.Response | None, status: int) -> dict:
    """The OpenAI error object of a response, whichever layer answered it."""
    assert response is not None and response.status_code == status, response
    assert response.headers["content-type"] == "application/json", response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _raw(data: bytes) -> httpx.Response | None:
    """The first final response in raw bytes, as an httpx.Response for _error."""
    raw = read_response(io.BytesIO(data))
    if raw is None:
        return None
    return httpx.Response(raw.status, headers=raw.headers, content=raw.body)


# ---- the API key --------------------------------------------------------------------------
def test_the_key_guards_every_endpoint_but_health_and_metrics(keyed_server):
    url, key = keyed_server.url, {"Authorization": f"Bearer {keyed_server.api_key}"}
    requests = [("POST", "/tokenize", {"prompt": "hello"}),
                ("POST", "/detokenize", {"tokens": [1, 2]}), ("GET", "/version", None),
                ("GET", "/v1/models", None)]
    for method, path, body in requests:
        response = httpx.request(method, url + path, json=body, timeout=HTTP_TIMEOUT_S)
        assert _error(response, 401)["code"] == "invalid_api_key", path
        response = httpx.request(method, url + path, json=body, headers=key,
                                 timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 200, (path, response.text)
    for path in ("/health", "/metrics"):
        assert httpx.get(url + path, timeout=HTTP_TIMEOUT_S).status_code == 200, path


# ---- tokenizing and converting schemas off the event loop -----------------------------------
class _Gate:
    """Where a stand-in for slow work waits until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.opened_by_the_test = False

    def hold(self) -> None:
        self.entered.set()
        # The test opens the gate once the other requests have been answered; only an event
        # loop frozen in this call (the defect) lets the wait run out instead.
        self.opened_by_the_test = self.gate.wait(timeout=60)


class _GatedTokenizer(_Gate):
    """A tokenizer whose encode waits until the test opens its gate."""

    chat_template = "any"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.hold()
        return list(range(len(text)))

    def apply_chat_template(self, messages: list[dict], **_) -> str:
        return "".join(m["content"] for m in messages)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [str(i) for i in ids]


# What the stand-in engine checks requests against.
LIMITS = InputLimits(vocab_size=100, max_model_len=64, max_num_seqs=4,
                     eos_token_ids=frozenset({0}), num_kv_blocks=16, block_size=16,
                     max_grammar_bytes=1 << 16, max_logprobs=20)


def _refuse(requests):
    """Check each request as the engine client does (its grammar among it), then refuse it."""
    for r in requests:
        LIMITS.check(r.prompt_token_ids, r.params)
    raise ValueError("refused by the test engine")


def _in_process_app(tokenizer=None, **options):
    """The app over a stand-in engine that refuses every request, in this process."""
    from pagedserve.server.app import create_app

    engine = SimpleNamespace(
        facts=SimpleNamespace(model_name="model", limits=LIMITS, lora=None,
                              sampling_defaults={}, labels=()),
        tokenizer=tokenizer, is_running=True, engine_stats=lambda: [None], add_requests=_refuse)
    return create_app([engine], **options)


def _call(app, method: str, path: str, **kwargs) -> httpx.Response:
    """One request to an in-process app."""
    async def call():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            return await c.request(method, path, **kwargs)
    return asyncio.run(call())


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/tokenize", {"prompt": "abc"}, 200),
    ("/tokenize", {"messages": [{"role": "user", "content": "abc"}]}, 200),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 1}, 400),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "abc"}]}, 400),
])
def test_health_answers_while_a_request_is_being_tokenized(path, body, status):
    """In process, against a stand-in engine whose tokenizer blocks until /health has been
    answered: /health must not wait for the tokenizer (the engine refuses what reaches it)."""
    tokenizer = _GatedTokenizer()
    app = _in_process_app(tokenizer)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            work = asyncio.ensure_future(client.post(path, json=body))
            assert await asyncio.to_thread(tokenizer.entered.wait, 60)
            health = await client.get("/health")
            tokenizer.gate.set()
            return health, await work

    health, response = asyncio.run(scenario())
    assert health.status_code == 200 and tokenizer.opened_by_the_test
    assert response.status_code == status, response.text
    if status == 200:
        assert response.json()["tokens"] == [0, 1, 2]
    else:
        assert "refused by the test engine" in response.json()["error"]["message"]


def test_health_and_models_answer_while_a_schema_is_converted(monkeypatch):
    """In process: xgrammar's conversion of a request's JSON schema (stood in for by one
    that blocks until the test opens its gate) must not hold /health and /v1/models; a bad
    regex is still a 400 naming its field, from the conversion off the loop."""
    from pagedserve.structured import spec

    converter = _Gate()
    monkeypatch.setattr(spec, "to_grammar", lambda _: converter.hold())
    monkeypatch.setattr(spec, "_parse", functools.lru_cache(spec._parse.__wrapped__))
    schema = {"type": "object", "properties": {"held": {"type": "string"}}}
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "held", "schema": schema}}}
    app = _in_process_app()

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            work = asyncio.ensure_future(client.post("/v1/completions", json=body))
            assert await asyncio.to_thread(converter.entered.wait, 60)
            others = [await client.get("/health"), await client.get("/v1/models")]
            converter.gate.set()
            return others, await work

    others, response = asyncio.run(scenario())
    assert [r.status_code for r in others] == [200, 200] and converter.opened_by_the_test
    assert "refused by the test engine" in _error(response, 400)["message"]
    monkeypatch.undo()
    bad = {"prompt": [1, 2, 3], "max_tokens": 1, "guided_regex": "a(b"}
    assert _error(_call(app, "POST", "/v1/completions", json=bad), 400)["param"] == "guided_regex"


def test_a_conversation_of_too_many_messages_is_refused_on_its_count(server):
    """The count is checked before each of the messages is validated."""
    body = {**CHAT, "messages": [{"role": "user", "content": "a"}] * 100_000}
    for path in ("/v1/chat/completions", "/tokenize"):
        error = _error(server.post(path, json=body), 400)
        assert error["param"] == "messages" and "at most" in error["message"], error
        assert "100000" in error["message"], error


# ---- OpenAI error bodies below the routes ---------------------------------------------------
@pytest.mark.parametrize("request_bytes", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: localhost\r\nno colon here\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: x\r\n\r\n",
])
def test_malformed_http_gets_a_json_400(server, request_bytes):
    with server.connect() as sock:
        sock.sendall(request_bytes)
        response = _raw(_until_closed(sock))
    assert _error(response, 400)["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200


def test_a_request_with_both_content_length_and_transfer_encoding_is_refused(server):
    """A proxy that reads the Content-Length while we read the chunks would take the rest of
    the body for another request (RFC 9112 6.3): refused, and the connection is closed, so a
    request queued behind it is never served."""
    body = json.dumps(GOOD).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with server.connect() as sock:
        sock.sendall(head + chunked + raw_request("GET", "/health", b""))
        data = _until_closed(sock)
    response = _raw(data)
    assert "Transfer-Encoding" in _error(response, 400)["message"]
    assert data.count(b"HTTP/1.1 ") == 1, data


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({"messages": [{"role": "nobody", "content": "x"}]}, "messages"),
    ({"messages": []}, "messages"),
    ({}, "prompt"),
])
def test_tokenize_errors_name_the_field(server, body, param):
    error = _error(server.post("/tokenize", json=body), 400)
    assert error["param"] == param, error
    assert "Tokenize" not in error["message"], error


def test_a_body_without_content_type_is_read_as_json(server):
    response = server.post("/v1/completions", content=json.dumps(GOOD).encode())
    assert "content-type" not in response.request.headers
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == GOOD["max_tokens"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_a_compressed_body_is_refused_as_unsupported(server, encoding):
    """The server decompresses nothing (so no zip bomb inflates in it): a compressed body is a
    415 naming the encoding, not a 400 that says the JSON could not be parsed."""
    body = gzip.compress(json.dumps(GOOD).encode())
    error = _error(server.post("/v1/completions", content=body,
                               headers={"Content-Encoding": encoding}), 415)
    assert encoding in error["message"] and "Content-Encoding" in error["message"], error
    response = server.post("/v1/completions", json=GOOD, headers={"Content-Encoding": "identity"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"prompt": "caf\xe9", "max_tokens": 1}', "UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"prompt": "a", "max_tokens": ' + b"9" * 5_000 + b"}", "digits"),
])
def test_a_body_json_cannot_read_gets_a_400_saying_why(server, body, reason):
    """FastAPI answers "There was an error parsing the body" to whatever its JSON parse raises
    besides a syntax error; the client is told what was wrong."""
    error = _error(server.post("/v1/completions", content=body), 400)
    assert error["message"].startswith("the request body is not valid JSON"), error
    assert reason in error["message"], error


# ---- Host names (DNS rebinding) -------------------------------------------------------------
@pytest.fixture(scope="module")
def widened(chat_model, tmp_path_factory):
    """No key, loopback, three more Host names (repeated and comma-separated), a connection
    cap and a short write deadline."""
    with launch_server(chat_model, tmp_path_factory.mktemp("widened"),
                       "--allowed-hosts", ALLOWED[0], "--allowed-hosts", ",".join(ALLOWED[1:]),
                       "--max-concurrent-connections", str(MAX_CONNECTIONS),
                       "--response-write-timeout", str(WRITE_TIMEOUT_S)) as s:
        yield s


def _status_for_host(server, host: str) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/models", headers={"Host": host}, timeout=HTTP_TIMEOUT_S)


LOOPBACK = ["localhost", "LocalHost", "127.0.0.1", "[::1]"]
FOREIGN = ["evil.example", "localhost.evil.example", "127.0.0.1.evil.example", "::1",
           "[::1].evil.example", "example.test.evil"]


def test_without_a_key_only_loopback_host_names_are_answered(server):
    port = server.url.rsplit(":", 1)[1]
    for host in LOOPBACK + [f"{h}:{port}" for h in LOOPBACK]:
        assert _status_for_host(server, host).status_code == 200, host
    for host in FOREIGN + ["example.test", f"evil.example:{port}"]:
        error = _error(_status_for_host(server, host), 400)
        assert error["code"] == "invalid_host" and "--allowed-hosts" in error["message"], host
    assert _error(httpx.get(f"{server.url}/health", headers={"Host": "evil.example"},
                            timeout=HTTP_TIMEOUT_S), 400)["code"] == "invalid_host"


def test_allowed_hosts_widens_the_host_names(widened):
    for host in [*LOOPBACK, *ALLOWED, "EXAMPLE.test", "third.test:8080"]:
        assert _status_for_host(widened, host).status_code == 200, host
    for host in FOREIGN:
        assert _error(_status_for_host(widened, host), 400)["code"] == "invalid_host", host


def test_a_server_with_a_key_answers_any_host_name(keyed_server):
    response = httpx.get(f"{keyed_server.url}/v1/models", timeout=HTTP_TIMEOUT_S,
                         headers={**keyed_server.headers, "Host": "evil.example"})
    assert response.status_code == 200, response.text


def test_openapi_schema_is_off_with_the_docs(server):
    assert httpx.get(f"{server.url}/openapi.json", timeout=HTTP_TIMEOUT_S).status_code == 404


# ---- the connection cap ---------------------------------------------------------------------
def test_connections_over_the_cap_get_a_json_503(widened):
    """But /health, which a liveness probe reads: a busy server is alive."""
    held = [widened.connect() for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # each is served once, then keeps a head half sent
            sock.sendall(raw_request("GET", "/health", b"") + b"GET /health HTTP/1.1\r\nHo")
            assert read_response(sock.makefile("rb")).status == 200
        response = httpx.get(f"{widened.url}/v1/models", timeout=HTTP_TIMEOUT_S)
        error = _error(response, 503)
        assert error["type"] == "server_error" and error["code"] == "too_many_connections"
        assert response.headers["connection"] == "close"
        assert httpx.get(f"{widened.url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    finally:
        for sock in held:
            sock.close()
    # The held connections' close reaches the server; then it serves again.
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while httpx.get(f"{widened.url}/health", timeout=HTTP_TIMEOUT_S).status_code != 200:
        assert time.monotonic() < deadline, "the server never served again"


# ---- half-close ------------------------------------------------------------------------------
def _half_closed(server, body: dict) -> bytes:
    """Send a whole request, shut the sending side, and read until the server closes."""
    with server.connect() as sock:
        sock.sendall(raw_request("POST", "/v1/completions", json.dumps(body).encode()))
        sock.shutdown(socket.SHUT_WR)
        return _until_closed(sock)


def test_a_client_that_half_closes_after_its_request_gets_the_answer(server):
    whole = _raw(_half_closed(server, GOOD))
    assert whole is not None and whole.status_code == 200, whole
    text = whole.json()["choices"][0]["text"]
    assert whole.json()["usage"]["completion_tokens"] == GOOD["max_tokens"]

    streamed = _half_closed(server, {**GOOD, "stream": True})
    # Past any 1xx (the server may send one to learn whether the client still reads).
    assert re.match(rb"(HTTP/1.1 1\d\d [^\r]*\r\n\r\n)*HTTP/1.1 200 ", streamed), streamed
    events = re.findall(rb"data: (.*)\n\n", streamed)
    assert events[-1] == b"[DONE]", events
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == text


def test_a_client_that_closes_after_its_request_still_has_it_aborted(server):
    """Closing (not half-closing) the socket is a hang-up, though the server sees the same
    FIN: the request is aborted and its blocks come back."""
    before, after = server.hang_up_once_running("/v1/completions",
                                                {**GOOD, "max_tokens": LONG})
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < LONG


def _until_server_closed(sock: socket.socket, timeout: float = 60.0) -> None:
    """Wait, reading nothing (reading would let the writes go on), until the server has
    closed its end of ``sock``'s connection: its socket in /proc/net/tcp leaves ESTABLISHED
    (Linux; it goes on sending what its kernel buffer holds, then its FIN)."""
    ours, theirs = (f"0100007F:{a[1]:04X}" for a in (sock.getsockname(), sock.getpeername()))
    deadline = time.monotonic() + timeout
    while True:
        states = [line.split()[3] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                  if line.split()[1:3] == [theirs, ours]]
        if states != [_TCP_ESTABLISHED]:
            return
        assert time.monotonic() < deadline, "the server kept the connection"
        time.sleep(0.05)


_TCP_ESTABLISHED = "01"  # /proc/net/tcp's state of an open connection


def test_a_client_that_stops_reading_its_stream_is_dropped(widened):
    """A client that never reads a long stream filled the buffers and then held its
    connection, and a place under the connection cap, for good. Past
    --response-write-timeout with the writes paused, the server drops the connection: what
    the client finds later is a cut stream (all of it, to [DONE], before), and the request is
    over (aborted, or finished where the engine got there first)."""
    # About 5 MB, past what the kernel takes into its socket buffers (up to 4 MB a side).
    body = {**GOOD, "max_tokens": 3500, "stream": True, "logprobs": 5, "n": 4}
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        sock.connect(("127.0.0.1", int(widened.url.rsplit(":", 1)[1])))
        sock.sendall(raw_request("POST", "/v1/completions", json.dumps(body).encode()))
        widened.wait_for_metrics(lambda m: m["num_requests_running"] == 0
                                 and m["kv_cache_blocks_used"] == 0)
        _until_server_closed(sock)
        sock.settimeout(5)
        received = b""
        try:
            while chunk := sock.recv(1 << 16):
                received += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    assert received.startswith(b"HTTP/1.1 200 ")
    assert b"data: [DONE]" not in received, len(received)
    assert httpx.get(f"{widened.url}/v1/models", timeout=HTTP_TIMEOUT_S).status_code == 200


# ---- Browsers (CORS) -------------------------------------------------------------------------


def _browser(app, method: str, origin: str, headers: dict | None = None) -> httpx.Response:
    return _call(app, method, "/v1/models", headers={"Origin": origin, **(headers or {})})


PREFLIGHT = {"Access-Control-Request-Method": "GET",
             "Access-Control-Request-Headers": "authorization"}


def test_cors_answers_only_the_allowed_origins():
    """A page of an allowed origin may call the API (its preflight carries no key, and is
    answered before the key is checked; the call itself still needs the key); any other
    origin's page gets no CORS headers, so its browser keeps the answer from it. Without
    --allowed-origins no origin is allowed (vLLM allows all)."""
    app = _in_process_app(api_key="k", allowed_hosts=["localhost"],
                          allowed_origins=["http://ui.test"])
    ok = _browser(app, "OPTIONS", "http://ui.test", PREFLIGHT)
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://ui.test"
    call = _browser(app, "GET", "http://ui.test", {"Authorization": "Bearer k"})
    assert call.status_code == 200 and call.json()["data"][0]["id"] == "model"
    assert call.headers["access-control-allow-origin"] == "http://ui.test"
    assert _browser(app, "GET", "http://ui.test").status_code == 401
    other = _browser(app, "OPTIONS", "http://evil.test", PREFLIGHT)
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    default = _in_process_app()
    assert "access-control-allow-origin" not in _browser(default, "GET", "http://ui.test").headers
    assert _browser(default, "OPTIONS", "http://ui.test", PREFLIGHT).status_code == 405
