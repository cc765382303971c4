"""What stands between a client and the routes.

ASGI middlewares refuse requests before a route reads them: a missing or wrong API key (401),
a body over the size limit (413), a body that is not JSON (415). Below ASGI, uvicorn's HTTP
protocol is given a read deadline (``ReadDeadlineProtocol``), since uvicorn itself times out
only idle keep-alive connections: a client that sends half a head, or a Content-Length it never
delivers, would otherwise hold its socket for ever.
"""

from __future__ import annotations

import asyncio
import hmac
from http import HTTPStatus

import h11
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.server.errors import INVALID_REQUEST, REQUEST_TOO_LARGE, APIError
from pagedserve.server.protocol import ErrorInfo, ErrorResponse

REQUEST_TIMEOUT = "request_timeout"
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"


class BearerAuth:
    """Requires ``Authorization: Bearer <key>`` on paths under ``prefix``; the scheme is
    case-insensitive (RFC 9110), the key is not."""

    def __init__(self, app: ASGIApp, api_key: str, prefix: str) -> None:
        self.app = app
        self.key = api_key.encode()
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix) \
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
    FastAPI reads it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            content_type = dict(scope["headers"]).get(b"content-type")
            if content_type is not None and not _is_json(content_type):
                error = APIError(
                    HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "the body must be JSON: send "
                    f"'Content-Type: application/json', not {content_type.decode('latin-1')!r}",
                    code=UNSUPPORTED_MEDIA_TYPE)
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_json(content_type: bytes) -> bool:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json" or (
        media_type.startswith(b"application/") and media_type.endswith(b"+json"))


class ReadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for reading each request whole.

    The deadline starts when a connection opens or when the first byte of a request arrives,
    and stops when the request's body is complete; trickling bytes does not extend it. When it
    passes, a request whose head was read and that has no response yet gets a 408, and the
    connection is closed either way. An idle keep-alive connection is left to uvicorn's own
    keep-alive timeout.
    """

    def __init__(self, *args, read_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._deadline = self.loop.call_later(self.read_timeout, self._expire)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()  # a pipelined request may be half read already

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

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
            self._send_timeout()
        # The handler waiting for the body sees a disconnect, as when a client leaves.
        self.transport.close()

    def _send_timeout(self) -> None:
        body = ErrorResponse(error=ErrorInfo(
            message=f"the request was not received within {self.read_timeout:g} seconds",
            type=INVALID_REQUEST, code=REQUEST_TIMEOUT)).model_dump_json().encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=HTTPStatus.REQUEST_TIMEOUT, headers=headers,
                                   reason=b"Request Timeout"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
