"""Intel Gaudi (HPU) through the habana_frameworks PyTorch bridge.

Attention runs the portable torch paged attention on the ``hpu`` device; Gaudi's graph mode
(``habana_frameworks.torch.hpu.wrap_in_hpu_graph``) and bucketed shapes are not wired in yet.
Written against Habana's documented APIs and never run on real Gaudi hardware by this
project: see docs/platforms.md.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch

from pagedserve.platforms.interface import MemoryInfo, Platform, PlatformUnavailable


def _hpu_module():
    """``habana_frameworks.torch.hpu``; importing ``habana_frameworks.torch`` registers the
    ``hpu`` device with torch."""
    try:
        importlib.import_module("habana_frameworks.torch")
        return importlib.import_module("habana_frameworks.torch.hpu")
    except ImportError as exc:
        raise PlatformUnavailable(
            "the hpu platform needs Intel Gaudi's habana_frameworks package "
            "(Gaudi software stack)") from exc


class HpuPlatform(Platform):
    name: ClassVar[str] = "hpu"
    device_type: ClassVar[str] = "hpu"
    pin_swap_memory: ClassVar[bool] = False
    dist_backend: ClassVar[str] = "hccl"
    ray_resource: ClassVar[str] = "HPU"

    @classmethod
    def check_available(cls) -> None:
        hpu = _hpu_module()
        if not hpu.is_available():
            raise PlatformUnavailable("no Gaudi device: habana_frameworks sees no HPU")

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        return torch.bfloat16

    @classmethod
    def bind_device(cls, index: int, ranks_on_host: int) -> None:
        _hpu_module().set_device(index)
        importlib.import_module("habana_frameworks.torch.distributed.hccl")  # registers hccl

    @classmethod
    def memory_info(cls) -> MemoryInfo:
        free, total = _hpu_module().mem_get_info()
        return MemoryInfo(free_bytes=free, total_bytes=total)

    @classmethod
    def synchronize(cls) -> None:
        _hpu_module().synchronize()

    @classmethod
    def allocate_kv_cache(cls, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Gaudi pools are allocated eagerly; zero them so no stale bytes are ever read.
        return torch.zeros(shape, dtype=dtype, device=cls.device())
