"""Intel Gaudi (HPU) through the habana_frameworks PyTorch bridge, in its default lazy mode.

Gaudi compiles a graph per distinct input shape, so this platform turns on shape bucketing
(worker/shape_buckets.py: padded steps, each bucket run once at start-up) and ends every
forward with ``habana_frameworks.torch.core.mark_step``, which hands the ops accumulated so
far to the graph compiler (or its cache) and launches them. Decode buckets replay HPU graphs
(``platforms/hpu/graphs.py``). Attention is the portable torch paged attention on the ``hpu``
device. Written against Habana's documented APIs and never run on real Gaudi hardware by this
project: see docs/platforms.md.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch

from pagedserve.platforms.interface import GraphRunner, MemoryInfo, Platform, PlatformUnavailable


def habana_module(module: str):
    """``habana_frameworks.torch.<module>``; importing ``habana_frameworks.torch`` registers
    the ``hpu`` device with torch."""
    try:
        importlib.import_module("habana_frameworks.torch")
        return importlib.import_module(f"habana_frameworks.torch.{module}")
    except ImportError as exc:
        raise PlatformUnavailable(
            "the hpu platform needs Intel Gaudi's habana_frameworks package "
            "(Gaudi software stack)") from exc


class HpuPlatform(Platform):
    name: ClassVar[str] = "hpu"
    device_type: ClassVar[str] = "hpu"
    # The bridge's host allocator pins memory for pin_memory=True (unverified on hardware).
    pin_swap_memory: ClassVar[bool] = True
    profiles_memory: ClassVar[bool] = True
    buckets_shapes: ClassVar[bool] = True
    # Its graphs are recorded per shape bucket at warm-up, against the weights' and the KV
    # pool's addresses; sleep mode would need them all recorded again (untested: refused).
    supports_sleep_mode: ClassVar[bool] = False
    # Gaudi's TPC kernels and engines work on 128-token blocks.
    default_block_size: ClassVar[int] = 128
    dist_backend: ClassVar[str] = "hccl"
    ray_resource: ClassVar[str] = "HPU"
    visible_devices_env: ClassVar[str | None] = "HABANA_VISIBLE_MODULES"

    @classmethod
    def check_available(cls) -> None:
        if not habana_module("hpu").is_available():
            raise PlatformUnavailable("no Gaudi device: habana_frameworks sees no HPU")

    @classmethod
    def device_count(cls) -> int:
        return habana_module("hpu").device_count()

    @classmethod
    def bind_device(cls, index: int, ranks_on_host: int) -> None:
        habana_module("hpu").set_device(index)
        habana_module("distributed.hccl")  # registers the hccl backend with torch.distributed

    @classmethod
    def memory_info(cls) -> MemoryInfo:
        free, total = habana_module("hpu").mem_get_info()
        return MemoryInfo(free_bytes=free, total_bytes=total)

    @classmethod
    def reset_peak_memory(cls) -> None:
        habana_module("hpu").reset_peak_memory_stats()

    @classmethod
    def peak_memory_bytes(cls) -> int:
        return habana_module("hpu").max_memory_allocated()

    @classmethod
    def synchronize(cls) -> None:
        habana_module("hpu").synchronize()

    @classmethod
    def end_forward(cls) -> None:
        habana_module("core").mark_step()

    @classmethod
    def graph_runner(cls) -> type[GraphRunner]:
        from pagedserve.platforms.hpu.graphs import HpuGraphRunner

        return HpuGraphRunner

    @classmethod
    def allocate_kv_cache(cls, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Gaudi pools are allocated eagerly; zero them so no stale bytes are ever read.
        return torch.zeros(shape, dtype=dtype, device=cls.device())
