"""The engine behind the HTTP server: one thread steps ``LLMEngine`` while asyncio handlers
submit requests and read their outputs.

``LLMEngine`` is not thread-safe, so the engine thread is the only one that touches it.
Handlers put commands (add, abort) on a queue the thread drains between steps; the thread hands
outputs back with ``loop.call_soon_threadsafe``, one call per event loop per step. The event loop
never waits on the model, and the model never waits on the event loop.

Requests added together (``add_requests``: the prompts of one API request) travel as one
command, so they all enter the engine in the same step, as do all commands queued during a step.

Failure rules:
  * a rejected request (bad prompt, bad parameters) fails only its own ``add_requests`` call,
    and none of the requests of that call runs;
  * an exception inside ``step`` aborts every request in flight (their blocks go back to the
    pool), each stream raises ``EngineStepError``, and the thread keeps serving new requests;
  * a stream closed before its request finished (client gone) aborts the request.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.stats import EngineStats
from pagedserve.logger import get_logger
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = get_logger(__name__)

# A command runs on the engine thread; None asks the thread to stop.
Command = Callable[[], None] | None


class EngineStepError(RuntimeError):
    """The engine failed while this request was in flight; the request was aborted."""


class EngineDeadError(RuntimeError):
    """The engine thread is not running, so no request can be served."""


class NewRequest(NamedTuple):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams


@dataclass(frozen=True, eq=False)
class _Sink:
    """Where one request's outputs go: a queue that belongs to the handler's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class RequestStream:
    """Async iterator over one request's cumulative ``RequestOutput``s, ending after the
    finished one. ``close()`` before the end aborts the request and frees its KV blocks."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine, q: asyncio.Queue) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue = q

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        # Outputs are cumulative, so a reader that fell behind only needs the newest one.
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # Latest counters, replaced (never mutated) by the engine thread after each iteration.
        self.stats: EngineStats = engine.stats()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)

    # ---- event-loop side ----------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        if self.is_running:
            self._commands.put(None)
            self._thread.join(timeout)

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams) -> RequestStream:
        """Queue a request; returns once the engine accepted it, raises what it rejected
        it with (``ValueError`` for bad input)."""
        return (await self.add_requests([NewRequest(request_id, prompt, params)]))[0]

    async def add_requests(self, requests: list[NewRequest]) -> list[RequestStream]:
        """Queue requests that enter the engine together (in the same step); returns once the
        engine accepted all of them. If it rejects one, none of them runs and this raises
        what it rejected it with."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        sinks = [_Sink(loop, asyncio.Queue()) for _ in requests]
        self._commands.put(partial(self._add, requests, sinks, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            # The client left while we waited; these aborts are queued behind the add.
            for request in requests:
                self.abort(request.request_id)
            raise
        return [RequestStream(r.request_id, self, sink.queue)
                for r, sink in zip(requests, sinks, strict=True)]

    def abort(self, request_id: str) -> None:
        self._commands.put(partial(self._abort, request_id))

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine thread started")
        while True:
            commands = self._next_commands()
            for command in commands:
                if command is None:
                    self._fail_all(EngineDeadError("the server is shutting down"))
                    return
                try:
                    command()
                except Exception:  # a bad command must not take the thread down
                    logger.exception("engine command failed")
            if self.engine.has_unfinished_requests():
                self._step()
            self.stats = self.engine.stats()

    def _next_commands(self) -> list[Command]:
        """Every queued command; waits for the first one only while the engine is idle."""
        commands = [] if self.engine.has_unfinished_requests() else [self._commands.get()]
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, requests: list[NewRequest], sinks: list[_Sink],
             accepted: asyncio.Future) -> None:
        loop = accepted.get_loop()
        added: list[str] = []
        try:
            for r in requests:
                self.engine.add_request(r.prompt, r.params, r.request_id)
                added.append(r.request_id)
        except Exception as exc:  # any rejection belongs to these requests alone
            for request_id in added:
                self.engine.abort_request(request_id)
            _call_soon(loop, _settle, accepted, exc)
            return
        for r, sink in zip(requests, sinks, strict=True):
            self._sinks[r.request_id] = sink
        _call_soon(loop, _settle, accepted, None)

    def _abort(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; aborting the %d requests in flight",
                             len(self._sinks))
            self._fail_all(EngineStepError(f"the engine failed while running this request: "
                                           f"{type(exc).__name__}: {exc}"))
            return
        deliveries = []
        for output in outputs:
            sink = self._sinks.pop(output.request_id, None) if output.finished \
                else self._sinks.get(output.request_id)
            if sink is not None:
                deliveries.append((sink, output))
        self._deliver(deliveries)

    def _fail_all(self, error: Exception) -> None:
        """Abort every request in flight and hand each stream the error."""
        sinks, self._sinks = self._sinks, {}
        for request_id in sinks:
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("could not abort request %s", request_id)
        self._deliver([(sink, error) for sink in sinks.values()])

    def _deliver(self, deliveries: list[tuple[_Sink, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for sink, item in deliveries:
            by_loop[sink.loop].append((sink.queue, item))
        for loop, batch in by_loop.items():
            _call_soon(loop, _put_all, batch)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the loop is closed: nobody is listening any more


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
