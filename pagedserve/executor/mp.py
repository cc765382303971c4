"""Ranks 1 .. N-1 as processes on this host, one per device.

Each rank is a fresh interpreter (``python -m pagedserve.executor.mp FD``, so it works from the
engine-core process, which as a daemon may not use ``multiprocessing`` children) that talks to
the driver over a private socket pair: the driver sends its ``WorkerSpec`` and then one pickled
``StepInput`` per step, with no reply; the rank answers once, when its model is built. A rank
exits when the driver's end closes, so a killed driver leaves none behind.
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection

from pagedserve.config import EngineConfig
from pagedserve.worker.model_runner import StepInput
from pagedserve.worker.worker import Worker, WorkerSpec

_STOP_TIMEOUT_S = 5.0


def driver_ip() -> str:
    return "127.0.0.1"


def ranks_on_host(size: int) -> int:
    return size


def start(config: EngineConfig, dist_address: str) -> MpRanks:
    return MpRanks(config, dist_address)


class MpRanks:
    def __init__(self, config: EngineConfig, dist_address: str) -> None:
        size = config.tensor_parallel_size
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._answers: dict[int, str | None] = {}  # rank -> None (started) or why not
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            fd = theirs.fileno()
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "pagedserve.executor.mp", str(fd)], pass_fds=(fd,)))
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(WorkerSpec(config, rank, dist_address, rank, size))
            self.conns.append(conn)

    def driver_device_index(self) -> int:
        return 0  # rank r takes device r

    def wait_ready(self) -> None:
        for rank, proc in enumerate(self.procs, 1):
            while rank not in self._answers and proc.poll() is None:
                self.conns[rank - 1].poll(0.5)
                self._read_answer(rank)
        reason = self.dead_reason()
        if reason is not None:
            raise RuntimeError(reason)

    def send(self, step: StepInput) -> None:
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def dead_reason(self, wait_s: float = 0.0) -> str | None:
        """A rank that answered it could not start counts as gone before it exits: the
        driver, waiting for it to join, hears its reason at once."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, 1):
                exited = proc.poll() is not None  # before the read: its answer came first
                failed = self._read_answer(rank)
                if failed is not None:
                    return failed
                if exited:
                    return (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                            f"{proc.returncode}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _read_answer(self, rank: int) -> str | None:
        """Why the rank could not start; None if it started or has not answered."""
        if rank not in self._answers:
            try:
                if self.conns[rank - 1].poll(0):
                    status, message = self.conns[rank - 1].recv()
                    self._answers[rank] = (None if status == "ready" else
                                           f"tensor-parallel rank {rank} failed: {message}")
            except (EOFError, OSError):
                pass  # gone without an answer
        return self._answers.get(rank)

    def stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass  # already gone

    def shutdown(self) -> None:
        self.stop()  # a second stop finds the ranks gone or still leaving: harmless
        for proc in self.procs:
            try:
                proc.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()


def _serve(conn: Connection) -> int:
    """A rank's life: build, report, then run every step the driver sends until told to
    stop (None) or the driver is gone. An error in a step ends the process, so the driver's
    collective breaks instead of waiting on this rank."""
    try:
        spec: WorkerSpec = conn.recv()
    except Exception as exc:  # e.g. a logits processor class this process cannot import
        conn.send(("failed", f"cannot read the engine's options: {type(exc).__name__}: {exc}"))
        return 1
    try:
        worker = Worker(spec)
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", None))
    while True:
        try:
            step = pickle.loads(conn.recv_bytes())
        except EOFError:  # the driver is gone: leave without waiting for it
            worker.leave(peers_alive=False)
            return 0
        if step is None:
            worker.leave()
            return 0
        worker.runner.follow(step)


if __name__ == "__main__":
    sys.exit(_serve(Connection(int(sys.argv[1]))))
