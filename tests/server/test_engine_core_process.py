"""The engine core in its own process: what happens when it dies mid-stream, and that neither
a clean shutdown nor a killed server leaves it running."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import HTTP_TIMEOUT_S, LONG_TOKENS, launch_server

# Every test here starts a server of its own (an API server and its engine core).
pytestmark = pytest.mark.slow

# The core must be noticed dead, and every stream failed, well within this.
FAIL_FAST_S = 10.0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_core_death_mid_stream_fails_the_stream_and_turns_health_red(chat_model, tmp_path):
    with launch_server(chat_model, tmp_path) as served:
        core = served.core_pid()
        body = {"prompt": [5, 6, 7], "max_tokens": LONG_TOKENS, "ignore_eos": True,
                "stream": True}
        events = []
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body,
                          timeout=HTTP_TIMEOUT_S) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        break
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - killed < FAIL_FAST_S
        errors = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert errors and "error" in errors[-1], rest[-3:]
        assert errors[-1]["error"]["type"] == "server_error"
        assert rest[-1] == "data: [DONE]"
        health = httpx.get(f"{served.url}/health", timeout=HTTP_TIMEOUT_S)
        assert health.status_code == 503
        assert "engine" in health.json()["error"]["message"]
        # New work is refused at once with an OpenAI error; the HTTP process still answers.
        refused = served.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
        assert httpx.get(f"{served.url}/version", timeout=HTTP_TIMEOUT_S).status_code == 200
        assert served.process.poll() is None


def test_shutdown_stops_the_core(chat_model, tmp_path):
    with launch_server(chat_model, tmp_path) as served:
        core = served.core_pid()
        served.process.send_signal(signal.SIGTERM)
        served.process.wait(timeout=60)
        assert _wait_gone(core, 10.0)


def test_ctrl_c_stops_the_server_and_its_core(chat_model, tmp_path):
    """SIGINT to the whole process group, as a terminal sends it: the core ignores it and the
    server stops it. (The core died of it too, and the server's shutdown then waited for good
    on a send to it.)"""
    with launch_server(chat_model, tmp_path, own_group=True) as served:
        core = served.core_pid()
        assert httpx.post(f"{served.url}/v1/completions", timeout=HTTP_TIMEOUT_S,
                          json={"prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200
        os.killpg(served.process.pid, signal.SIGINT)
        served.process.wait(timeout=30)
        assert _wait_gone(core, 10.0)


def test_a_killed_server_does_not_leave_the_core_running(chat_model, tmp_path):
    # The server makes its sockets' folder under TMPDIR: a folder of this test's own, short
    # enough to hold socket paths (a longer one, as tmp_path can be, sends it to /tmp).
    with tempfile.TemporaryDirectory(prefix="ps-", dir="/tmp") as tmpdir:
        with launch_server(chat_model, tmp_path, env={"TMPDIR": tmpdir}) as served:
            core = served.core_pid()
            assert [p.name[:11] for p in Path(tmpdir).iterdir()] == ["pagedserve-"]
            served.process.kill()
            served.process.wait(timeout=30)
            # The orphaned core notices its parent is gone while idle, exits by itself and
            # removes the sockets' folder the killed server could not.
            assert _wait_gone(core, 10.0)
        assert list(Path(tmpdir).iterdir()) == []


def _tp_worker_pid(core_pid: int) -> int:
    """The core's tensor-parallel rank 1 process."""
    children = Path(f"/proc/{core_pid}/task/{core_pid}/children").read_text().split()
    for pid in map(int, children):
        if b"pagedserve.executor.mp" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError(f"no tensor-parallel worker among {children}")


def test_tp_worker_death_mid_stream_fails_the_stream_and_turns_health_red(chat_model,
                                                                         tmp_path):
    with launch_server(chat_model, tmp_path, "--tensor-parallel-size", "2") as served:
        core = served.core_pid()
        worker = _tp_worker_pid(core)
        body = {"prompt": [5, 6, 7], "max_tokens": LONG_TOKENS, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body,
                          timeout=HTTP_TIMEOUT_S) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            events = 0
            for line in lines:
                events += line.startswith("data: {")
                if events == 3:
                    break
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        assert time.monotonic() - killed < FAIL_FAST_S
        errors = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert "error" in errors[-1], rest[-3:]
        assert "tensor-parallel rank 1" in errors[-1]["error"]["message"]
        assert rest[-1] == "data: [DONE]"
        deadline = killed + FAIL_FAST_S
        while httpx.get(f"{served.url}/health", timeout=HTTP_TIMEOUT_S).status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 after the worker died"
            time.sleep(0.1)
        assert _wait_gone(core, FAIL_FAST_S)
        assert served.process.poll() is None
