"""AMD Instinct GPUs through PyTorch's ROCm build.

ROCm's PyTorch exposes HIP devices under the ``torch.cuda`` API and Triton compiles for AMD
GPUs, so this platform reuses the CUDA platform's Triton kernels, memory queries and graph
capture (HIP graphs), and differs in detection, naming and FP8 support. Never run on real AMD
hardware by this project: see docs/platforms.md.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedserve.errors import ConfigError
from pagedserve.platforms.cuda.platform import CudaPlatform
from pagedserve.platforms.interface import PlatformUnavailable


class RocmPlatform(CudaPlatform):
    name: ClassVar[str] = "rocm"
    # HIP's own name; ROCR_VISIBLE_DEVICES, below it, is left to the user.
    visible_devices_env: ClassVar[str | None] = "HIP_VISIBLE_DEVICES"

    @classmethod
    def check_available(cls) -> None:
        if torch.version.hip is None:
            raise PlatformUnavailable(
                f"no ROCm device: this torch build ({torch.__version__}) has no HIP support")
        if not torch.cuda.is_available():
            raise PlatformUnavailable("no ROCm device: torch sees no AMD GPU")
        cls._require_triton("pip install pytorch-triton-rocm")

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        return torch.bfloat16

    @classmethod
    def supports_fp8_matmul(cls) -> bool:
        return _gcn_arch().startswith(("gfx94", "gfx95"))

    @classmethod
    def fp8_dtype(cls) -> torch.dtype:
        """MI300 (gfx94x) computes in e4m3fnuz; MI350 (gfx950) in the OCP e4m3fn."""
        return torch.float8_e4m3fnuz if _gcn_arch().startswith("gfx94") else torch.float8_e4m3fn

    @classmethod
    def kv_cache_torch_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        # MI300 (gfx94x) would store float8_e4m3fnuz, which the cache kernels do not encode
        # (they write and read float8_e4m3fn only); gfx950's e4m3fn path is unverified.
        if kv_cache_dtype.startswith("fp8"):
            arch = _gcn_arch().split(":")[0]
            raise ConfigError(
                f"--kv-cache-dtype {kv_cache_dtype} is not supported on rocm ({arch}): "
                "the Triton cache kernels do not handle AMD's FP8 KV cache yet; use auto")
        return super().kv_cache_torch_dtype(kv_cache_dtype, model_dtype)


def _gcn_arch() -> str:
    """The GPU's architecture, e.g. ``gfx942:sramecc+:xnack-``."""
    return torch.cuda.get_device_properties(0).gcnArchName
