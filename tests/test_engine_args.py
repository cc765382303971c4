"""The engine flags are derived from EngineConfig's fields: one flag each, and they round-trip."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine_args import add_engine_args, config_from_args

# Every option set away from its default, and the flags that say so (the README's names).
NON_DEFAULT = EngineConfig(
    model="/models/x", revision="v2", gguf_file="m.gguf", device="cpu", dtype="bfloat16",
    block_size=8, max_num_seqs=3,
    max_num_batched_tokens=4096, max_model_len=1024, kv_cache_memory_bytes=1 << 20,
    gpu_memory_utilization=0.9, swap_space=0.5, kv_cache_dtype="fp8",
    enable_prefix_caching=False, enable_chunked_prefill=False, preemption_mode="swap",
    enforce_eager=True, async_scheduling=False, shape_bucketing=True, seed=7,
    served_model_name="x", load_format="dummy")
NON_DEFAULT_ARGV = [
    "--model", "/models/x", "--revision", "v2", "--gguf-file", "m.gguf", "--device", "cpu",
    "--dtype", "bfloat16", "--block-size", "8",
    "--max-num-seqs", "3", "--max-num-batched-tokens", "4096", "--max-model-len", "1024",
    "--kv-cache-memory-bytes", str(1 << 20), "--swap-space", "0.5", "--kv-cache-dtype", "fp8",
    "--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--preemption-mode", "swap",
    "--enforce-eager", "--no-async-scheduling", "--shape-bucketing", "--seed", "7",
    "--served-model-name", "x", "--load-format", "dummy"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def _parse(argv: list[str]) -> EngineConfig:
    return config_from_args(_parser().parse_args(argv))


def test_every_option_has_exactly_one_flag():
    dests = [a.dest for a in _parser()._actions if a.dest != "help"]
    assert sorted(dests) == sorted(f.name for f in dataclasses.fields(EngineConfig))


def test_defaults_equal():
    assert _parse([]) == EngineConfig()


def test_flags_round_trip():
    assert _parse(NON_DEFAULT_ARGV) == NON_DEFAULT
    # The one value the memory flags' exclusion keeps out of the list above.
    assert _parse(["--gpu-memory-utilization", "0.5"]).gpu_memory_utilization == 0.5


def test_async_scheduling_is_tri_state():
    values = [_parse(argv).async_scheduling
              for argv in ([], ["--async-scheduling"], ["--no-async-scheduling"])]
    assert values == [None, True, False]


def test_memory_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        _parse(["--kv-cache-memory-bytes", "1024", "--gpu-memory-utilization", "0.5"])
    assert "not allowed with argument --kv-cache-memory-bytes" in capsys.readouterr().err


def test_bad_choice_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        _parse(["--preemption-mode", "never"])
    assert "--preemption-mode: invalid choice: 'never'" in capsys.readouterr().err


@pytest.mark.parametrize("command", [
    ["generate", "hi"], ["serve"], ["bench", "throughput"], ["bench", "decode"],
    ["bench", "step-overhead"], ["bench", "sharing"], ["bench", "serve"],
])
def test_every_command_takes_the_engine_flags(command):
    from pagedserve.cli import build_parser

    args = build_parser().parse_args(command + NON_DEFAULT_ARGV)
    assert config_from_args(args) == NON_DEFAULT


@pytest.mark.parametrize("argv", [["serve", "org/name"], ["serve", "--model", "org/name"],
                                  ["serve", "--port", "9000", "org/name", "--device", "cpu"]])
def test_serve_takes_the_model_positionally_or_as_a_flag(argv):
    from pagedserve.cli import parse_args

    assert config_from_args(parse_args(argv)).model == "org/name"


def test_serve_without_a_model_uses_the_default():
    from pagedserve.cli import parse_args

    assert config_from_args(parse_args(["serve"])).model is None


@pytest.mark.parametrize("argv", [["serve", "org/a", "--model", "org/b"],
                                  ["serve", "--model", "org/b", "org/a"]])
def test_serve_refuses_the_model_twice(argv, capsys):
    from pagedserve.cli import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("pagedserve: error: serve: the model was given twice (org/a and --model "
                    "org/b); pass it once, either way")


@pytest.mark.parametrize("argv,message", [
    (["generate", "hi", "--max-tokens", "-1"], "--max-tokens: max_tokens must be"),
    (["generate", "hi", "--temperature", "-1"], "--temperature: temperature must be"),
    (["generate", ""], "the prompt: the prompt is empty"),
    # The flag is --sampling-seed; --seed, which the error named, is the engine's.
    (["generate", "hi", "--sampling-seed", str(2**70)], "--sampling-seed: seed must be in"),
    (["generate", "hi", "--chat"], "--chat: the model tiny has no chat template"),
])
def test_generate_reports_a_bad_value_in_one_line(argv, message, monkeypatch, capsys):
    """Exit 2 and a line naming the flag, as for every other user mistake, not a
    traceback. (The engine is a stand-in that refuses an empty prompt as the real one does.)"""
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import InvalidSamplingParam

    class Engine:
        engine = SimpleNamespace(model_name="tiny")

        def generate(self, prompt, params, use_tqdm):
            if not prompt:
                raise InvalidSamplingParam("prompt", "the prompt is empty")
            return []

        def get_tokenizer(self):  # a model without a chat template: --chat was a traceback
            return SimpleNamespace(chat_template=None)

    from pagedserve.cli import main

    monkeypatch.setattr(LLM, "from_config", classmethod(lambda cls, config: Engine()))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedserve: error: {message}") and "Traceback" not in err


def test_logits_processors_take_several_names():
    from tests.sample.ban_token import BanToken

    name = "tests.sample.ban_token:BanToken"
    assert _parse(["--logits-processors", name, name]).logits_processors == (BanToken, BanToken)
