"""EngineConfig: validation names the flag, and derived values are resolved in one place."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pagedserve.config import ConfigError, EngineConfig, flag_name
from pagedserve.platforms.interface import Platform


class _Gpu(Platform):
    name = "fake-gpu"
    device_type = "cpu"
    runs_ahead = True

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        return torch.float16


class _Cpu(Platform):
    name = "fake-cpu"
    device_type = "cpu"

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        return torch.float32


def _arch(max_position_embeddings: int = 4096, sliding_window: int | None = None,
          rope_scaling: dict | None = None):
    return SimpleNamespace(max_position_embeddings=max_position_embeddings,
                           sliding_window=sliding_window, num_experts=0, fused_checkpoint=False,
                           rope_scaling=rope_scaling)


@pytest.mark.parametrize("field, flag", [
    ("device", "--device"), ("dtype", "--dtype"), ("kv_cache_dtype", "--kv-cache-dtype"),
    ("preemption_mode", "--preemption-mode"), ("load_format", "--load-format"),
])
def test_bad_choice_names_the_flag_and_the_choices(field, flag):
    with pytest.raises(ConfigError, match=f"^{flag} must be one of auto, .*got 'bogus'"):
        EngineConfig(**{field: "bogus"})


@pytest.mark.parametrize("kwargs, flag", [
    ({"block_size": 12}, "--block-size"),
    ({"max_num_seqs": 0}, "--max-num-seqs"),
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"),
    ({"max_model_len": 0}, "--max-model-len"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
    ({"kv_cache_memory_bytes": 0}, "--kv-cache-memory-bytes"),
    ({"swap_space": -1.0}, "--swap-space"),
    ({"kv_offloading_size": -1.0}, "--kv-offloading-size"),
    ({"kv_offloading_size": 1.0, "enable_prefix_caching": False}, "--kv-offloading-size"),
    ({"kv_offloading_disk_size": -1.0}, "--kv-offloading-disk-size"),
    ({"kv_offloading_disk": "/tmp/kv"}, "--kv-offloading-disk"),
    # Without a folder the engine crashed at the host tier's first spill to disk.
    ({"kv_offloading_size": 1.0, "kv_offloading_disk_size": 1.0}, "--kv-offloading-disk-size"),
    ({"kv_offloading_disk": "/tmp/kv", "kv_offloading_size": 1.0,
      "kv_offloading_disk_size": 1.0, "tensor_parallel_size": 2}, "--kv-offloading-disk"),
    ({"data_parallel_size": 0}, "--data-parallel-size"),
    # Every replica would delete the others' block files in the one folder.
    ({"kv_offloading_disk": "/tmp/kv", "kv_offloading_size": 1.0,
      "kv_offloading_disk_size": 1.0, "data_parallel_size": 2}, "--kv-offloading-disk"),
    ({"data_parallel_size": 2, "tensor_parallel_size": 2,
      "distributed_executor_backend": "ray"}, "--data-parallel-size"),
    ({"max_loras": 0}, "--max-loras"),
    ({"max_lora_rank": 0}, "--max-lora-rank"),
    ({"max_loras": 4, "max_cpu_loras": 3}, "--max-cpu-loras"),
    # NaN and infinity failed deep in the cache sizing, with no flag named.
    *[({name: value}, flag_name(name)) for name in ("swap_space", "cpu_offload_gb",
                                                    "kv_offloading_size",
                                                    "kv_offloading_disk_size")
      for value in (float("nan"), float("inf"))],
    # Finite, but infinite once turned into bytes: an OverflowError after the model loaded.
    *[({name: 1e300}, flag_name(name)) for name in ("swap_space", "cpu_offload_gb",
                                                  "kv_offloading_size", "kv_offloading_disk_size")],
    # torch's generators take 64 bits; a larger seed failed in torch.manual_seed.
    ({"seed": 2**63}, "--seed"),
    ({"seed": -(2**63) - 1}, "--seed"),
])
def test_bad_value_names_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=f"^{flag} "):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_seqs": "4"}, "--max-num-seqs must be an integer, got '4' (str)"),
    ({"seed": "x"}, "--seed must be an integer, got 'x' (str)"),
    ({"max_model_len": 4096.0}, "--max-model-len must be an integer, got 4096.0 (float)"),
    ({"tensor_parallel_size": True}, "--tensor-parallel-size must be an integer, got True "
                                     "(bool)"),
    ({"max_num_seqs": None}, "--max-num-seqs must be an integer, got None (NoneType)"),
    ({"gpu_memory_utilization": "0.5"}, "--gpu-memory-utilization must be a number, got '0.5' "
                                        "(str)"),
    ({"enforce_eager": "false"}, "--enforce-eager must be a boolean, got 'false' (str)"),
    ({"async_scheduling": 1}, "--async-scheduling must be a boolean, got 1 (int)"),
    ({"dtype": 16}, "--dtype must be a string, got 16 (int)"),
    ({"served_model_name": 1}, "--served-model-name must be a string, got 1 (int)"),
])
def test_a_value_of_the_wrong_type_names_the_flag_and_the_type(kwargs, message):
    """The Python API passes values as they come (the command line has parsed its own)."""
    with pytest.raises(ConfigError) as err:
        EngineConfig(**kwargs)
    assert str(err.value) == message


def test_values_of_their_type_in_other_forms_are_accepted():
    """An int where a float goes, numpy's scalars, None where the option allows it, and a
    pathlib path for the model (the loader takes one)."""
    config = EngineConfig(model=Path("/models/x"), gpu_memory_utilization=1,
                          max_num_seqs=np.int64(4), swap_space=np.float32(1.5),
                          max_model_len=None, async_scheduling=None)
    assert config.max_num_seqs == 4


def test_every_option_has_help():
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata["help"], f.name


def test_resolve_defaults_follow_the_model_and_the_platform():
    gpu = EngineConfig().resolve(_arch(8192), _Gpu)
    assert (gpu.dtype, gpu.max_model_len, gpu.max_num_batched_tokens, gpu.async_scheduling) \
        == (torch.float16, 8192, 2048, True)
    cpu = EngineConfig().resolve(_arch(8192), _Cpu)
    assert (cpu.dtype, cpu.async_scheduling) == (torch.float32, False)


def test_resolve_explicit_values_win():
    config = EngineConfig(dtype="bfloat16", max_model_len=1000, max_num_batched_tokens=512,
                          async_scheduling=False)
    resolved = config.resolve(_arch(8192), _Gpu)
    assert (resolved.dtype, resolved.max_model_len, resolved.max_num_batched_tokens,
            resolved.async_scheduling) == (torch.bfloat16, 1000, 512, False)


def test_a_sliding_window_does_not_limit_the_context():
    """The attention honours the window (Mistral-7B-v0.1: 4,096 within 32,768 positions)."""
    assert EngineConfig().resolve(_arch(32768, 4096), _Cpu).max_model_len == 32768
    with pytest.raises(ConfigError,
                       match="--max-model-len 32769 exceeds the model's limit of 32768"):
        EngineConfig(max_model_len=32769).resolve(_arch(32768, 4096), _Cpu)


def test_longrope_context_is_the_whole_max_position_embeddings():
    """Past original_max_position_embeddings longrope's long factors rotate (Phi-3-mini-128k
    runs 131,072 tokens)."""
    longrope = dict(rope_type="longrope", original_max_position_embeddings=4096)
    assert EngineConfig().resolve(_arch(131072, None, longrope), _Cpu).max_model_len == 131072
    with pytest.raises(ConfigError, match="--max-model-len 131073 exceeds the model's limit "
                                          "of 131072"):
        EngineConfig(max_model_len=131073).resolve(_arch(131072, None, longrope), _Cpu)


def test_without_chunked_prefill_a_whole_prompt_fits_the_budget():
    config = EngineConfig(enable_chunked_prefill=False)
    assert config.resolve(_arch(8192), _Cpu).max_num_batched_tokens == 8192
    assert config.resolve(_arch(1024), _Cpu).max_num_batched_tokens == 2048
    small = dataclasses.replace(config, max_num_batched_tokens=1024)
    with pytest.raises(ConfigError, match="--max-num-batched-tokens"):
        small.resolve(_arch(8192), _Cpu)


def test_scheduler_config_is_built_from_the_resolved_values():
    config = EngineConfig(max_num_seqs=7, preemption_mode="swap", enable_chunked_prefill=False)
    resolved = config.resolve(_arch(3000), _Cpu)
    sched = config.scheduler_config(resolved)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len,
            sched.enable_chunked_prefill, sched.preemption_mode) == (7, 3000, 3000, False, "swap")


def _disk_tier(folder) -> dict:
    return dict(kv_offloading_disk=folder, kv_offloading_size=1.0, kv_offloading_disk_size=1.0)


@pytest.mark.parametrize("where, why", [
    # The empty path was the working directory; the others failed after the model loaded,
    # with a traceback from mkdir.
    (lambda tmp: "", "is empty"),
    (lambda tmp: tmp / "a_file", "is a file, not a folder"),
    (lambda tmp: tmp / "a_file" / "kv", "cannot be made: .*a_file is not a folder"),
    # Path.expanduser's RuntimeError was a traceback; left as typed it was a folder "~..." here.
    (lambda tmp: "~no-such-user-here/kv", r"names a home folder this host does not have "
                                          r"\(~no-such-user-here\)"),
])
def test_a_disk_tier_folder_that_cannot_be_one_is_refused_before_the_model_loads(tmp_path,
                                                                                 where, why):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=f"^--kv-offloading-disk .*{why}"):
        EngineConfig(**_disk_tier(where(tmp_path)))


def test_a_disk_tier_folder_yet_to_be_made_is_accepted(tmp_path):
    EngineConfig(**_disk_tier(tmp_path / "new" / "kv"))
    EngineConfig(**_disk_tier(tmp_path))
    assert not (tmp_path / "new").exists()  # made by the engine, not by the check


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(EngineConfig)
                                  if f.type in ("int", "int | None")])
def test_an_integer_past_64_bits_names_the_flag(name):
    """--max-num-seqs 10**20 loaded the model, then failed its first step in islice."""
    with pytest.raises(ConfigError, match=f"^{flag_name(name)} "):
        EngineConfig(**{name: 10**20})
