"""NVIDIA GPUs: Triton paged attention, CUDA graphs for decode, pinned-memory swap and KV
offload on a copy stream."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from pagedserve import envs
from pagedserve.platforms.interface import (
    BlockCopier,
    ChainGraphRunner,
    GraphRunner,
    MemoryInfo,
    Platform,
    PlatformUnavailable,
    WeightStream,
)

if TYPE_CHECKING:
    from pagedserve.quant.linear_method import LinearMethod, MatmulNumerics
    from pagedserve.quant.weights import LoadedWeight


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    pin_swap_memory: ClassVar[bool] = True
    profiles_memory: ClassVar[bool] = True
    runs_ahead: ClassVar[bool] = True
    dist_backend: ClassVar[str] = "nccl"  # ROCm's torch maps it to RCCL
    ray_resource: ClassVar[str] = "GPU"
    visible_devices_env: ClassVar[str | None] = "CUDA_VISIBLE_DEVICES"

    @classmethod
    def check_available(cls) -> None:
        if not torch.cuda.is_available() or torch.version.hip is not None:
            raise PlatformUnavailable(
                "no CUDA device: torch.cuda.is_available() is False in this torch build "
                f"({torch.__version__})")
        cls._require_triton("pip install triton")
        envs.pdl()  # bad values fail at start, not at the first kernel launch
        envs.w4a16_wgmma()

    @classmethod
    def _require_triton(cls, how_to_install: str) -> None:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise PlatformUnavailable(
                f"the {cls.name} platform needs triton: {how_to_install}") from exc

    @classmethod
    def device_count(cls) -> int:
        return torch.cuda.device_count()

    @classmethod
    def device(cls) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    @classmethod
    def bind_device(cls, index: int, ranks_on_host: int) -> None:
        torch.cuda.set_device(index)

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    @classmethod
    def attention_backend(cls):
        from pagedserve.platforms.cuda.attention import TritonAttentionBackend

        return TritonAttentionBackend

    @classmethod
    def layer_ops(cls):
        from pagedserve.platforms.cuda.layer_ops import TritonLayerOps

        return TritonLayerOps

    @classmethod
    def linear_method(cls, weight: LoadedWeight,
                      numerics: MatmulNumerics | None = None) -> LinearMethod:
        """4-bit grouped weights stay packed (W4A16 Triton kernel); FP8 weights run W8A8 in the
        FP8 tensor cores where the GPU has them (compute capability 8.9+) and weight-only
        elsewhere; 8-bit and dense weights take the inherited path (dequantized at load)."""
        from pagedserve.platforms.cuda import quant_linear
        from pagedserve.quant.linear_method import MatmulNumerics
        from pagedserve.quant.weights import Fp8Weight

        numerics = numerics or MatmulNumerics()
        if quant_linear.supports(weight):
            return quant_linear.W4A16LinearMethod()
        if isinstance(weight, Fp8Weight) and cls.supports_fp8_matmul():
            from pagedserve.platforms.cuda.fp8_linear import Fp8LinearMethod

            return Fp8LinearMethod(cls.fp8_dtype(), numerics.fp8_fast_accumulation)
        if isinstance(weight, Fp8Weight):
            from pagedserve.platforms.cuda.fp8_weight_only_linear import (
                Fp8WeightOnlyLinearMethod,
            )

            return Fp8WeightOnlyLinearMethod()
        return super().linear_method(weight)

    @classmethod
    def lora_ops(cls):
        from pagedserve.platforms.cuda.lora_ops import TritonLoRAOps

        return TritonLoRAOps

    @classmethod
    def supports_fp8_matmul(cls) -> bool:
        return torch.cuda.get_device_capability() >= (8, 9)

    @classmethod
    def fp8_dtype(cls) -> torch.dtype:
        """The FP8 type this GPU's matmuls read."""
        return torch.float8_e4m3fn

    @classmethod
    def kv_cache_torch_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        if kv_cache_dtype.startswith("fp8"):
            return torch.float8_e4m3fn
        return super().kv_cache_torch_dtype(kv_cache_dtype, model_dtype)

    @classmethod
    def memory_info(cls) -> MemoryInfo:
        free, total = torch.cuda.mem_get_info()
        return MemoryInfo(free_bytes=free, total_bytes=total)

    @classmethod
    def kv_cache_budget_bytes(cls, utilization: float, peak_used_bytes: int) -> int:
        # Other processes on the card count against the budget too.
        info = cls.memory_info()
        others = info.total_bytes - info.free_bytes - torch.cuda.memory_reserved()
        return max(0, int(info.total_bytes * utilization) - peak_used_bytes - max(0, others))

    @classmethod
    def reset_peak_memory(cls) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    @classmethod
    def peak_memory_bytes(cls) -> int:
        return torch.cuda.max_memory_allocated()

    @classmethod
    def weight_stream(cls, num_slots: int) -> WeightStream:
        from pagedserve.platforms.cuda.weight_stream import CudaWeightStream

        return CudaWeightStream(num_slots)

    @classmethod
    def release_cached_memory(cls) -> None:
        torch.cuda.empty_cache()

    @classmethod
    def synchronize(cls) -> None:
        torch.cuda.synchronize()

    @classmethod
    def block_copier(cls) -> BlockCopier:
        from pagedserve.platforms.cuda.block_copier import StreamBlockCopier

        return StreamBlockCopier(cls)

    @classmethod
    def record_event(cls) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    @classmethod
    def graph_runner(cls) -> type[GraphRunner]:
        from pagedserve.platforms.cuda.graphs import CudaGraphRunner

        return CudaGraphRunner

    @classmethod
    def chain_graphs(cls) -> type[ChainGraphRunner]:
        from pagedserve.platforms.cuda.chain_graphs import ChainGraphs

        return ChainGraphs
