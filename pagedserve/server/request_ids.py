"""``--enable-request-id-headers`` (vLLM's): every response carries ``X-Request-Id``, the
client's own when its request sent one, else the id the server made for it; a completion's
id is then made of the client's."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import random_id

HEADER = b"x-request-id"
MAX_LENGTH = 128
# Printable ASCII: the id goes into the response's header, the logs and the response's id.
_VALID = re.compile(rb"[\x20-\x7e]{1,%d}" % MAX_LENGTH)
# Where the middleware leaves the client's id for the route, and the route its own id.
_CLIENT_ID = "client_request_id"
_MADE_ID = "request_id"


class RequestIdHeaders:
    """Echoes the request's id in ``X-Request-Id``, on every response, streams included (the
    header goes out with the first bytes); a malformed one sent is a 400."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(HEADER)
        # The same dict the route's ``request.state`` reads and writes.
        state = scope.setdefault("state", {})

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                echoed = sent or state.get(_MADE_ID, uuid.uuid4().hex).encode("ascii")
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (HEADER, echoed)]}
            await send(message)

        if sent is not None and not _VALID.fullmatch(sent):
            sent = None  # its refusal carries an id the server made, as every response does
            error = bad_request(f"the X-Request-Id header must be 1 to {MAX_LENGTH} printable "
                                "ASCII characters", code="invalid_request_id")
            await error.response()(scope, receive, send_with_id)
            return
        if sent is not None:
            state[_CLIENT_ID] = sent.decode("ascii")
        await self.app(scope, receive, send_with_id)


@dataclass(frozen=True)
class RequestIds:
    """A completion's ids: ``response`` in its body (``prefix-`` and the client's
    X-Request-Id, as vLLM's, else a random one), ``engine`` its engine requests' (unique among
    those in flight: two clients may send the same id)."""

    response: str
    engine: str

    @classmethod
    def of(cls, raw: Request, prefix: str, sep: str = "-") -> RequestIds:
        """The ids of the request ``raw``, recorded for ``RequestIdHeaders`` to echo
        (``sep`` after the prefix: the Responses API's ids are ``resp_...``)."""
        client_id = getattr(raw.state, _CLIENT_ID, None)
        if client_id is None:
            made = random_id(prefix, sep)
            ids = cls(made, made)
        else:
            response = f"{prefix}{sep}{client_id}"
            ids = cls(response, f"{response}-{uuid.uuid4().hex[:8]}")
        setattr(raw.state, _MADE_ID, ids.response)
        return ids
