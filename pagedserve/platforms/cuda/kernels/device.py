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


@functools.lru_cache(maxsize=8)
def shared_memory_bytes(device: torch.device) -> int | None:
    """The shared memory one program may use (the opt-in maximum: 227 KiB on the H100, 163 on
    the A100); None where unknown: the CPU, whose interpreter has no such limit, or a torch
    without the property."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None)


@functools.lru_cache(maxsize=8)
def converts_e4m3fn(device: torch.device) -> bool:
    """Whether Triton converts float8_e4m3fn values on ``device``: NVIDIA from sm_89, AMD's
    gfx950 and the interpreter. Elsewhere kernels read the bits as uint8 and decode them with
    integer operations (``fp8_gemv.fp8_as_float``)."""
    arch = gpu_arch(device)
    if arch is not None:
        return arch.startswith("gfx95")
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
