"""Which models ``pagedserve serve`` starts: ``--model`` repeated, or a models config file whose
entries are EngineConfig options over the command line's engine flags."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedserve.cli import parse_args
from pagedserve.config import EngineConfig
from pagedserve.errors import ConfigError
from pagedserve.server.models_config import serve_configs


def _configs(*argv: str) -> list[EngineConfig]:
    return [spec.config for spec in serve_configs(parse_args(["serve", *argv]))]


def test_one_model_reads_as_before():
    assert _configs("org/a", "--device", "cpu") == [EngineConfig(model="org/a", device="cpu")]
    assert _configs() == [EngineConfig()]


def test_a_repeated_model_flag_serves_each_with_the_same_flags():
    args = parse_args(["serve", "--model", "org/a", "--max-model-len", "512", "--model", "b"])
    assert args.model == "org/a" and args.models == ["org/a", "b"]
    assert serve_configs(args) == [(EngineConfig(model="org/a", max_model_len=512), {}),
                                   (EngineConfig(model="b", max_model_len=512), {})]


def test_several_models_cannot_share_one_served_name():
    with pytest.raises(ConfigError, match="--served-model-name names one model"):
        _configs("--model", "a", "--model", "b", "--served-model-name", "x")


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_entries_override_the_flags(tmp_path: Path, suffix):
    entries = [{"model": "/m/a", "served_model_name": "a", "gpu_memory_utilization": 1},
               {"model": "/m/b", "max_model_len": 256, "enable_prefix_caching": False,
                "device": "cpu", "kv_cache_memory_bytes": None}]
    path = tmp_path / f"models{suffix}"
    path.write_text(json.dumps({"models": entries}))  # JSON is YAML as well
    configs = _configs("--models-config", str(path), "--max-model-len", "1024",
                       "--kv-cache-memory-bytes", "4096")
    assert configs == [
        # Its memory share replaces the flags' KV bytes, which it excludes.
        EngineConfig(model="/m/a", served_model_name="a", gpu_memory_utilization=1.0,
                     max_model_len=1024),
        EngineConfig(model="/m/b", max_model_len=256, enable_prefix_caching=False,
                     device="cpu")]
    assert isinstance(configs[0].gpu_memory_utilization, float)


def test_an_entry_takes_its_own_data_parallel_size(tmp_path: Path):
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {model: /m/a, data_parallel_size: 2, env: {A: x}}\n"
                    "  - {model: /m/b}\n")
    specs = serve_configs(parse_args(["serve", "--models-config", str(path),
                                      "--data-parallel-size", "3"]))
    assert [(s.config.data_parallel_size, s.env) for s in specs] == [(2, {"A": "x"}), (3, {})]


@pytest.mark.parametrize(("text", "message"), [
    ("models: []", "expected 'models:', a non-empty list"),
    ("- model: a", "expected 'models:', a non-empty list"),
    ("models: [a]", "entry 1: expected a mapping of option names to values, got 'a'"),
    ("models: [{model: a}, {modle: b}]", "entry 2: unknown option 'modle'; options are model,"),
    ("models: [{max_model_len: '512'}]", "entry 1: max_model_len must be int or null, got '512'"),
    ("models: [{max_num_seqs: 2.5}]", "entry 1: max_num_seqs must be int, got 2.5"),
    ("models: [{enforce_eager: 1}]", "entry 1: enforce_eager must be bool, got 1"),
    ("models: [{max_num_seqs: true}]", "entry 1: max_num_seqs must be int, got True"),
    ("models: [{device: tpu}]", "entry 1: --device must be one of"),
    ("models: [{max_model_len: 0}]", "entry 1: --max-model-len must be at least 1"),
    ("models: [{data_parallel_size: 0}]", "entry 1: --data-parallel-size must be at least 1"),
    ("models: [{model: a", "not valid YAML"),
    ("models: [{env: [CUDA_VISIBLE_DEVICES]}]", "entry 1: env must map variable names to"),
    ("models: [{env: {A: [1]}}]", "entry 1: env must map variable names to strings"),
    ("models: [{gpu_memory_utilization: 0.5, kv_cache_memory_bytes: 8}]",
     "entry 1: gpu_memory_utilization and kv_cache_memory_bytes exclude each other"),
    ("models: [{speculative_config: 4}]", "entry 1: speculative_config must be a mapping or "
                                          "null, got 4"),
    ("models: [{speculative_config: {method: ngram}}]",
     "entry 1: --speculative-config: num_speculative_tokens is required"),
    ("models: [{speculative_config: '{bad'}]",
     "entry 1: --speculative-config is not valid JSON"),
])
def test_a_bad_entry_is_one_line_naming_it(tmp_path: Path, text, message):
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        _configs("--models-config", str(path))
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert str(exc.value).startswith(f"--models-config {path}")


def test_an_entry_may_decode_speculatively(tmp_path: Path):
    """speculative_config, as a mapping or as the flag's JSON text: each was refused
    ("must be SpeculativeConfig or null"), so no model of a file could speculate."""
    path = tmp_path / "models.yaml"
    path.write_text("models:\n"
                    "  - {model: a, speculative_config: {method: ngram, "
                    "num_speculative_tokens: 3}}\n"
                    "  - {model: b, speculative_config: '{\"method\": \"ngram\", "
                    "\"num_speculative_tokens\": 2}'}\n"
                    "  - {model: c, speculative_config: null}\n")
    configs = _configs("--models-config", str(path), "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 5}')
    assert [c.speculative_config and c.speculative_config.num_speculative_tokens
            for c in configs] == [3, 2, None]


def test_an_entry_may_add_to_its_core_environment(tmp_path: Path):
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {model: a, env: {CUDA_VISIBLE_DEVICES: 1, X: y}}\n"
                    "  - {model: b}\n")
    specs = serve_configs(parse_args(["serve", "--models-config", str(path)]))
    assert [spec.env for spec in specs] == [{"CUDA_VISIBLE_DEVICES": "1", "X": "y"}, {}]
    assert [spec.config.model for spec in specs] == ["a", "b"]


def test_two_models_cannot_share_a_kv_disk_folder(tmp_path: Path):
    """Each engine deletes other models' block files in its disk folder at start."""
    disk = ["--kv-offloading-size", "1", "--kv-offloading-disk-size", "1"]
    with pytest.raises(ConfigError, match="share --kv-offloading-disk"):
        _configs("--model", "a", "--model", "b", *disk, "--kv-offloading-disk", str(tmp_path))
    models = tmp_path / "models.json"
    models.write_text(json.dumps({"models": [
        {"model": "a", "kv_offloading_disk": str(tmp_path / "x")},
        {"model": "b", "kv_offloading_disk": str(tmp_path / "x" / ".." / "x")}]}))
    with pytest.raises(ConfigError, match="'a' and 'b' share"):
        _configs("--models-config", str(models), *disk)
    models.write_text(json.dumps({"models": [
        {"model": "a", "kv_offloading_disk": str(tmp_path / "x")},
        {"model": "b", "kv_offloading_disk": str(tmp_path / "y")},
        {"model": "c", "kv_offloading_disk_size": 0}]}))
    assert [c.kv_offloading_disk for c in _configs("--models-config", str(models), *disk)] == [
        str(tmp_path / "x"), str(tmp_path / "y"), None]


def test_models_come_from_the_flag_or_the_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="--model or in --models-config, not both"):
        _configs("org/a", "--models-config", str(tmp_path / "models.yaml"))
    with pytest.raises(ConfigError, match="cannot read"):
        _configs("--models-config", str(tmp_path / "absent.yaml"))


def test_two_models_under_one_name_are_refused():
    from pagedserve.server.serving_models import ServedModel, ServingModels

    served = [ServedModel("m", 64, None, SimpleNamespace()) for _ in range(2)]
    with pytest.raises(ConfigError, match="two models are served as 'm'"):
        ServingModels(served)
