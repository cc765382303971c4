"""What a background response (``background: true``) runs with once its request has been
answered: the task that writes it, and, for one created with ``stream`` too, its stream's
events, kept so that a client can read them from any point while they come and after
(``GET /v1/responses/{id}?stream=true&starting_after=N``, as in vLLM and OpenAI).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedserve.server.serving_models import TimedStream


@dataclass
class EventLog:
    """A stream's events (SSE bytes), the n-th of sequence number n, and whether more may
    come."""

    events: list[bytes] = field(default_factory=list)
    closed: bool = False
    # Set, and replaced by a fresh one, at each change: a reader waits on the one it saw.
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def append(self, event: bytes) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    async def after(self, sequence_number: int) -> AsyncIterator[bytes]:
        """The events past ``sequence_number`` (-1: all), as they come, until the log
        closes."""
        sent = sequence_number + 1
        while True:
            changed = self._changed
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.closed:
                return
            await changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


@dataclass(frozen=True)
class BackgroundRun:
    """A running background response. ``stop`` ends it from outside (cancel, delete, the
    store dropping it, shutdown): once stopped, the task writes nothing more to the store."""

    task: asyncio.Task
    # Closed here as well as by the task: a task cancelled before its first step runs none
    # of its ``finally`` blocks, and the engine request must still be aborted.
    stream: TimedStream
    events: EventLog | None

    def stop(self) -> None:
        self.task.cancel()
        self.stream.close()
        if self.events is not None:
            self.events.close()

    async def stopped(self) -> None:
        """Stop it and wait until its task has ended (its engine request aborted)."""
        self.stop()
        await asyncio.wait({self.task})
