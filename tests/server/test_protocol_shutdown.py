"""The server's h11 protocol when the server is told to stop (``GuardedH11Protocol.shutdown``):
a response still streaming ends at once, as a hang-up, instead of holding the shutdown for
uvicorn's graceful timeout and then being cancelled into a logged traceback; a connection
whose request has no response yet keeps its time, and an idle one closes as uvicorn closes
it. Checked on the protocol object with a recording transport."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

uvicorn = pytest.importorskip("uvicorn")

from uvicorn.server import ServerState  # noqa: E402

from pagedserve.server.guards import GuardedH11Protocol  # noqa: E402


class _Transport:
    """What the protocol asks of an asyncio transport, recording how it was ended."""

    def __init__(self) -> None:
        self.ended: str | None = None

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default)

    def abort(self) -> None:
        self.ended = "abort"

    def close(self) -> None:
        self.ended = self.ended or "close"

    def is_closing(self) -> bool:
        return self.ended is not None

    def write(self, data: bytes) -> None:
        pass

    def set_write_buffer_limits(self, *args) -> None:
        pass


async def _protocol_with(cycle) -> tuple[GuardedH11Protocol, _Transport]:
    async def app(scope, receive, send):
        pass

    config = uvicorn.Config(app, log_level="warning")
    config.load()
    protocol = GuardedH11Protocol(config=config, server_state=ServerState(),
                                  app_state={}, read_timeout=30.0, write_timeout=30.0,
                                  max_connections=8)
    transport = _Transport()
    protocol.connection_made(transport)
    protocol.cycle = cycle
    return protocol, transport


@pytest.mark.parametrize("cycle,ended,keep_alive", [
    (SimpleNamespace(response_started=True, response_complete=False, keep_alive=True),
     "abort", True),  # streaming: cut now
    (SimpleNamespace(response_started=False, response_complete=False, keep_alive=True),
     None, False),  # not answered yet: finishes, then the connection closes
    (SimpleNamespace(response_started=True, response_complete=True, keep_alive=True),
     "close", True),  # answered: closed at once, as uvicorn does
    (None, "close", None),  # idle
], ids=["streaming", "unanswered", "answered", "idle"])
def test_a_stopping_server_ends_streams_at_once_and_lets_requests_finish(cycle, ended,
                                                                         keep_alive):
    async def check():
        protocol, transport = await _protocol_with(cycle)
        protocol.shutdown()
        assert transport.ended == ended
        if cycle is not None:
            assert cycle.keep_alive is keep_alive
        protocol.cycle = None  # the stand-in cycle has no events for connection_lost to set
        protocol.connection_lost(None)  # stops the read deadline

    asyncio.run(check())
