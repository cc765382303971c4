"""A real ``pagedserve serve`` in a subprocess, on a tiny random-weight model with a chat
template, and the offline engine on the same model for reference outputs."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

import httpx
import pytest

from tests.tiny_models import write_tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MAX_MODEL_LEN = 4096
KV_BYTES = 4 << 20
# A request meant to outlive its client: thousands of steps, each of which costs any machine far
# more than the moment between a test seeing the request run and hanging up.
LONG_TOKENS = MAX_MODEL_LEN - 96
# Generous: other processes may share the two cores with the test run.
STARTUP_TIMEOUT_S = 180
PORT_ATTEMPTS = 3
PORT_TAKEN = f"--port {{}}: {os.strerror(errno.EADDRINUSE)}"  # the server's own error line
HTTP_TIMEOUT_S = 120
# Fixtures that start a server subprocess (seconds each, once per session or module).
SERVER_FIXTURES = {"server", "ahead_server", "served", "keyed_server", "smol", "embed_server",
                   "priority_server"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that talks to a server subprocess is marked slow: ``-m "not slow"`` leaves
    the servers unstarted."""
    for item in items:
        if SERVER_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def engine_kwargs() -> dict:
    """What the server runs with, for building the matching offline LLM."""
    return dict(device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused",
                      max_retries=0, timeout=HTTP_TIMEOUT_S)

    def async_client(self):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused",
                           max_retries=0, timeout=HTTP_TIMEOUT_S)

    def post(self, path: str, **kwargs) -> httpx.Response:
        kwargs.setdefault("timeout", HTTP_TIMEOUT_S)
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, **kwargs)

    def metrics(self, model: str | None = None, engine: int | None = None) -> dict[str, float]:
        """One model's samples (``model``: its name; None: a server of one model), by name,
        and request_finished_total by reason, e.g.
        ``{"num_requests_running": 0.0, "request_finished_total{abort}": 2.0}``. Engine state
        is one data-parallel replica's (``engine``: its index), or the sum over them (None;
        with one engine, its own)."""
        text = httpx.get(f"{self.url}/metrics", timeout=HTTP_TIMEOUT_S).text
        values = {}
        for name, labels, v in re.findall(r"^pagedserve:(\w+)\{(.*)\} (\S+)$", text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if model is not None and labels.pop("model_name") != model:
                continue
            labels.pop("model_name", None)
            if engine is not None and labels.get("engine", str(engine)) != str(engine):
                continue
            labels.pop("engine", None)
            if labels == {}:
                values[name] = values.get(name, 0.0) + float(v)
            elif set(labels) == {"finished_reason"}:
                values[f"{name}{{{labels['finished_reason']}}}"] = float(v)
        return values

    def connect(self, timeout: float = HTTP_TIMEOUT_S) -> socket.socket:
        """A raw TCP connection, for what an HTTP client library will not send."""
        url = urlsplit(self.url)
        return socket.create_connection((url.hostname, url.port), timeout=timeout)

    def core_pid(self) -> int:
        """The engine-core child of a server of one model."""
        (pid,) = self.core_pids()
        return pid

    def core_pids(self) -> list[int]:
        """The engine-core children of the server (not multiprocessing's helper processes),
        oldest first: in the order of the models, which start one after another."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        cores = []
        for child in map(int, children):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
                cores.append(child)
        assert cores, f"no engine-core child among {children}"
        # Field 22 of /proc/PID/stat, counted after the ")" that ends the command's name.
        return sorted(cores, key=lambda c: int(
            Path(f"/proc/{c}/stat").read_text().rpartition(")")[2].split()[19]))

    @contextmanager
    def core_paused(self) -> Iterator[None]:
        """The engine core stopped (SIGSTOP) for the block's length: no step runs, so nothing a
        request does can finish while the test acts; the API server keeps answering."""
        core = self.core_pid()
        os.kill(core, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(core, signal.SIGCONT)

    def hang_up_once_running(self, path: str, body: dict) -> tuple[dict, dict]:
        """Send ``body`` on a raw connection and close it once a request runs; wait until one
        more request was aborted and every block is back. The metrics before and after."""
        before = self.metrics()
        with self.connect() as sock:
            sock.sendall(raw_request("POST", path, json.dumps(body).encode()))
            self.wait_for_metrics(lambda m: m["num_requests_running"] >= 1)
        aborted = before.get("request_finished_total{abort}", 0) + 1
        return before, self.wait_for_metrics(
            lambda m: m.get("request_finished_total{abort}", 0) >= aborted
            and m["kv_cache_blocks_used"] == 0 and m["num_requests_running"] == 0)

    def wait_for_metrics(self, done, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until ``done(values)``; fail with the last values on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if done(values):
                return values
            if time.monotonic() > deadline:
                pytest.fail(f"metrics never reached the expected state: {values}")
            time.sleep(0.1)


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes


def raw_request(method: str, path: str, body: bytes, host: str = "localhost") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def read_response(stream: BinaryIO) -> RawResponse | None:
    """The next HTTP/1.1 final response (with a Content-Length body) on a socket's file,
    past any 1xx; None if the server closed the connection instead."""
    while True:
        status_line = stream.readline()
        if not status_line:
            return None
        headers = {}
        while line := stream.readline().strip():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        status = int(status_line.split()[1])
        if status >= 200:
            return RawResponse(status, headers, stream.read(int(headers.get("content-length", 0))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launch_server(model: Path | str | None, log_dir: Path, *extra: str,
                  api_key: str | None = None, env: dict[str, str] | None = None,
                  own_group: bool = False, tls_ca: Path | None = None) -> Iterator[Server]:
    """``model`` None: ``extra`` names the models (``--model`` repeated, ``--models-config``).
    ``own_group``: the server leads a process group of its own, as in a terminal, where
    Ctrl-C reaches every process of the group. ``tls_ca``: the server serves HTTPS
    (``extra`` has its ``--ssl-*`` flags), and its certificate is checked against this file."""
    # The port is free when picked, but another process (the other test worker's engines)
    # may bind it before the server does: a server that exits for that gets a new port.
    for attempt in range(PORT_ATTEMPTS):
        port = _free_port()
        log = log_dir / f"server-{port}.log"
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", *([str(model)] if model else []),
               "--port", str(port), "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory-bytes", str(KV_BYTES), "--log-level", "warning", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        with log.open("w") as out:
            process = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=own_group,
                env={**os.environ, "PAGEDSERVE_LOG_LEVEL": "WARNING", **(env or {})})
        server = Server(f"{'https' if tls_ca else 'http'}://127.0.0.1:{port}", process, log,
                        api_key)
        try:
            if _wait_healthy(server, ssl.create_default_context(cafile=tls_ca) if tls_ca else True,
                             last_attempt=attempt == PORT_ATTEMPTS - 1):
                yield server
                return
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(server: Server, verify: ssl.SSLContext | bool, last_attempt: bool) -> bool:
    """True once the server answers; False if it exited because its port was taken first
    (and this is not the last attempt); a test failure for anything else."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            taken = PORT_TAKEN.format(urlsplit(server.url).port) in server.log.read_text()
            if taken and not last_attempt:
                return False
            pytest.fail(f"server exited with {server.process.returncode}:\n"
                        f"{server.log.read_text()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=5, verify=verify).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log.read_text()}")


def _write_chat_model(folder: Path, arch: str, **overrides) -> Path:
    from transformers import AutoTokenizer

    write_tiny_model(folder, arch, max_position_embeddings=MAX_MODEL_LEN, **overrides)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    return _write_chat_model(tmp_path_factory.mktemp("tiny-chat") / "model", "llama3")


@pytest.fixture(scope="session")
def qwen_model(tmp_path_factory) -> Path:
    """A second model, of another architecture and other weights, served as "qwen"."""
    return _write_chat_model(tmp_path_factory.mktemp("tiny-qwen") / "qwen", "qwen2", seed=1)


@pytest.fixture(scope="session")
def server(chat_model, tmp_path_factory) -> Iterator[Server]:
    with launch_server(chat_model, tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="session")
def embed_server(chat_model, tmp_path_factory) -> Iterator[Server]:
    """The model served for embeddings, scores and reranking (``--runner pooling``)."""
    with launch_server(chat_model, tmp_path_factory.mktemp("logs"), "--runner", "pooling",
                       "--max-num-batched-tokens", "64") as s:
        yield s


@pytest.fixture(scope="session")
def ahead_server(chat_model, tmp_path_factory) -> Iterator[Server]:
    """The server with async scheduling forced on, as it runs by default on GPUs."""
    with launch_server(chat_model, tmp_path_factory.mktemp("logs"), "--async-scheduling") as s:
        yield s


@pytest.fixture(scope="session")
def priority_server(chat_model, tmp_path_factory) -> Iterator[Server]:
    """The server with ``--scheduling-policy priority``: requests may carry a priority."""
    with launch_server(chat_model, tmp_path_factory.mktemp("logs"),
                       "--scheduling-policy", "priority") as s:
        yield s


@pytest.fixture(scope="session")
def keyed_server(chat_model, tmp_path_factory) -> Iterator[Server]:
    with launch_server(chat_model, tmp_path_factory.mktemp("keyed"),
                       api_key="s3cret-key") as s:
        yield s


@pytest.fixture(scope="session")
def offline(chat_model):
    from pagedserve import LLM

    return LLM(model=str(chat_model), **engine_kwargs())
