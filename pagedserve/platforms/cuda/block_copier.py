"""Block moves between the GPU's KV pool and pinned host memory on a copy stream of their own.

The compute stream never waits for the whole device: each batch of copies first waits for the
work queued on the compute stream (the forward passes that wrote the blocks it reads, or read
the blocks it overwrites), and the next forward pass waits for the copy stream only
(``wait_device``). A batch is one kernel launch (``kernels.block_copy``: the GPU reads and
writes the pinned host pool through unified addressing, changing the layout as it goes), so the
host's cost of a batch does not grow with its blocks. Written for CUDA and ROCm (HIP streams and
mapped pinned memory under the same API); the ROCm path never ran on an AMD GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.platforms.interface import BlockCopier, Platform


class StreamBlockCopier(BlockCopier):
    def __init__(self, platform: type[Platform]) -> None:
        super().__init__(platform)
        self.stream = torch.cuda.Stream()

    def to_host(self, pool: torch.Tensor, host: torch.Tensor, src: list[int],
                dst: list[int]) -> None:
        from pagedserve.platforms.cuda.kernels import block_copy

        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            block_copy.to_host(pool, host, _pairs(src, dst, pool.device))

    def to_device(self, host: torch.Tensor, pool: torch.Tensor, src: list[int],
                  dst: list[int]) -> None:
        from pagedserve.platforms.cuda.kernels import block_copy

        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            block_copy.to_device(host, pool, _pairs(src, dst, pool.device))

    def wait_host(self) -> None:
        self.stream.synchronize()

    def wait_device(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


def _pairs(src: list[int], dst: list[int], device: torch.device) -> torch.Tensor:
    """int64 [2, n] on the device, copied from page-locked memory on the current stream: from
    pageable memory the driver may first wait for the stream (and so for the step the copy
    stream waits on), and the host would lose its run-ahead."""
    ids = torch.from_numpy(np.array([src, dst], dtype=np.int64)).pin_memory()
    return ids.to(device, non_blocking=True)
