"""LoRA deltas on NVIDIA and AMD GPUs: the Triton shrink and expand of ``kernels.lora``, one
shrink and one expand over all shards of a projection (ROCm inherits the CUDA platform and with
it these).

A step of few rows (BGMV: decode) runs each shrink on a side stream, beside the base matmul that
reads the same activations, and the expand waits for it: the batch-1 step's 128 shrinks are
each a few microseconds of latency that the base matmul's time can cover (captured graphs keep
the fork and the join). The shrink's output is allocated on the compute stream, so the caching
allocator never hands its memory to the side stream while the expand still reads it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedserve.lora.ops import LoRAOps


class TritonLoRAOps(LoRAOps):
    _side: ClassVar[dict[torch.device, torch.cuda.Stream]] = {}

    @classmethod
    def shrink(cls, x, a, rows) -> torch.Tensor:
        from pagedserve.platforms.cuda.kernels import lora

        x = x.contiguous()
        out = lora.shrink_buffer(x, a)
        if x.shape[0] > lora.BGMV_MAX_ROWS or not x.is_cuda:  # CPU: Triton's interpreter
            return lora.shrink(x, a, rows, out)
        side = cls._side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            lora.shrink(x, a, rows, out)
        return out

    @classmethod
    def expand(cls, shrunk, b, out, shards, rows) -> None:
        from pagedserve.platforms.cuda.kernels import lora

        if out.shape[0] <= lora.BGMV_MAX_ROWS and out.is_cuda:
            torch.cuda.current_stream(out.device).wait_stream(cls._side_stream(out.device))
        lora.expand(shrunk, b, out, shards, rows)

    @classmethod
    def _side_stream(cls, device: torch.device) -> torch.cuda.Stream:
        if device not in cls._side:
            cls._side[device] = torch.cuda.Stream(device)
        return cls._side[device]
