"""Every rank but the driver's as a process on this host, one per device (rank r takes
device r).

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
from pagedserve.distributed import Layout
from pagedserve.worker.model_runner import StepInput
from pagedserve.worker.worker import Worker, WorkerSpec

_STOP_TIMEOUT_S = 5.0


def driver_ip() -> str:
    return "127.0.0.1"


def ranks_on_host(size: int) -> int:
    return size


def start(config: EngineConfig, dist_address: str, layer_split: tuple[int, ...]) -> MpRanks:
    return MpRanks(config, dist_address, layer_split)


class MpRanks:
    def __init__(self, config: EngineConfig, dist_address: str,
                 layer_split: tuple[int, ...]) -> None:
        self.layout = Layout(config.tensor_parallel_size, config.pipeline_parallel_size)
        self.ranks = self.layout.others()  # procs[i] and conns[i] are rank ranks[i]
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._answers: dict[int, str | None] = {}  # index -> None (started) or why not
        for rank in self.ranks:
            ours, theirs = socket.socketpair()
            fd = theirs.fileno()
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "pagedserve.executor.mp", str(fd)], pass_fds=(fd,)))
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(WorkerSpec(config, rank, dist_address, rank, self.layout.size,
                                 layer_split))
            self.conns.append(conn)

    def driver_device_index(self) -> int:
        return self.layout.driver  # rank r takes device r

    def wait_ready(self) -> None:
        for i, proc in enumerate(self.procs):
            while i not in self._answers and proc.poll() is None:
                self.conns[i].poll(0.5)
                self._read_answer(i)
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
            for i, proc in enumerate(self.procs):
                exited = proc.poll() is not None  # before the read: its answer came first
                failed = self._read_answer(i)
                if failed is not None:
                    return failed
                if exited:
                    return (f"{self.layout.name(self.ranks[i])} (pid {proc.pid}) exited with "
                            f"code {proc.returncode}")
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _read_answer(self, i: int) -> str | None:
        """Why the ``i``-th rank could not start; None if it started or has not answered."""
        if i not in self._answers:
            try:
                if self.conns[i].poll(0):
                    status, message = self.conns[i].recv()
                    self._answers[i] = (None if status == "ready" else
                                        f"{self.layout.name(self.ranks[i])} failed: {message}")
            except (EOFError, OSError):
                pass  # gone without an answer
        return self._answers.get(i)

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
