"""Offloaded weights brought to the GPU on a side stream (``--cpu-offload-gb``).

Host buffers are pinned, so each layer's copy is one ``cudaMemcpyAsync`` at the bus's rate,
queued on a copy stream of its own: the next layer's weights cross the bus while this one
computes. Events order the two streams per staging slot (``WeightStream``'s protocol): a copy
waits for the compute that last read its slot, the compute waits for its slot's copy. No call
synchronizes the host with the device.

Not the alternative, reading the pinned host memory in place through unified addressing
(vLLM's way): that needs no staging, but every kernel then reads its weights over the bus at
a fraction of the device memory's rate, and a kernel that reads a weight tile twice pays twice.
The copy version moves each byte once per forward and keeps the kernels as they are.

Never run on a GPU here (written on a CPU-only machine); ``scripts/gpu_check.sh cpu-offload``
measures it on the H200.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedserve.platforms.interface import WeightStream


class CudaWeightStream(WeightStream):
    pin_memory: ClassVar[bool] = True

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.stream = torch.cuda.Stream()
        # An event never recorded is complete: a slot's first copy and first read wait on
        # nothing.
        self.loaded = [torch.cuda.Event() for _ in range(num_slots)]
        self.released = [torch.cuda.Event() for _ in range(num_slots)]

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())

    def load(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.released[slot])
            dst.copy_(src, non_blocking=True)
            self.loaded[slot].record(self.stream)

    def wait(self, slot: int) -> None:
        torch.cuda.current_stream().wait_event(self.loaded[slot])

    def release(self, slot: int) -> None:
        self.released[slot].record(torch.cuda.current_stream())
