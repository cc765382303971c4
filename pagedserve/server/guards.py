"""What stands between a client and the routes.

ASGI middlewares refuse requests before a route reads them: a Host name a key-less server does
not answer (400), a missing or wrong API key (401), a body over the size limit (413), a body
that is not JSON or is compressed (415). Below ASGI, uvicorn's HTTP protocol
(``GuardedH11Protocol``) is given a read deadline, since uvicorn itself times out only idle
keep-alive connections (a client that sends half a head, or a Content-Length it never
delivers, would otherwise hold its socket for ever); OpenAI error bodies where uvicorn answers
in plain text; and half-closed connections.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import socket
from collections.abc import Iterable
from http import HTTPStatus

import h11
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.server.errors import (
    INVALID_REQUEST,
    REQUEST_TOO_LARGE,
    SERVER_ERROR,
    APIError,
    bad_request,
)
from pagedserve.server.protocol import ErrorInfo, ErrorResponse

REQUEST_TIMEOUT = "request_timeout"
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
INVALID_HOST = "invalid_host"
TOO_MANY_CONNECTIONS = "too_many_connections"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# How often a half-closed connection is checked for a reset, i.e. how soon a client that
# closed its socket (rather than only its sending side) after its request counts as gone.
PEER_CHECK_S = 0.5


class AllowedHosts:
    """Answers 400 to a request whose ``Host`` names none of ``hosts`` (with any port).

    A server with no API key on a loopback address is otherwise open to any web page: through
    a domain of its own that it makes resolve to 127.0.0.1 (DNS rebinding), the page's script
    reaches the server with that domain as the Host. A request without a Host (HTTP/1.0) is
    no browser's, so it passes.
    """

    def __init__(self, app: ASGIApp, hosts: Iterable[str]) -> None:
        self.app = app
        self.hosts = frozenset(host.lower() for host in hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = dict(scope["headers"]).get(b"host") if scope["type"] == "http" else None
        if host is not None and _host_name(host) not in self.hosts:
            error = bad_request(
                f"this server has no API key and answers only the Host names "
                f"{', '.join(sorted(self.hosts))} (against DNS rebinding), not "
                f"{host.decode('latin-1')!r}; start it with --allowed-hosts NAME or --api-key",
                code=INVALID_HOST)
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


# A Host header: a name or an IPv4 address, or a bracketed IPv6 address; then maybe a port.
_HOST = re.compile(rb"(\[[0-9a-f:.]*\]|[^:\[\]]*)(:[0-9]*)?", re.IGNORECASE)


def _host_name(host: bytes) -> str | None:
    """``[::1]:8000`` -> ``[::1]``, ``LocalHost`` -> ``localhost``; None if malformed."""
    match = _HOST.fullmatch(host.strip())
    return match.group(1).decode("latin-1").lower() if match else None


def route_path(scope: Scope) -> str:
    """The path the routes see: uvicorn puts ``--root-path`` in front of the request's, and
    Starlette's router takes it off again."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class BearerAuth:
    """Requires ``Authorization: Bearer <key>`` on every path but ``public`` ones; the scheme
    is case-insensitive (RFC 9110), the key is not."""

    def __init__(self, app: ASGIApp, api_key: str, public: Iterable[str]) -> None:
        self.app = app
        self.key = api_key.encode()
        self.public = frozenset(public)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in self.public \
                and scope["method"] != "OPTIONS":
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # Constant-time comparison: response timing must not reveal the key's prefix.
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                error = APIError(HTTPStatus.UNAUTHORIZED, "missing or incorrect API key; send "
                                 "'Authorization: Bearer <key>'", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """Answers 413 to a body over ``max_bytes``: at once when Content-Length says so, else as
    soon as the bytes read pass the cap (chunked uploads declare no length)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # FastAPI re-raises HTTPExceptions from body reading; our handler formats it.
                raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._message())
            return message

        await self.app(scope, counting_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes"

    def _too_large(self) -> APIError:
        return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._message(),
                        code=REQUEST_TOO_LARGE)


class JSONBodies:
    """Answers 415 to a POST whose Content-Type is not JSON, instead of the field errors
    FastAPI reports when it validates the raw bytes. No Content-Type is read as JSON, as
    OpenAI and vLLM read it (FastAPI would validate the raw bytes). A compressed body is a 415
    too (RFC 9110 15.5.16): nothing here decompresses, so no zip bomb inflates."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope["headers"])
            error = _unsupported_body(headers)
            if error is not None:
                await error.response()(scope, receive, send)
                return
            if b"content-type" not in headers:
                scope = {**scope,
                         "headers": [*scope["headers"], (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def _unsupported_body(headers: dict[bytes, bytes]) -> APIError | None:
    encoding = headers.get(b"content-encoding", b"identity")
    if encoding.strip().lower() != b"identity":
        return APIError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "the body must not be compressed: "
                        f"send it without 'Content-Encoding: {encoding.decode('latin-1')}'",
                        code=UNSUPPORTED_MEDIA_TYPE)
    content_type = headers.get(b"content-type")
    if content_type is not None and not _is_json(content_type):
        return APIError(
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "the body must be JSON: send "
            f"'Content-Type: application/json', not {content_type.decode('latin-1')!r}",
            code=UNSUPPORTED_MEDIA_TYPE)
    return None


def _is_json(content_type: bytes) -> bool:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json" or (
        media_type.startswith(b"application/") and media_type.endswith(b"+json"))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with what uvicorn lacks or answers in plain text.

    A read deadline. It starts when a connection opens or when the first byte of a request
    arrives, and stops when the request's body is complete; trickling bytes does not extend it.
    When it passes, a request whose head was read and that has no response yet gets a 408, and
    the connection is closed either way. An idle keep-alive connection is left to uvicorn's own
    keep-alive timeout.

    A write deadline. A client that stops reading (a stream it no longer wants, a stalled
    peer) fills the socket's buffers and then asyncio's, which pauses the writes; if they stay
    paused ``write_timeout`` seconds, the connection is dropped as a hang-up, so the handler
    aborts its request. Without it such a client held its connection, and a place under the
    cap, for good.

    A connection cap: over ``max_connections`` open connections (this one included), requests
    get a JSON 503. uvicorn's ``limit_concurrency`` counts the same but answers in text/plain.

    A malformed request gets a JSON 400, where uvicorn's is text/plain; so does one with both
    Content-Length and Transfer-Encoding, which h11 would read by its chunks and keep the
    connection open after, and the connection closes.

    Half-close: a client may shut its sending side once its request is sent and still read the
    answer. uvicorn takes the FIN for a hang-up; here the connection stays open to write the
    answer, and closes after it. A client that closed its socket outright sends the same FIN,
    so the peer is probed: bytes sent to a closed socket draw a reset, which marks ours with an
    error, and the connection is then dropped as a hang-up (the handler sees the disconnect
    and aborts its request). Until the response starts, the probe is a ``100 Continue``, which
    an HTTP/1.1 client accepts before any response (RFC 9110 15.2); after, the response's own
    bytes are. An HTTP/1.0 client, which must not be sent a 1xx, is taken as gone, as uvicorn
    takes it.

    Stopping: a stream still being written ends when the server is told to stop, rather than
    holding the shutdown for uvicorn's graceful timeout.
    """

    def __init__(self, *args, read_timeout: float, write_timeout: float, max_connections: int,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.max_connections = max_connections
        self._deadline: asyncio.TimerHandle | None = None
        self._write_stall: asyncio.TimerHandle | None = None
        self._half_closed = False
        self._peer_check: asyncio.TimerHandle | None = None
        self._app, self.app = self.app, self._guarded_app

    async def _guarded_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = self._refusal(scope)
        if error is None:
            await self._app(scope, receive, send)
            return
        response = error.response()
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    def _refusal(self, scope: Scope) -> APIError | None:
        names = {name for name, _ in scope["headers"]}
        if b"content-length" in names and b"transfer-encoding" in names:
            # h11 reads the chunks and would go on reading the connection after them; a proxy
            # that reads the Content-Length would take the rest for another request (request
            # smuggling, RFC 9112 6.3). uvicorn's httptools protocol refuses these too.
            return bad_request("a request must not have both Content-Length and "
                               "Transfer-Encoding headers")
        # /health is answered over the cap: a liveness probe must not restart a server that is
        # only busy, and its answer costs nothing.
        if len(self.connections) > self.max_connections and route_path(scope) != "/health":
            return APIError(HTTPStatus.SERVICE_UNAVAILABLE,
                            f"the server is at its limit of {self.max_connections} connections;"
                            " retry later", type=SERVER_ERROR, code=TOO_MANY_CONNECTIONS)
        return None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.read_timeout, self._expire)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def eof_received(self) -> bool | None:
        read = self.conn.their_state is h11.DONE and self.conn.their_http_version == b"1.1"
        if self.cycle is None or self.cycle.response_complete or not read:
            return None  # idle, mid-request or HTTP/1.0: taken as gone; the transport closes
        self._half_closed = True
        self._check_peer(probe=True)
        return True  # keep the transport open to write the answer

    def on_response_complete(self) -> None:
        super().on_response_complete()  # which starts a pipelined request, if one is read
        if self._half_closed and self.cycle.response_complete:
            self._stop_peer_check()
            self.transport.close()  # no request can follow
        self._follow_request()  # a pipelined request may be half read already

    def shutdown(self) -> None:
        """The server stopping: a response still streaming ends at once, as a hang-up (its
        handler aborts a foreground request; a background response runs on until the server
        stops it). uvicorn would wait up to its graceful timeout for the stream, then cancel
        the handler, which it logs as a traceback. A request not yet answered keeps that time
        to finish; idle connections close as uvicorn closes them."""
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.abort()  # connection_lost follows, as for any hang-up
        else:
            super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        self._stop_peer_check()
        self._stop_write_stall()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_stall is None:
            self._write_stall = self.loop.call_later(self.write_timeout, self._drop_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_write_stall()

    def _drop_stalled(self) -> None:
        self._write_stall = None
        if not self.transport.is_closing():
            self.transport.abort()  # connection_lost follows, as for any hang-up

    def _stop_write_stall(self) -> None:
        if self._write_stall is not None:
            self._write_stall.cancel()
            self._write_stall = None

    def send_400_response(self, msg: str) -> None:
        # What h11 found wrong does not reach here; uvicorn's msg says no more than this.
        self._send_error(HTTPStatus.BAD_REQUEST, "the request is not valid HTTP/1.1")
        self.transport.close()

    def _check_peer(self, probe: bool = False) -> None:
        """Drop a half-closed connection whose peer answered a probe with a reset."""
        self._peer_check = None
        if self.transport.is_closing():
            return
        if probe and self.conn.our_state is h11.SEND_RESPONSE:
            self.transport.write(self.conn.send(
                h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")))
        if self.transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET,
                                                              socket.SO_ERROR):
            self.transport.abort()  # connection_lost follows, as for any hang-up
            return
        self._peer_check = self.loop.call_later(PEER_CHECK_S, self._check_peer)

    def _stop_peer_check(self) -> None:
        if self._peer_check is not None:
            self._peer_check.cancel()
            self._peer_check = None

    def _follow_request(self) -> None:
        """Start the deadline when part of a request is in and the rest is not; stop it once
        the request is read (or the connection is done)."""
        state = self.conn.their_state
        reading = state is h11.SEND_BODY or (state is h11.IDLE
                                             and bool(self.conn.trailing_data[0]))
        if not reading:
            self._stop_deadline()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout, self._expire)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.SEND_BODY and self.conn.our_state is h11.SEND_RESPONSE:
            self._send_error(HTTPStatus.REQUEST_TIMEOUT, "the request was not received within "
                             f"{self.read_timeout:g} seconds", code=REQUEST_TIMEOUT)
        # The handler waiting for the body sees a disconnect, as when a client leaves.
        self.transport.close()

    def _send_error(self, status: HTTPStatus, message: str, code: str | None = None) -> None:
        """An OpenAI error written below ASGI, on a connection about to close."""
        body = ErrorResponse(error=ErrorInfo(message=message, type=INVALID_REQUEST, code=code)
                             ).model_dump_json().encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers,
                                   reason=status.phrase.encode()),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
