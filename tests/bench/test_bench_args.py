"""The benchmarks refuse what cannot run before they load anything: a count or size that is not
positive ends in argparse's one-line error (exit 2), and ``bench serve`` with no server at
--base-url in one line naming the flag, not a traceback."""

from __future__ import annotations

import socket

import pytest

from pagedserve.cli import main, parse_args


@pytest.mark.parametrize("argv, flag, value", [
    (["throughput", "--num-prompts", "-1"], "--num-prompts", "-1"),
    (["throughput", "--input-len", "0", "8"], "--input-len", "0"),
    (["throughput", "--hf-batch-sizes", "16", "0"], "--hf-batch-sizes", "0"),
    (["lora", "--adapter-counts", "1", "0"], "--adapter-counts", "0"),
    (["lora", "--rounds", "0"], "--rounds", "0"),
    (["serve", "--concurrency", "0"], "--concurrency", "0"),
    (["serve", "--num-prompts", "x"], "--num-prompts", "'x'"),
    (["serve", "--output-len", "4", "-4"], "--output-len", "-4"),
])
def test_a_count_that_is_not_positive_is_refused_at_parsing(argv, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["bench", *argv, "--device", "cpu"])
    assert exit_.value.code == 2
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert last_line.startswith(f"pagedserve bench {argv[0]}: error: argument {flag}: ")
    assert last_line.endswith(value)


def _bench_serve(llama3_folder, port: int, *flags: str) -> None:
    main(["bench", "serve", "--model", str(llama3_folder), "--base-url",
          f"http://127.0.0.1:{port}", "--num-prompts", "2", "--input-len", "4", "8",
          "--output-len", "2", "4", *flags])


def test_bench_serve_without_a_server_says_so_in_one_line(llama3_folder, tmp_path, capsys):
    with socket.socket() as bound:  # bound, not listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            _bench_serve(llama3_folder, port, "--concurrency", "2", "--out",
                         str(tmp_path / "serve.json"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"pagedserve: error: --base-url http://127.0.0.1:{port}: cannot list the served " \
           "models (ConnectError" in err
    assert "Traceback" not in err and not (tmp_path / "serve.json").exists()


def test_bench_serve_refuses_more_clients_than_connections(llama3_folder, capsys):
    with pytest.raises(SystemExit) as exit_:
        _bench_serve(llama3_folder, 9, "--concurrency", "2", "--num-clients", "3")
    assert exit_.value.code == 2
    assert "--num-clients (3) must not exceed --concurrency (2)" in capsys.readouterr().err
