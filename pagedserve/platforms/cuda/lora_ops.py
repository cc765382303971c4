"""LoRA deltas on NVIDIA and AMD GPUs: the Triton shrink and expand of ``kernels.lora``, one
shrink over all shards of a projection (partial sums over parts of K, for BGMV), one expand per
shard into its column slice (ROCm inherits the CUDA platform and with it these)."""

from __future__ import annotations

from pagedserve.lora.ops import LoRAOps


class TritonLoRAOps(LoRAOps):
    @classmethod
    def add_lora(cls, out, x, a, b, shards, rows) -> None:
        from pagedserve.platforms.cuda.kernels import lora

        shrunk = lora.shrink(x.contiguous(), a, rows)
        rank = b.shape[2]
        for s, (off, n) in enumerate(shards):
            lora.expand(shrunk[..., s * rank:(s + 1) * rank], b[:, off:off + n],
                        out[:, off:off + n], rows)
