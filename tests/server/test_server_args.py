"""``pagedserve serve``'s own flags: a bad value is argparse's one-line error (exit 2) before
any model loads, not a traceback from uvicorn once the engine cores are up."""

from __future__ import annotations

import errno
import os
import socket

import pytest


@pytest.mark.parametrize(("flag", "value", "says"), [
    # uvicorn's bind raised OverflowError after the models had loaded.
    ("--port", "70000", "must be a port number in [0, 65535], got 70000"),
    ("--port", "-1", "must be a port number in [0, 65535], got -1"),
    # Every request was refused with 413, or none could be read.
    ("--max-request-bytes", "0", "must be a positive integer, got 0"),
    ("--max-request-bytes", "-5", "must be a positive integer, got -5"),
    # uvicorn's KeyError once the models had loaded.
    ("--log-level", "loud", "invalid choice: 'loud'"),
    # An empty key was no key: the server answered everyone.
    ("--api-key", "", "must be a non-empty string, got "),
])
def test_a_bad_server_flag_is_one_line_before_anything_loads(flag, value, says, capsys):
    from pagedserve.cli import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", f"{flag}={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedserve serve: error: argument {flag}: ") and says in err
    assert len(err.strip().splitlines()) == 1


def test_an_unknown_reasoning_parser_lists_the_known_ones(capsys):
    from pagedserve.cli import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["serve", "--reasoning-parser", "glm45"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve serve: error: argument --reasoning-parser: invalid "
                          "choice: 'glm45'") and len(err.strip().splitlines()) == 1
    assert all(name in err for name in ("deepseek_r1", "qwen3", "granite", "mistral"))


def test_good_server_flags_parse():
    from pagedserve.cli import parse_args

    args = parse_args(["serve", "--port", "0", "--max-request-bytes", "1",
                       "--log-level", "debug", "--api-key", "k"])
    assert (args.port, args.max_request_bytes, args.log_level, args.api_key) == (
        0, 1, "debug", "k")


@pytest.mark.parametrize("host", [
    "999.1.1.1",  # not an address, nor a name that resolves
    "192.0.2.1",  # TEST-NET-1: an address, but of no interface here
])
def test_a_host_the_server_cannot_listen_at_fails_before_any_model_loads(host, tmp_path, capsys):
    """uvicorn's bind failed only once the models had loaded."""
    from pagedserve.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path / "no-model-here"), "--host", host, "--port", "8123"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    prefix = f"pagedserve: error: cannot listen at --host {host} --port 8123: "
    assert err.startswith(prefix) and len(err) > len(prefix) + 1 and err.count("\n") == 1


def test_a_port_in_use_fails_before_any_model_loads(tmp_path, capsys):
    from pagedserve.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            main(["serve", str(tmp_path / "no-model-here"), "--port", str(port)])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (f"pagedserve: error: cannot listen at --host 127.0.0.1 "
                                       f"--port {port}: {os.strerror(errno.EADDRINUSE)}\n")


def test_the_port_is_held_from_before_the_models_load_but_refuses_until_serving():
    """The port was only probed and let go, and a process binding during the model load
    (in CI, the other test worker's engine) took it: uvicorn then failed to bind."""
    from pagedserve.server.app import _bind_listen_address

    listeners = _bind_listen_address("127.0.0.1", 0)
    try:
        port = listeners[0].getsockname()[1]
        with socket.socket() as rival:
            with pytest.raises(OSError) as exc:
                rival.bind(("127.0.0.1", port))
            assert exc.value.errno == errno.EADDRINUSE
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        for sock in listeners:
            sock.close()
