"""Every environment variable pagedserve reads, typed, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted checkpoints are kept (PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve)."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedserve"


def log_level() -> str:
    """PAGEDSERVE_LOG_LEVEL: DEBUG, INFO (default), WARNING or ERROR."""
    return os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO").upper()


def cpu_kv_cache_fraction() -> float:
    """PAGEDSERVE_CPU_KV_FRACTION: share of available RAM the CPU KV pool may take (0.25)."""
    return float(os.environ.get("PAGEDSERVE_CPU_KV_FRACTION", "0.25"))


def api_key() -> str | None:
    """PAGEDSERVE_API_KEY: the key ``pagedserve serve`` requires when --api-key is not given
    (an environment variable does not show in the process list)."""
    return os.environ.get("PAGEDSERVE_API_KEY") or None


def dist_timeout_s() -> float:
    """PAGEDSERVE_DIST_TIMEOUT_S: how long a tensor-parallel rank waits in a collective (or
    for its peers to start) before it gives up (300)."""
    return float(os.environ.get("PAGEDSERVE_DIST_TIMEOUT_S", "300"))


def allow_runtime_lora_updating() -> bool:
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING (vLLM's name, so that its deployments work unchanged):
    1 or true turns on --enable-runtime-lora-updating."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def cuda_home() -> str | None:
    """CUDA_HOME (else CUDA_PATH): the CUDA toolkit whose ``bin/nvcc`` builds the CUDA C++
    kernels; unset, ``nvcc`` on PATH, else /usr/local/cuda."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or None


def pdl() -> bool:
    """PAGEDSERVE_PDL: 1 launches a step's GPU kernels on Hopper and later with programmatic
    dependent launch (``platforms/cuda/kernels/pdl.py``). Off by default until an H200 has
    run and timed it."""
    return os.environ.get("PAGEDSERVE_PDL", "0").strip() == "1"
