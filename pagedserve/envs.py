"""Every environment variable pagedserve reads, typed, in one place."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from pagedserve.errors import ConfigError

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def cache_dir() -> Path:
    """Where converted checkpoints are kept (PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve)."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedserve"


def log_level() -> str:
    """PAGEDSERVE_LOG_LEVEL: DEBUG, INFO (default), WARNING, ERROR or CRITICAL. Read when the
    first module imports the logger, before any error can be reported as one line: another
    value is named on stderr, and INFO is used."""
    level = os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO").strip().upper()
    if level in _LOG_LEVELS:
        return level
    print(f"pagedserve: warning: PAGEDSERVE_LOG_LEVEL={level!r} is none of "
          f"{', '.join(_LOG_LEVELS)}; logging at INFO", file=sys.stderr)
    return "INFO"


def cpu_kv_cache_fraction() -> float:
    """PAGEDSERVE_CPU_KV_FRACTION: share of available RAM the CPU KV pool may take (0.25),
    in (0, 1]."""
    return _number("PAGEDSERVE_CPU_KV_FRACTION", "0.25", "a share in (0, 1]",
                   lambda value: 0 < value <= 1)


def api_key() -> str | None:
    """PAGEDSERVE_API_KEY: the key ``pagedserve serve`` requires when --api-key is not given
    (an environment variable does not show in the process list)."""
    return os.environ.get("PAGEDSERVE_API_KEY") or None


def dist_timeout_s() -> float:
    """PAGEDSERVE_DIST_TIMEOUT_S: how long a tensor-parallel rank waits in a collective (or
    for its peers to start) before it gives up (300), in seconds above 0."""
    return _number("PAGEDSERVE_DIST_TIMEOUT_S", "300", "a number of seconds above 0",
                   lambda value: value > 0)


def pp_layer_partition() -> tuple[int, ...] | None:
    """PAGEDSERVE_PP_LAYER_PARTITION (else vLLM's VLLM_PP_LAYER_PARTITION, so that its
    deployments work unchanged): each pipeline stage's number of decoder layers, e.g. ``5,7``,
    instead of the even split. None where neither is set."""
    for name in ("PAGEDSERVE_PP_LAYER_PARTITION", "VLLM_PP_LAYER_PARTITION"):
        text = os.environ.get(name, "").strip()
        if text:
            try:
                return tuple(int(part) for part in text.split(","))
            except ValueError:
                raise ConfigError(f"{name} must be layer counts separated by commas "
                                  f"(e.g. 5,7), got {text!r}") from None
    return None


def w4a16_wgmma() -> bool:
    """PAGEDSERVE_W4A16_WGMMA: 1, the default, lets the W4A16 layers on Hopper take the wgmma
    kernel for the rows where the H200 measured it fastest (``kernels/w4a16.py``,
    ``WGMMA_ROWS``); 0 keeps the tiles and dequantize + cuBLAS there."""
    value = os.environ.get("PAGEDSERVE_W4A16_WGMMA", "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"PAGEDSERVE_W4A16_WGMMA must be 0 or 1, got {value!r}")
    return value == "1"


def _number(name: str, default: str, what: str, ok) -> float:
    """The variable's finite value where ``ok`` holds; else a ``ConfigError`` naming it (a
    float() of 'abc' or a NaN failed deep in the engine's start-up)."""
    text = os.environ.get(name, default)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and ok(value)):
        raise ConfigError(f"{name} must be {what}, got {text!r}")
    return value


def allow_runtime_lora_updating() -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING (vLLM's name, so that its deployments work unchanged):
    1 or true turns on --enable-runtime-lora-updating."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def server_dev_mode() -> bool:
    """VLLM_SERVER_DEV_MODE (vLLM's name): 1 or true turns on --enable-server-dev-mode."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "").strip().lower() in ("1", "true")


def responses_store() -> bool:
    """VLLM_ENABLE_RESPONSES_API_STORE (vLLM's name): 1 or true turns on
    --enable-responses-store."""
    return os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "").strip().lower() in ("1", "true")


def cuda_home() -> str | None:
    """CUDA_HOME (else CUDA_PATH): the CUDA toolkit whose ``bin/nvcc`` builds the CUDA C++
    kernels; unset, ``nvcc`` on PATH, else /usr/local/cuda."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or None


def pdl() -> str:
    """PAGEDSERVE_PDL: where a step's GPU kernels on Hopper and later launch with programmatic
    dependent launch (``platforms/cuda/kernels/pdl.py``): ``auto`` (the default) in the CUDA
    graphs of small decode batches, where the H200 measured it faster; ``1`` everywhere;
    ``0`` nowhere."""
    value = os.environ.get("PAGEDSERVE_PDL", "auto").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ConfigError(f"PAGEDSERVE_PDL must be auto, 0 or 1, got {value!r}")
    return value
