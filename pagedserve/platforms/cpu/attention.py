"""The CPU attention backend: every float32 step in one C call that writes the step's keys
and values and reads the paged cache (float32 or bfloat16) through the block tables, so no
context is gathered; other dtypes and layouts in the portable torch ops."""

from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_paged import SHORT_QUERY, TorchPagedAttention
from pagedserve.platforms.cpu import layer_ops

F32 = torch.float32
KV_DTYPES = (F32, torch.bfloat16)  # the cache element types the kernels read


class CpuPagedAttention(TorchPagedAttention):
    """Two kernels of ``csrc/layer_ops.c``, both with an online softmax in float32:

    ``lo_paged_decode`` takes decode-only steps and speculative verify steps, attending per
    (sequence, head) query row. A verify step (k + 1 rows a sequence, with or without decode
    rows; not a prompt chunk, however short) runs it one query row as one sequence: row j of
    a sequence with c cached tokens attends over the first c + j + 1 slots of its block
    table, which is causal attention within the chunk, since the kernel writes every row's
    key and value before it attends. Each verified position thus gets the attention a decode
    step there would.

    ``lo_paged_prefill`` takes every other step (prompt chunks after any cached prefix, and
    the decode rows batched with them): blocked, a tile of query rows of one kv head's query
    heads at a time over tiles of keys. A row's result does not depend on its tile, so a
    prompt's numbers do not depend on how it was chunked or whether its prefix was cached.

    One backend serves every layer, so the step's metadata is checked and turned into
    kernel arguments once, on the first layer that sees it: a step builds a new
    ``AttentionMetadata`` and never mutates it. The backend holds the last one, so a later
    step's object cannot reuse its identity."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._meta: AttentionMetadata | None = None
        self._kernel: tuple[str, tuple] | None = None  # (function, its metadata arguments)
        self._row_meta: tuple[torch.Tensor, torch.Tensor] | None = None  # kept alive: pointers

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta is not self._meta:
            self._meta, self._row_meta = meta, _per_row(meta)
            decode = _meta_args(meta, self._row_meta)
            self._kernel = (("lo_paged_decode", decode) if decode is not None
                            else _prefill_kernel(meta))
        if self._kernel is None or not _native_layout(q, k, v, kv_cache):
            return super().forward(q, k, v, kv_cache, meta)
        name, meta_args = self._kernel
        out = torch.empty(q.shape, dtype=F32)
        num_blocks, block_size = kv_cache.shape[1:3]
        getattr(layer_ops.library(), name)(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), kv_cache.data_ptr(),
            kv_cache.dtype == torch.bfloat16, num_blocks,
            *meta_args, self.num_heads, self.num_kv_heads, self.head_size, block_size,
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
    """(slot_mapping, block_tables, its row stride, seq_lens, rows) for lo_paged_decode, one
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


def _prefill_kernel(meta: AttentionMetadata) -> tuple[str, tuple] | None:
    """``lo_paged_prefill`` and its (slot_mapping, block_tables, its row stride,
    query_start_loc, seq_lens, sequences), or None where the metadata has another layout or
    has query rows that belong to no sequence (the kernel would leave them unwritten)."""
    slots, tables, starts, seq_lens = (meta.slot_mapping, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens)
    if not (slots.dtype == torch.int64 and slots.is_contiguous()
            and tables.dtype == torch.int32 and tables.stride(1) == 1
            and starts.dtype == torch.int32 and starts.is_contiguous()
            and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
            and sum(meta.query_lens_cpu) == meta.num_tokens):
        return None
    return "lo_paged_prefill", (slots.data_ptr(), tables.data_ptr(), tables.stride(0),
                                starts.data_ptr(), seq_lens.data_ptr(), meta.num_seqs)


def _native_layout(q, k, v, kv_cache) -> bool:
    return (q.dtype == F32 and k.dtype == F32 and v.dtype == F32 and kv_cache.dtype in KV_DTYPES
            and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
            and kv_cache.is_contiguous())
