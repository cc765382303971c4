"""LoRA deltas on NVIDIA and AMD GPUs: the Triton shrink and expand of ``kernels.lora``, one
shrink and one expand over all shards of a projection (ROCm inherits the CUDA platform and with
it these)."""

from __future__ import annotations

from pagedserve.lora.ops import LoRAOps


class TritonLoRAOps(LoRAOps):
    @classmethod
    def add_lora(cls, out, x, a, b, shards, rows) -> None:
        from pagedserve.platforms.cuda.kernels import lora

        lora.expand(lora.shrink(x.contiguous(), a, rows), b, out, shards, rows)
