"""The CPU platform: always available, KV pool in host RAM. Quantized matmuls, decode attention
and the layer ops run small C kernels built at first use, torch ops where they do not build."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedserve.platforms import host_memory
from pagedserve.platforms.interface import MemoryInfo, Platform

if TYPE_CHECKING:
    from pagedserve.attention.backend import AttentionBackend
    from pagedserve.models.layer_ops import LayerOps
    from pagedserve.quant.linear_method import LinearMethod, MatmulNumerics
    from pagedserve.quant.weights import LoadedWeight


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"

    @classmethod
    def check_available(cls) -> None:
        return None

    @classmethod
    def bind_device(cls, index: int, ranks_on_host: int) -> None:
        # Ranks on one host share its cores: each takes its share, so none oversubscribes.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_host))

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        # bf16 matmuls are slow on CPUs without AMX; float32 is the safe fast default.
        return torch.float32

    @classmethod
    def attention_backend(cls) -> type[AttentionBackend]:
        from pagedserve.platforms.cpu import layer_ops

        if layer_ops.available():
            from pagedserve.platforms.cpu.attention import CpuPagedAttention

            return CpuPagedAttention
        return super().attention_backend()

    @classmethod
    def layer_ops(cls) -> type[LayerOps]:
        from pagedserve.platforms.cpu import layer_ops

        return layer_ops.CpuLayerOps if layer_ops.available() else super().layer_ops()

    @classmethod
    def linear_method(cls, weight: LoadedWeight,
                      numerics: MatmulNumerics | None = None) -> LinearMethod:
        """Grouped 4- and 8-bit weights stay quantized: in the native kernels (with int8
        activations unless ``numerics.int8_activations`` is False), else in torch's int4
        kernel where its groups fit; FP8 and everything else are dequantized at load (CPUs
        have no FP8 arithmetic)."""
        from pagedserve.platforms.cpu import native_quant
        from pagedserve.platforms.cpu.quant_linear import (
            Int4PackLinearMethod,
            NativeQuantLinearMethod,
            kernel_group,
        )
        from pagedserve.quant.linear_method import MatmulNumerics
        from pagedserve.quant.weights import GroupQuantWeight

        if isinstance(weight, GroupQuantWeight):
            if native_quant.available():
                return NativeQuantLinearMethod((numerics or MatmulNumerics()).int8_activations)
            if kernel_group(weight.group_size):
                return Int4PackLinearMethod()
        return super().linear_method(weight)

    @classmethod
    def lora_ops(cls):
        from pagedserve.platforms.cpu.lora_ops import GroupedLoRAOps

        return GroupedLoRAOps

    @classmethod
    def kv_cache_torch_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        """bfloat16 under any model dtype: the attention kernels widen it as they read it."""
        if kv_cache_dtype == "bfloat16":
            return torch.bfloat16
        return super().kv_cache_torch_dtype(kv_cache_dtype, model_dtype)

    @classmethod
    def memory_info(cls) -> MemoryInfo:
        return MemoryInfo(free_bytes=host_memory.available_bytes(),
                          total_bytes=host_memory.total_bytes())

    @classmethod
    def kv_cache_budget_bytes(cls, utilization: float, peak_used_bytes: int) -> int:
        # Weights already sit in RAM, so what is free now is what the pool can take.
        from pagedserve import envs

        return int(cls.memory_info().free_bytes * envs.cpu_kv_cache_fraction())
