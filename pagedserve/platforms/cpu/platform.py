"""The CPU platform: always available, torch kernels, KV pool in host RAM."""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from pagedserve.platforms.interface import MemoryInfo, Platform


def _meminfo_bytes(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"

    @classmethod
    def check_available(cls) -> None:
        return None

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        # bf16 matmuls are slow on CPUs without AMX; float32 is the safe fast default.
        return torch.float32

    @classmethod
    def memory_info(cls) -> MemoryInfo:
        total = _meminfo_bytes("MemTotal")
        if total is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = _meminfo_bytes("MemAvailable") or total
        return MemoryInfo(free_bytes=free, total_bytes=total)

    @classmethod
    def kv_cache_budget_bytes(cls, utilization: float, peak_used_bytes: int) -> int:
        # Weights already sit in RAM, so what is free now is what the pool can take.
        from pagedserve import envs

        return int(cls.memory_info().free_bytes * envs.cpu_kv_cache_fraction())
