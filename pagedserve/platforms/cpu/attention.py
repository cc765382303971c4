"""The CPU attention backend: float32 steps of decode and short (speculative verify) queries
in one C call that reads keys and values straight from the paged cache (float32 or
bfloat16); everything else in the portable torch ops."""

from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_paged import SHORT_QUERY, TorchPagedAttention
from pagedserve.platforms.cpu import layer_ops

F32 = torch.float32
KV_DTYPES = (F32, torch.bfloat16)  # the cache element types lo_paged_decode reads


class CpuPagedAttention(TorchPagedAttention):
    """``lo_paged_decode`` (``csrc/layer_ops.c``) writes the step's keys and values and
    attends per (sequence, head) with an online softmax, walking the block table, so no
    context is gathered. Prefill, mixed steps and other dtypes take ``TorchPagedAttention``.

    A speculative verify step (k + 1 rows a sequence, with or without decode rows; not a
    prompt chunk, however short, so a prompt's numbers never depend on whether its prefix was
    cached) runs the same kernel, one query row as one sequence: row j of a sequence with c
    cached tokens attends over the first c + j + 1 slots of its block table, which is causal
    attention within the chunk, since the kernel writes every row's key and value before it
    attends. Each verified position thus gets the attention a decode step there would.

    One backend serves every layer, so the step's metadata is checked and turned into
    kernel arguments once, on the first layer that sees it: a step builds a new
    ``AttentionMetadata`` and never mutates it. The backend holds the last one, so a later
    step's object cannot reuse its identity."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._meta: AttentionMetadata | None = None
        self._meta_args: tuple | None = None
        self._row_meta: tuple[torch.Tensor, torch.Tensor] | None = None  # kept alive: pointers

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta is not self._meta:
            self._meta, self._row_meta = meta, _per_row(meta)
            self._meta_args = _meta_args(meta, self._row_meta)
        if self._meta_args is None or not _native_layout(q, k, v, kv_cache):
            return super().forward(q, k, v, kv_cache, meta)
        out = torch.empty(q.shape, dtype=F32)
        num_blocks, block_size = kv_cache.shape[1:3]
        layer_ops.library().lo_paged_decode(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), kv_cache.data_ptr(),
            kv_cache.dtype == torch.bfloat16, num_blocks,
            *self._meta_args, self.num_heads, self.num_kv_heads, self.head_size, block_size,
            self.scale, out.data_ptr(), torch.get_num_threads())
        return out


def _per_row(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a verify step of short queries: each query row's block table (its sequence's)
    and the keys it sees (its position plus one), int32; else None."""
    if meta.is_decode_only or not meta.decode_or_verify or meta.max_query_len > SHORT_QUERY \
            or meta.block_tables.dtype != torch.int32:
        return None
    lens = torch.tensor(meta.query_lens_cpu)
    seq_of_row = torch.repeat_interleave(torch.arange(meta.num_seqs), lens)
    offset = torch.arange(meta.num_tokens) - meta.query_start_loc[seq_of_row].long()
    seen = (meta.context_lens[seq_of_row].long() + offset + 1).to(torch.int32)
    return meta.block_tables[seq_of_row].contiguous(), seen


def _meta_args(meta: AttentionMetadata, per_row: tuple[torch.Tensor, torch.Tensor] | None
               ) -> tuple | None:
    """(slot_mapping, block_tables, its row stride, seq_lens, rows) for the kernel, one
    row per query token, or None where the step's queries are not all short or the metadata
    has another layout."""
    slots = meta.slot_mapping
    tables, seq_lens = per_row if per_row is not None else (meta.block_tables, meta.seq_lens)
    if not ((meta.is_decode_only or per_row is not None) and slots.dtype == torch.int64
            and slots.is_contiguous() and tables.dtype == torch.int32 and tables.stride(1) == 1
            and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()):
        return None
    return (slots.data_ptr(), tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
            meta.num_tokens)


def _native_layout(q, k, v, kv_cache) -> bool:
    return (q.dtype == F32 and k.dtype == F32 and v.dtype == F32 and kv_cache.dtype in KV_DTYPES
            and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
            and kv_cache.is_contiguous())
