"""Engine configuration: one frozen dataclass, validated with errors naming the flag to change."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("auto", "swap", "recompute")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "dummy")


class ConfigError(ValueError):
    """A setting the user must change; the message names the flag."""


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.90
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    enforce_eager: bool = False
    # Schedule step N+1 while step N computes; None: where the platform's host runs ahead.
    async_scheduling: bool | None = None
    seed: int = 0
    served_model_name: str | None = None
    # "dummy" fills the weights with random values on the device instead of reading them:
    # benchmarks of real shapes without multi-GB checkpoints.
    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ConfigError(
                f"--block-size must be a power of two up to 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("--max-model-len must be at least 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError("--kv-cache-memory-bytes must be positive")
        if self.swap_space < 0:
            raise ConfigError("--swap-space must be non-negative")
        for value, allowed, flag in (
            (self.preemption_mode, PREEMPTION_MODES, "--preemption-mode"),
            (self.kv_cache_dtype, KV_CACHE_DTYPES, "--kv-cache-dtype"),
            (self.dtype, DTYPES, "--dtype"),
            (self.load_format, LOAD_FORMATS, "--load-format"),
        ):
            if value not in allowed:
                raise ConfigError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        """Without chunked prefill a whole prompt must fit one step's budget."""
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ConfigError(
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than "
                    f"--max-model-len ({max_model_len}); enable chunked prefill or raise it"
                )
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
