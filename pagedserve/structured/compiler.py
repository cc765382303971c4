"""Grammar compilation in worker processes, cached by spec, so the step loop never waits for
it: a request's ``Future`` is polled each step and the request is scheduled once it is done.

Why processes: xgrammar's native compile cannot be interrupted, and a thread running it cannot
be stopped, so one hostile schema (a few KB of bounded strings compiles for half a minute)
would hold a thread, and a core, for as long as it likes. Here each compile runs in a worker
process, one compile at a time, which is killed when the compile exceeds its time budget or
when no request waits for it any more (the requester left); a fresh worker takes its place.
Several workers run side by side, so a slow grammar never queues the others behind it.

The grammar is parsed here (``to_grammar``: bad input fails at once, with the library's
message) and crosses to the worker as EBNF text; the compiled grammar comes back as
xgrammar's JSON serialization.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from pagedserve.logger import get_logger
from pagedserve.sampling_params import InvalidSamplingParam
from pagedserve.structured.spec import GrammarSpec, to_grammar

logger = get_logger(__name__)

MAX_CACHED_GRAMMARS = 512


class GrammarTooSlow(InvalidSamplingParam):
    """The grammar did not compile within ``--max-grammar-compile-seconds``."""


@dataclass(eq=False)
class _Job:
    spec: GrammarSpec
    future: Future = field(default_factory=Future)
    waiters: int = 1  # requests that asked for it and have not left
    worker: _Worker | None = None  # while it compiles


class GrammarCompilerPool:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int], *,
                 num_workers: int, timeout_s: float) -> None:
        """``vocab_size`` is the logits' width: ids past the tokenizer's own vocabulary (a
        padded embedding) are never allowed."""
        import xgrammar as xgr

        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self._info_json = self._info.serialize_json()
        self._timeout_s = timeout_s
        self._lock = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: dict[Future, _Job] = {}  # asked for and not compiled yet
        # Least recently asked first; a server fed ever new schemas keeps only the latest.
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, name=f"grammar-compile-{i}",
                                          daemon=True) for i in range(num_workers)]
        for thread in self._threads:
            thread.start()

    def get(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of ``spec`` (an xgrammar ``CompiledGrammar``), as a future
        shared by every request that asks for the same spec. Each call counts as one waiter
        until the future is done or ``release`` is called."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                if future in self._running:
                    self._running[future].waiters += 1
                return future
            job = _Job(spec)
            self._running[job.future] = job
            self._queue.append(job)
            self._cache[spec] = job.future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)  # requests holding its future keep it
            self._lock.notify()
            return job.future

    def release(self, future: Future) -> None:
        """A request waiting on ``future`` (from ``get``) left. The last one to leave cancels
        the compile: dropped from the queue, or its worker killed."""
        with self._lock:
            job = self._running.get(future)
            if job is None:
                return  # compiled already
            job.waiters -= 1
            if job.waiters > 0:
                return
            del self._running[future]
            if self._cache.get(job.spec) is future:
                del self._cache[job.spec]
            future.cancel()
            if job.worker is not None:
                job.worker.kill()  # its thread starts a fresh one
            else:
                self._queue.remove(job)

    @property
    def num_compiling(self) -> int:
        """Grammars asked for and not compiled yet (queued or running)."""
        with self._lock:
            return len(self._running)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for job in self._running.values():
                if job.worker is not None:
                    job.worker.kill()
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()

    # ---- the worker threads, one per process --------------------------------------------
    def _serve(self) -> None:
        worker = None
        while True:
            # Started before the next job arrives, so that its start-up is not timed.
            worker = worker or _Worker(self._info_json)
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    break
                job = self._queue.popleft()
                job.worker = worker
            if not self._compile(job, worker):
                worker.kill()
                worker = None
        worker.kill()

    def _compile(self, job: _Job, worker: _Worker) -> bool:
        """Compile ``job`` on ``worker`` and settle its future; False if the worker must go
        (killed by ``release``, timed out, or died)."""
        try:
            ebnf = str(to_grammar(job.spec))
            reply = worker.compile(ebnf, self._timeout_s)
        except Exception as exc:  # noqa: BLE001 - the request fails alone, with the reason
            self._settle(job, exc=exc)
            return True
        if reply is _TIMED_OUT:
            self._settle(job, exc=GrammarTooSlow(
                "structured_outputs", f"the {job.spec.kind} grammar did not compile within "
                f"{self._timeout_s:g} s (--max-grammar-compile-seconds); simplify it, for "
                "example with fewer bounded strings (maxLength) or a smaller schema"))
            return False
        if reply is None:
            self._settle(job, exc=RuntimeError("the grammar compile worker died"))
            return False
        ok, payload = reply
        if not ok:
            self._settle(job, exc=RuntimeError(payload))
            return True
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(payload, self._info)
        if _accepts_nothing(compiled):
            self._settle(job, exc=InvalidSamplingParam(
                "structured_outputs", f"the {job.spec.kind} grammar accepts no output: no "
                "text satisfies it (for example a schema whose $ref only refers to itself, or "
                "a regex that matches nothing)"))
        else:
            self._settle(job, result=compiled)
        return True

    def _settle(self, job: _Job, result=None, exc: BaseException | None = None) -> None:
        with self._lock:
            job.worker = None
            if self._running.pop(job.future, None) is None:
                return  # released meanwhile: its future is cancelled
            if exc is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(exc)


_TIMED_OUT = object()


def _accepts_nothing(compiled) -> bool:
    """Whether no first token, not even a stop token, is allowed: the grammar's language is
    empty, and a request would sample from a mask of nothing."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any()) and not matcher.is_terminated()


class _Worker:
    """One child interpreter compiling one grammar at a time. A fresh ``python -m`` rather
    than multiprocessing's spawn, which would re-run the user's main script in the child, or a
    fork, which would copy the engine's device runtime and threads half-locked."""

    def __init__(self, info_json: str) -> None:
        parent, child = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.structured.compiler", str(child.fileno())],
            pass_fds=[child.fileno()], stdin=subprocess.DEVNULL)
        child.close()
        self._conn = Connection(parent.detach())
        try:
            self._conn.send(info_json)
            self._conn.recv()  # ready
        except (EOFError, OSError):
            pass  # it died starting: its first compile reports that

    def compile(self, ebnf: str, timeout_s: float):
        """``(ok, serialized grammar or error message)``; ``_TIMED_OUT``; None if the
        process died (or was killed)."""
        try:
            self._conn.send(ebnf)
            if not wait([self._conn], timeout_s):
                return _TIMED_OUT
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    @property
    def pid(self) -> int:
        return self._process.pid

    def kill(self) -> None:
        self._process.kill()
        self._process.wait()
        self._conn.close()


def _worker_main(fd: int) -> None:
    import xgrammar as xgr

    conn = Connection(fd)
    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    # One thread: the worker is one of several; the cache is the parent's (bounded).
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(True)
    while True:
        try:
            ebnf = conn.recv()
        except EOFError:
            return  # the engine is gone
        try:
            conn.send((True, compiler.compile_grammar(ebnf).serialize_json()))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the job
            conn.send((False, str(exc)))


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
