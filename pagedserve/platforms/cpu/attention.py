"""The CPU attention backend: decode-only float32 steps in one C call that reads keys and
values straight from the paged cache; everything else in the portable torch ops."""

from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_paged import TorchPagedAttention
from pagedserve.platforms.cpu.layer_ops import library


class CpuPagedAttention(TorchPagedAttention):
    """``lo_paged_decode`` (``csrc/layer_ops.c``) writes the step's keys and values and
    attends per (sequence, head) with an online softmax, walking the block table, so no
    context is gathered. Prefill, mixed steps and other dtypes take ``TorchPagedAttention``."""

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if not (meta.is_decode_only and self._native_layout(q, k, v, kv_cache, meta)):
            return super().forward(q, k, v, kv_cache, meta)
        out = torch.empty(q.shape, dtype=torch.float32)
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        library().lo_paged_decode(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(), meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(),
            meta.block_tables.stride(0), meta.seq_lens.data_ptr(), q.shape[0], self.num_heads,
            num_kv_heads, head_size, block_size, self.scale, out.data_ptr(),
            torch.get_num_threads())
        return out

    @staticmethod
    def _native_layout(q, k, v, kv_cache, meta: AttentionMetadata) -> bool:
        f32 = torch.float32
        return (q.dtype == f32 and k.dtype == f32 and v.dtype == f32 and kv_cache.dtype == f32
                and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
                and kv_cache.is_contiguous() and meta.slot_mapping.dtype == torch.int64
                and meta.slot_mapping.is_contiguous()
                and meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1
                and meta.seq_lens.dtype == torch.int32 and meta.seq_lens.is_contiguous())
