"""Block moves between the GPU's KV pool and pinned host memory on a copy stream of their own.

The compute stream never waits for the whole device: each batch of copies first waits for the
work queued on the compute stream (the forward passes that wrote the blocks it reads, or read
the blocks it overwrites), and the next forward pass waits for the copy stream only
(``wait_device``). A device-to-host batch gathers its blocks into one contiguous staging tensor
on the device, then copies each run of consecutive host blocks with one DMA; host-to-device is
the reverse. Written for CUDA and ROCm (HIP streams under the same API); never run on a GPU by
this project so far: the CPU suite runs the default ``BlockCopier`` only.
"""

from __future__ import annotations

import torch

from pagedserve.platforms.interface import BlockCopier, Platform


def block_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ``ids``, first id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for pos, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            first_pos, first, length = runs[-1]
            runs[-1] = (first_pos, first, length + 1)
        else:
            runs.append((pos, block, 1))
    return runs


class StreamBlockCopier(BlockCopier):
    def __init__(self, platform: type[Platform]) -> None:
        super().__init__(platform)
        self.stream = torch.cuda.Stream()

    def to_host(self, pool: torch.Tensor, host: torch.Tensor, src: list[int],
                dst: list[int]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            index = _index(src, pool.device)
            staged = pool[:, :, index].movedim(2, 0).contiguous()
            for pos, first, length in block_runs(dst):
                host[first:first + length].copy_(staged[pos:pos + length], non_blocking=True)

    def to_device(self, host: torch.Tensor, pool: torch.Tensor, src: list[int],
                  dst: list[int]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            staged = torch.empty((len(src), *host.shape[1:]), dtype=host.dtype,
                                 device=pool.device)
            for pos, first, length in block_runs(src):
                staged[pos:pos + length].copy_(host[first:first + length], non_blocking=True)
            pool[:, :, _index(dst, pool.device)] = staged.movedim(0, 2)

    def wait_host(self) -> None:
        self.stream.synchronize()

    def wait_device(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """Block ids on the device without waiting for it: ``torch.tensor(..., device=)`` is a
    synchronous copy, which would hold the host until the copy stream (and the step it waits
    on) drained, and every step that moves blocks would lose its run-ahead."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
