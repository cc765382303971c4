"""The API server's handle on the engine-core process (``core_process``).

``start`` spawns the core and waits until its engine is up; from then on the server's event
loop sends commands (add, abort) on one ZeroMQ socket and a receiving task reads one
``CoreOutputs`` per engine step from another, adding each request's delta to the
``RequestOutput`` it keeps and waking that request's stream. Requests are checked here, with the
engine's own ``InputLimits.check``, before they are sent, so a bad one is refused without a
round trip.

Failure rules:
  * a request the core refuses, or whose step failed, ends its stream with an error; the
    others go on;
  * if the core process dies, every stream ends with ``EngineDeadError`` at once, and
    ``is_running`` turns False (``/health`` answers 503);
  * a stream closed before its request finished (client gone) aborts the request in the core,
    which frees its KV blocks.

Request ids are the caller's, free again once a request ends; the core knows each request by
the caller's id made unique here (``_Pending.core_id``), so that the outputs of one closed a
moment ago, still on their way, never reach a new request of the same id.

LoRA adapters: ``remove_lora`` tells the core to forget an adapter once no request of it is
in flight here (finished, failed or aborted), so requests already running on it finish first.

Sleep mode and the prefix-cache reset (``control``): a command with a call id, answered by
one ``ControlDone``; while the core sleeps, ``add_requests`` raises ``EngineSleepingError``
without sending (a request sent just before the sleep command is refused by the core, and
fails with the same error).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import multiprocessing
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import msgspec

from pagedserve.config import EngineConfig
from pagedserve.engine import core_messages as msg
from pagedserve.engine.core_process import CoreAddresses, run_engine_core
from pagedserve.engine.stats import EngineStats
from pagedserve.errors import EngineSleepingError
from pagedserve.logger import get_logger
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import InvalidSamplingParam

logger = get_logger(__name__)

_SHUTDOWN_TIMEOUT_S = 10.0
# The longest a command waits for the core's socket: a connected core takes it at once.
_SEND_TIMEOUT_MS = 2000


class EngineStartError(RuntimeError):
    """The engine core could not start; the message is one line."""


class EngineStepError(RuntimeError):
    """The engine failed while this request was in flight; the request was aborted."""


class EngineDeadError(RuntimeError):
    """The engine core is not running, so no request can be served."""


@dataclass(eq=False)
class _Pending:
    """A request in flight: the output built from its deltas, and its stream's queue."""

    output: RequestOutput
    core_id: str  # the id the core knows it by: the caller's, made unique
    lora_int_id: int | None = None  # its adapter, None: the base model
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class RequestStream:
    """Async iterator over one request's cumulative ``RequestOutput``, ending after the
    finished one. ``close()`` before the end aborts the request and frees its KV blocks."""

    def __init__(self, request_id: str, client: EngineCoreClient, queue: asyncio.Queue) -> None:
        self.request_id = request_id
        self.finished = False
        self._client = client
        self._queue = queue

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        # The output is updated in place, so items queued behind this one add nothing.
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._client.abort(self.request_id)


class CoreClient(Protocol):
    """What the API server uses of a model's engine: one core (``EngineCoreClient``), or
    replicas of it behind one face (``dp_client.DataParallelClient``)."""

    facts: msg.EngineFacts | None
    tokenizer: Any

    def start(self) -> None: ...

    def run_in(self, loop: asyncio.AbstractEventLoop) -> None: ...

    async def shutdown(self) -> None: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def dead_reason(self) -> str: ...

    @property
    def sleeping(self) -> bool: ...

    def add_requests(self, requests: Sequence[msg.NewRequest]) -> list[RequestStream]: ...

    def remove_lora(self, lora_int_id: int) -> None: ...

    def lora_in_use(self, lora_int_id: int) -> bool: ...

    async def control(self, make: Callable[[int], msg.Control]) -> msg.ControlDone: ...

    def engine_stats(self) -> list[EngineStats | None]:
        """Each engine's latest stats (None: none yet), in engine order (``/metrics``'
        ``engine`` label)."""
        ...


@dataclass(frozen=True)
class CoreLaunch:
    """What the API server resolves once for a model's engine cores: the config they run (the
    local folder the model id found: a GGUF converted, a hub model downloaded, under the name
    it would have had) and the folder the server's tokenizer loads from, which the cores read
    too (a hub id fetched once)."""

    config: EngineConfig
    tokenizer_path: Path

    @classmethod
    def of(cls, config: EngineConfig) -> CoreLaunch:
        from pagedserve.models import loader

        source = loader.resolve_model(config.model, config.load_format != "dummy",
                                      revision=config.revision, gguf_file=config.gguf_file)
        tokenizer_path = loader.tokenizer_folder(source, config.tokenizer,
                                                 config.tokenizer_revision)
        return cls(dataclasses.replace(
            config, model=str(source.path), revision=None, gguf_file=None,
            served_model_name=config.served_model_name or source.name,
            tokenizer=None if config.tokenizer is None else str(tokenizer_path),
            tokenizer_revision=None), tokenizer_path)

    def load_tokenizer(self) -> Any:
        from pagedserve.models import loader

        return loader.load_tokenizer(self.tokenizer_path, self.config.chat_template)


class EngineCoreClient:
    """``env``: variables the core process (and its tensor-parallel ranks) runs with on top of
    this process's environment, such as ``CUDA_VISIBLE_DEVICES`` to place it on a GPU."""

    def __init__(self, config: EngineConfig, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.env = dict(env or {})
        self.facts: msg.EngineFacts | None = None
        self.tokenizer = None
        self.stats: EngineStats | None = None  # the core's latest snapshot
        self._pending: dict[str, _Pending] = {}  # by the caller's id
        self._by_core_id: dict[str, _Pending] = {}
        self._core_ids = itertools.count()
        # Requests in flight per adapter, and the adapters to remove once theirs reach zero.
        self._lora_in_flight: Counter[int] = Counter()
        self._removing: set[int] = set()
        # Sleep mode: the calls awaiting their ``ControlDone``, and the core's latest state.
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.sleeping = False
        self._process: multiprocessing.Process | None = None
        self._ready: Connection | None = None  # the spawned core says on it when it is up
        self._ipc_dir: Path | None = None
        self._dead: str | None = None  # why the core is gone, once it is
        self._receiver: asyncio.Task | None = None
        # ZeroMQ, made in ``start``: a context, and the command (PUSH) and output (PULL) sockets.
        self._zmq = self._commands = self._outputs = None

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the core and block until its engine is ready; ``EngineStartError`` if it
        cannot start (bad model, device or flag). The API server's tokenizer loads while the
        core starts."""
        launch = CoreLaunch.of(self.config)
        self.spawn(launch.config)
        with ThreadPoolExecutor(1) as pool:
            # The core checks --tokenizer's files and vocabulary, and fails to start first.
            loading = pool.submit(launch.load_tokenizer)
            self.wait_ready()
            self.tokenizer = loading.result()

    def spawn(self, core_config: EngineConfig) -> None:
        """Start the core process on ``core_config`` (a ``CoreLaunch``'s) and return at once;
        ``wait_ready`` waits for its engine."""
        import zmq
        import zmq.asyncio

        self._ipc_dir = _socket_folder(getattr(zmq, "IPC_PATH_MAX_LEN", 103))
        addresses = CoreAddresses(*(f"ipc://{self._ipc_dir}/{name}" for name in _SOCKET_NAMES))
        self._zmq = zmq.asyncio.Context()
        self._commands = zmq.Context.shadow(self._zmq).socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # no queue limit: see _send
        self._commands.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._commands.bind(addresses.commands)
        self._outputs = self._zmq.socket(zmq.PULL)
        self._outputs.bind(addresses.outputs)
        # spawn, not fork: the child initialises its device runtime itself.
        spawn = multiprocessing.get_context("spawn")
        ready_reader, ready_writer = spawn.Pipe(duplex=False)
        self._process = spawn.Process(
            target=run_engine_core, args=(core_config, addresses, ready_writer),
            name="pagedserve-engine-core", daemon=True)
        with _environment(self.env):
            self._process.start()
        ready_writer.close()
        self._ready = ready_reader

    def wait_ready(self) -> None:
        """Block until the spawned core's engine is up; ``EngineStartError`` if it cannot
        start."""
        self.facts = self._wait_ready(self._ready)

    def kill(self) -> None:
        """End the core at once, however far its start got (another replica of the model
        failed to start): a ``wait_ready`` under way raises ``EngineStartError``."""
        if self._process is not None:
            self._process.kill()

    def _wait_ready(self, reader) -> msg.EngineFacts:
        while not reader.poll(0.5) and self._process.is_alive():
            pass
        try:
            message = msg.decode_core_message(reader.recv_bytes())
        except EOFError:  # it died before saying anything
            self._process.join()
            message = msg.CoreFailed(
                f"the engine core exited with code {self._process.exitcode} while starting")
        if isinstance(message, msg.CoreFailed):
            self._process.join()
            self._close_transport()
            raise EngineStartError(message.message)
        return message.facts

    def run_in(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start reading outputs, and watching the core, on the server's event loop."""
        self._receiver = loop.create_task(self._receive())
        loop.add_reader(self._process.sentinel, self._core_exited)

    async def shutdown(self) -> None:
        """Stop the core (politely, then by force) and fail what is still in flight."""
        if self._process is None:
            return
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._mark_dead("the server is shutting down")
        if self._process.is_alive():
            with contextlib.suppress(EngineDeadError):  # then it is exiting already
                self._send(msg.Shutdown())
            await asyncio.to_thread(self._process.join, _SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join)
        if self._receiver is not None:
            self._receiver.cancel()
        self._close_transport()

    def _close_transport(self) -> None:
        """Once only: a core that failed to start closed it already when it is shut down
        with the other replicas of its model."""
        if self._zmq is None:
            return
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._zmq.term()
        self._zmq = None
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._process is not None and self._process.is_alive()

    @property
    def dead_reason(self) -> str:
        return self._dead or "it has not started"

    @property
    def num_in_flight(self) -> int:
        """Engine requests sent and not yet ended (finished, failed or aborted)."""
        return len(self._pending)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._pending

    def engine_stats(self) -> list[EngineStats | None]:
        """The core's latest stats snapshot (None before its first step), as the only engine
        of ``CoreClient.engine_stats``."""
        return [self.stats]

    # ---- requests -----------------------------------------------------------------------
    def add_requests(self, requests: Sequence[msg.NewRequest]) -> list[RequestStream]:
        """Check every request, then send them in one command so the core admits them in
        the same step. Raises ``ValueError`` (nothing sent) if any is refused.

        The requests are kept only once the send succeeded, so that a send that fails keeps
        nothing; no output can arrive in between, as nothing here awaits."""
        if not self.is_running:
            raise EngineDeadError(self._dead or "the engine is not running")
        if self.sleeping:
            raise EngineSleepingError(f"the model {self.facts.model_name!r} is asleep "
                                      "(sleep mode): POST /wake_up first")
        ids: set[str] = set()
        for r in requests:
            if r.request_id in self._pending or r.request_id in ids:
                raise ValueError(f"request id {r.request_id!r} is already in use")
            ids.add(r.request_id)
            self.facts.limits.check(r.prompt_token_ids, r.engine_params)
            self.facts.limits.check_priority(r.priority)
            if r.lora_request is not None and r.lora_request.lora_int_id in self._removing:
                raise ValueError(f"LoRA adapter {r.lora_request.lora_name} is being removed")
        pending = [_Pending(RequestOutput(r.request_id, None, r.prompt_token_ids, None, [],
                                          finished=False),
                            f"{r.request_id}#{next(self._core_ids)}",
                            r.lora_request and r.lora_request.lora_int_id) for r in requests]
        self._send(msg.AddRequests([msgspec.structs.replace(r, request_id=p.core_id)
                                    for r, p in zip(requests, pending, strict=True)]))
        self._pending.update((p.output.request_id, p) for p in pending)
        self._by_core_id.update((p.core_id, p) for p in pending)
        self._lora_in_flight.update(p.lora_int_id for p in pending if p.lora_int_id)
        return [RequestStream(p.output.request_id, self, p.queue) for p in pending]

    def abort(self, request_id: str) -> None:
        pending = self._pending.get(request_id)
        if pending is None:
            return
        if self.is_running:  # first: the core must abort it before it removes its adapter
            with contextlib.suppress(EngineDeadError):  # a core that is gone aborts nothing
                self._send(msg.AbortRequests([pending.core_id]))
        self._forget(pending)

    def remove_lora(self, lora_int_id: int) -> None:
        """Have the core forget an adapter as soon as none of its requests is in flight (at
        once if none is); no request of it may be added meanwhile."""
        self._removing.add(lora_int_id)
        self._remove_if_idle(lora_int_id)

    def lora_in_use(self, lora_int_id: int) -> bool:
        """Whether the core may still hold the adapter of this id: requests of it are in
        flight, or it waits for them to end before it is removed."""
        return lora_int_id in self._removing or self._lora_in_flight[lora_int_id] > 0

    def _forget(self, pending: _Pending) -> None:
        """Stop tracking a request (finished, failed or aborted); the last of an adapter
        being removed lets its removal go to the core (after the abort, if it is one)."""
        del self._pending[pending.output.request_id], self._by_core_id[pending.core_id]
        if pending.lora_int_id is not None:
            self._lora_in_flight[pending.lora_int_id] -= 1
            self._remove_if_idle(pending.lora_int_id)

    def _remove_if_idle(self, lora_int_id: int) -> None:
        if lora_int_id in self._removing and self._lora_in_flight[lora_int_id] <= 0:
            del self._lora_in_flight[lora_int_id]
            self._removing.discard(lora_int_id)
            if self.is_running:
                with contextlib.suppress(EngineDeadError):  # a core that is gone holds none
                    self._send(msg.RemoveLoRA(lora_int_id))

    async def control(self, make: Callable[[int], msg.Control]) -> msg.ControlDone:
        """Send the control command ``make(call_id)`` and wait for the core's answer;
        ``EngineDeadError`` if the core is or goes away meanwhile."""
        if not self.is_running:
            raise EngineDeadError(self._dead or "the engine is not running")
        call_id = next(self._call_ids)
        done = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(make(call_id))
            return await done
        finally:
            self._calls.pop(call_id, None)

    def _send(self, command: msg.Command) -> None:
        """Queue ``command``. With no high-water mark a send waits only while no core is
        connected: for the moment a starting core's connection takes, and never more than
        ``_SEND_TIMEOUT_MS``, so a core that is exiting (its socket closed, its process not
        yet reaped) cannot hang the server's event loop for good."""
        import zmq

        try:
            self._commands.send(msg.encode(command))
        except zmq.Again:
            raise EngineDeadError(self._dead or "the engine core is not taking commands") from None

    # ---- outputs ------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            message = msg.decode_core_message(await self._outputs.recv())
            if isinstance(message, msg.ControlDone):
                self._answer(message)
            else:
                self._dispatch(message)

    def _answer(self, done: msg.ControlDone) -> None:
        self.sleeping = done.sleeping
        call = self._calls.get(done.call_id)
        if call is not None and not call.done():
            call.set_result(done)

    def _dispatch(self, message: msg.CoreOutputs) -> None:
        for delta in message.outputs:
            pending = self._by_core_id.get(delta.request_id)
            if pending is None:
                continue  # aborted meanwhile
            pending.output.add_delta(delta)
            pending.queue.put_nowait(pending.output)
            if delta.finished:
                self._forget(pending)
        for failure in message.failures:
            pending = self._by_core_id.get(failure.request_id)
            if pending is not None:
                self._forget(pending)
                pending.queue.put_nowait(_failure_error(failure))
        self.stats = message.stats

    def _core_exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._process.join()  # it has exited: this only collects the exit code
        logger.error("the engine core process exited (code %s); failing %d requests",
                     self._process.exitcode, len(self._pending))
        self._mark_dead(f"the engine core process of {self.facts.model_name!r} exited with "
                        f"code {self._process.exitcode}")

    def _mark_dead(self, reason: str) -> None:
        self._dead = self._dead or reason
        pending, self._pending, self._by_core_id = self._pending, {}, {}
        self._lora_in_flight.clear()
        self._removing.clear()
        for p in pending.values():
            p.queue.put_nowait(EngineDeadError(self._dead))
        for call in self._calls.values():
            if not call.done():
                call.set_exception(EngineDeadError(self._dead))


# Temporary folders to try, in order, for the sockets' folder (None: TMPDIR's, Python's
# default); those of multiprocessing, which falls back the same way.
_SOCKET_BASES = (None, "/tmp", "/var/tmp", "/usr/tmp")
_SOCKET_NAMES = ("commands", "outputs")


def _socket_folder(max_path: int) -> Path:
    """A new private folder for the core's Unix sockets, under the first temporary folder
    that leaves their paths within ``max_path`` bytes (the OS's ``sun_path``, 107 on Linux):
    a long TMPDIR (a test's tmp_path, macOS's /var/folders/...) made the bind fail."""
    longest = len("/pagedserve-12345678/") + max(map(len, _SOCKET_NAMES))
    for base in _SOCKET_BASES:
        folder = tempfile.gettempdir() if base is None else base
        if len(os.fsencode(folder)) + longest <= max_path and os.access(folder, os.W_OK):
            return Path(tempfile.mkdtemp(prefix="pagedserve-", dir=folder))
    raise EngineStartError(
        f"no temporary folder leaves room for the engine's Unix sockets ({max_path} bytes); "
        f"TMPDIR {tempfile.gettempdir()!r} is too long: set a shorter one")


@contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with ``env`` added for the block's length: the spawn start
    method execs the child with it, so the core's interpreter starts with ``env`` set, before
    any device runtime reads it. Nothing else reads the environment meanwhile: cores start
    before the server does, one after another."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _failure_error(failure: msg.RequestFailure) -> Exception:
    if failure.kind == "asleep":
        return EngineSleepingError(failure.message)
    if failure.kind == "invalid":
        return InvalidSamplingParam(failure.param, failure.message) if failure.param \
            else ValueError(failure.message)
    return EngineStepError(failure.message)
