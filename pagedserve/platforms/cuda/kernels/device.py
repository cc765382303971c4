"""What the kernels' launch settings ask of the GPU they run on, cached per device."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def gpu_arch(device: torch.device) -> str | None:
    """The AMD GPU's ``gfx`` name under ROCm's torch; ``None`` on NVIDIA and the CPU."""
    if device.type != "cuda" or torch.version.hip is None:
        return None
    return torch.cuda.get_device_properties(device).gcnArchName


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (compute units on AMD); on the CPU, where Triton's
    interpreter runs the kernels, 8: any small number works."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count
