"""The benchmarks refuse what cannot run before they load anything: a count, size, length or
share out of its range, a (MIN, MAX) pair whose MIN exceeds MAX, or an empty list ends in
argparse's one-line error (exit 2), and ``bench serve`` with no server at --base-url in one
line naming the flag, not a traceback."""

from __future__ import annotations

import argparse
import socket

import pytest

from pagedserve.bench import BENCHMARKS, register_bench_commands
from pagedserve.cli import main, parse_args
from pagedserve.engine_args import add_engine_args


@pytest.mark.parametrize("argv, flag, message_end", [
    (["throughput", "--num-prompts", "-1"], "--num-prompts", "-1"),
    (["throughput", "--input-len", "0", "8"], "--input-len", "0"),
    (["throughput", "--input-len", "10", "5"], "--input-len", "MIN must not exceed MAX, got 10 5"),
    (["throughput", "--output-len", "4", "2"], "--output-len", "got 4 2"),
    (["throughput", "--hf-batch-sizes", "16", "0"], "--hf-batch-sizes", "0"),
    (["throughput", "--hf-batch-sizes", "--skip-hf"], "--hf-batch-sizes",
     "expected at least one argument"),
    (["lora", "--adapter-counts", "1", "0"], "--adapter-counts", "0"),
    (["lora", "--rounds", "0"], "--rounds", "0"),
    (["serve", "--concurrency", "0"], "--concurrency", "0"),
    (["serve", "--num-prompts", "x"], "--num-prompts", "'x'"),
    (["serve", "--output-len", "4", "-4"], "--output-len", "-4"),
    (["serve", "--input-len", "256", "32"], "--input-len", "got 256 32"),
    (["decode", "--batch-sizes", "--steps", "4"], "--batch-sizes",
     "expected at least one argument"),
    (["decode", "--context-len", "0"], "--context-len", "0"),
    (["decode", "--steps", "-3"], "--steps", "-3"),
    (["step-overhead", "--batch-sizes", "256", "0"], "--batch-sizes", "0"),
    (["step-overhead", "--steps", "0"], "--steps", "0"),
    (["kv-copy-rate", "--batch-blocks", "8", "-1"], "--batch-blocks", "-1"),
    (["kv-copy-rate", "--repeats", "0"], "--repeats", "0"),
    (["kv-offload", "--conversations", "0"], "--conversations", "0"),
    (["kv-offload", "--prefix-len", "0"], "--prefix-len", "0"),
    (["kv-offload", "--device-share", "0"], "--device-share",
     "must be a fraction in (0, 1], got 0"),
    (["kv-offload", "--device-share", "1.5"], "--device-share", "1.5"),
    (["kv-offload", "--tier-gib", "nan"], "--tier-gib", "nan"),
    (["kv-offload", "--warm-up-conversations", "-1"], "--warm-up-conversations", "-1"),
    (["long-prefill", "--long-prompt-len", "0"], "--long-prompt-len", "0"),
    (["long-prefill", "--threads", "-1"], "--threads", "-1"),
    (["quant-accuracy", "--new-tokens", "0"], "--new-tokens", "0"),
    (["quant-accuracy", "--formats", "--new-tokens", "4"], "--formats",
     "expected at least one argument"),
    (["quant-kernels", "--shapes", "960x0"], "--shapes", "960x0"),
    (["quant-kernels", "--shapes", "960"], "--shapes", "960"),
    (["quant-kernels", "--group-size", "0"], "--group-size", "0"),
    (["quant-kernels", "--min-time", "-0.1"], "--min-time", "-0.1"),
    (["sharing", "--num-ttft-requests", "0"], "--num-ttft-requests", "0"),
    (["sharing", "--chunk-budget", "0"], "--chunk-budget", "0"),
    (["speculative", "--draft-lens", "2", "0"], "--draft-lens", "0"),
    (["speculative", "--rounds", "0"], "--rounds", "0"),
    (["structured", "--output-len", "1"], "--output-len",
     "must be an integer of at least 2, got 1"),
    (["structured", "--repeats", "0"], "--repeats", "0"),
    (["structured", "--num-requests", "1"], "--num-requests",
     "must be an integer of at least 2, got 1"),
])
def test_a_bad_number_is_refused_at_parsing(argv, flag, message_end, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["bench", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith(f"pagedserve bench {argv[0]}: error: argument {flag}: ")
    assert err.rstrip("\n").endswith(message_end)


@pytest.mark.parametrize("argv, dest, value", [
    (["throughput", "--input-len", "5", "5"], "input_len", (5, 5)),
    (["serve", "--output-len", "1", "9"], "output_len", (1, 9)),
    (["decode", "--batch-sizes", "1", "8"], "batch_sizes", [1, 8]),
    (["kv-offload", "--device-share", "1"], "device_share", 1.0),
    (["kv-offload", "--warm-up-conversations", "0"], "warm_up_conversations", 0),
    (["kv-offload", "--message-len", "0"], "message_len", 0),
    (["quant-kernels", "--shapes", "960x576", "8X16"], "shapes", [(960, 576), (8, 16)]),
    (["quant-kernels", "--min-time", "0"], "min_time", 0.0),
    (["structured", "--output-len", "2"], "output_len", 2),
    (["structured", "--num-requests", "2"], "num_requests", 2),
])
def test_the_edge_of_each_range_still_parses(argv, dest, value):
    assert getattr(parse_args(["bench", *argv]), dest) == value


@pytest.mark.parametrize("name", BENCHMARKS)
def test_no_bench_flag_takes_an_unchecked_number_or_an_empty_list(name):
    """The engine's flags are EngineConfig's, which checks them itself."""
    engine = argparse.ArgumentParser(add_help=False)
    add_engine_args(engine)
    engine_dests = {action.dest for action in engine._actions}
    commands = argparse.ArgumentParser().add_subparsers()
    register_bench_commands(commands)
    unchecked = [action.option_strings for action in commands.choices[name]._actions
                 if action.dest not in engine_dests
                 and (action.type in (int, float) or action.nargs == "*")]
    assert unchecked == []


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
