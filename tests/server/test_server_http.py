"""HTTP below the JSON: slow clients cut off by the read timeout, the connection cap, HEAD, the
Authorization scheme, the API key from the environment, the Content-Type, and no docs pages
that load scripts from elsewhere."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.server.conftest import HTTP_TIMEOUT_S, LONG_TOKENS, launch_server

GOOD = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
READ_TIMEOUT_S = 2
MAX_CONNECTIONS = 3
ENV_KEY = "key-from-the-environment"


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics", "/v1/models", "MODEL"])
def test_head_answers_as_get_without_a_body(server, path):
    """HEAD on a read route was a 405 but on /health."""
    if path == "MODEL":  # the served model's id holds its folder's "/"s
        path = "/v1/models/" + server.client().models.list().data[0].id
    get = httpx.get(server.url + path, timeout=HTTP_TIMEOUT_S)
    head = httpx.head(server.url + path, timeout=HTTP_TIMEOUT_S)
    assert get.status_code == head.status_code == 200 and head.content == b""
    assert head.headers.get("content-type") == get.headers.get("content-type")


def test_docs_pages_are_off_by_default(server):
    """FastAPI's docs pages load their scripts from a public CDN."""
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert httpx.get(server.url + path, timeout=HTTP_TIMEOUT_S).status_code == 404


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_json_gets_an_error_naming_the_content_type(server, content_type):
    response = server.post("/v1/completions", content=json.dumps(GOOD).encode(),
                           headers={"Content-Type": content_type})
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert "application/json" in error["message"] and content_type in error["message"]
    # A JSON type with parameters, or a +json one, is fine.
    for ok in ("application/json; charset=utf-8", "application/vnd.api+json"):
        response = server.post("/v1/completions", content=json.dumps(GOOD).encode(),
                               headers={"Content-Type": ok})
        assert response.status_code == 200, (ok, response.text)


# ---- a server with a short read timeout, a connection cap and the key in its environment ----
@pytest.fixture(scope="module")
def guarded_server(chat_model, tmp_path_factory):
    with launch_server(chat_model, tmp_path_factory.mktemp("guarded"),
                       "--request-read-timeout", str(READ_TIMEOUT_S),
                       "--max-concurrent-connections", str(MAX_CONNECTIONS),
                       env={"PAGEDSERVE_API_KEY": ENV_KEY}) as s:
        s.api_key = ENV_KEY
        yield s


def test_api_key_from_the_environment_with_any_case_of_bearer(guarded_server):
    url = f"{guarded_server.url}/v1/models"
    assert ENV_KEY not in " ".join(guarded_server.process.args)
    assert httpx.get(url, timeout=HTTP_TIMEOUT_S).status_code == 401
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        response = httpx.get(url, headers={"Authorization": f"{scheme} {ENV_KEY}"},
                             timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 200, scheme
    for wrong in (f"Basic {ENV_KEY}", f"Bearer{ENV_KEY}", "Bearer other"):
        response = httpx.get(url, headers={"Authorization": wrong}, timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 401, wrong


def _closed_by_server(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# A head that promises far more body than the client will send.
_SLOW_HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + ENV_KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n")


def test_a_body_that_never_completes_gets_408_and_close(guarded_server):
    start = time.monotonic()
    with guarded_server.connect(timeout=READ_TIMEOUT_S + 20) as sock:
        sock.sendall(_SLOW_HEAD + b'{"prompt": "hel')
        reply = _closed_by_server(sock)
    elapsed = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert b"connection: close" in reply.lower() and b'"code":"request_timeout"' in reply
    assert READ_TIMEOUT_S - 0.5 < elapsed < READ_TIMEOUT_S + 15


def test_a_head_that_never_completes_is_closed(guarded_server):
    start = time.monotonic()
    with guarded_server.connect(timeout=READ_TIMEOUT_S + 20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Len")
        _closed_by_server(sock)
    assert time.monotonic() - start < READ_TIMEOUT_S + 15


def test_trickling_a_body_does_not_extend_the_timeout(guarded_server):
    """The timeout bounds the whole request, not the gap between two bytes."""
    start = time.monotonic()
    reply = b""
    with guarded_server.connect(timeout=0.2) as sock:
        sock.sendall(_SLOW_HEAD)
        while not reply and time.monotonic() - start < READ_TIMEOUT_S + 15:
            sock.sendall(b" ")
            try:
                reply = sock.recv(65536)
            except TimeoutError:
                pass
    assert reply.startswith(b"HTTP/1.1 408 "), reply
    assert time.monotonic() - start < READ_TIMEOUT_S + 15


def test_connections_over_the_cap_are_refused_until_slow_ones_time_out(guarded_server):
    url = guarded_server.url
    held = []
    try:
        for expected in (200, 503):  # the cap itself is served, one more is not
            while len(held) < MAX_CONNECTIONS - (expected == 200):
                held.append(guarded_server.connect())
                held[-1].sendall(b"GET /health HTTP/1.1\r\nHost: te")  # never finished
            # No wait: the server accepts connections in the order they came, so the held
            # ones are counted before this request is read.
            response = httpx.get(f"{url}/v1/models", timeout=HTTP_TIMEOUT_S,
                                 headers=guarded_server.headers)
            assert response.status_code == expected
        # /health, which a liveness probe reads, is answered over the cap.
        assert httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT_S).status_code == 200
        # The read timeout closes the held connections; then the server serves again.
        for sock in held:
            _closed_by_server(sock)
        assert httpx.get(f"{url}/v1/models", timeout=HTTP_TIMEOUT_S,
                         headers=guarded_server.headers).status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_the_read_timeout_does_not_cut_a_response_that_outlasts_it(guarded_server):
    """Once the request is read, answering it may take as long as it takes: the engine core is
    held still past the read timeout while the response is under way."""
    body = {**GOOD, "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=HTTP_TIMEOUT_S, headers=guarded_server.headers) as client:
        with client.stream("POST", f"{guarded_server.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(lines)
            with guarded_server.core_paused():
                running = guarded_server.metrics()["num_requests_running"]
                time.sleep(READ_TIMEOUT_S + 1)  # the server's timer under test, not a speed
            rest = [line for line in lines if line]
    assert running == 1  # frozen mid-response, not after it
    assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:])["choices"][0] for line in [first, *rest[:-1]]]
    assert chunks[-1]["finish_reason"] == "length" and len(chunks) >= 2
