"""The CPU attention backend: every float32 step in C calls (one, or two where one-row
queries share the step with prompt chunks) that write the step's keys and values and read the
paged cache (float32 or bfloat16) through the block tables, so no context is gathered; other
dtypes and layouts in the portable torch ops."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_paged import SHORT_QUERY, TorchPagedAttention
from pagedserve.platforms.cpu import layer_ops

F32 = torch.float32
KV_DTYPES = (F32, torch.bfloat16)  # the cache element types the kernels read


class CpuPagedAttention(TorchPagedAttention):
    """Two kernels of ``csrc/layer_ops.c``, both with an online softmax in float32:

    ``lo_paged_decode`` takes every decode row and speculative verify chunk (one known token
    and its drafts, up to ``SHORT_QUERY`` rows), attending per (query row, head), whatever
    else the step holds. A verify chunk's row j, after c cached tokens, runs as a sequence of
    its own that attends over the first c + j + 1 slots of its block table, which is causal
    attention within the chunk, since the kernel writes every row's key and value before it
    attends: each verified position gets the attention a decode step there would.

    ``lo_paged_prefill`` takes the prompt chunks (one row or many, after any cached prefix)
    and longer chunks: blocked, a tile of query rows of one kv head's query heads at a time
    over tiles of keys. A row's result does not depend on its tile, so a prompt's numbers do
    not depend on how it was chunked or whether its prefix was cached.

    A step holding both kinds makes both calls, each on its own sequences
    (``AttentionMetadata.decode_cpu`` says which are which). So a sequence's rows are
    computed the same whatever shares its step: with the int8 activations of the quantized
    layers, which turn a last-place difference into a quantization step, a greedy stream's
    tokens (or a speculative stream's verdicts) would otherwise change when a prompt joined
    its step.

    One backend serves every layer, so the step's metadata is checked and turned into
    kernel calls once, on the first layer that sees it: a step builds a new
    ``AttentionMetadata`` and never mutates it. The backend holds the last one, so a later
    step's object cannot reuse its identity."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if meta is not self._meta:
            self._meta, self._plan = meta, _plan(meta)
        if self._plan is None or not _native_layout(q, k, v, kv_cache):
            return super().forward(q, k, v, kv_cache, meta, window, softcap)
        out = torch.empty(q.shape, dtype=F32)
        num_blocks, block_size = kv_cache.shape[1:3]
        lib = layer_ops.library()
        for name, meta_args in self._plan.calls:  # disjoint rows of out
            getattr(lib, name)(
                q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                v.data_ptr(), v.stride(0), v.stride(1), kv_cache.data_ptr(),
                kv_cache.dtype == torch.bfloat16, num_blocks,
                *meta_args, self.num_heads, self.num_kv_heads, self.head_size, block_size,
                self.scale, window or 0, softcap or 0.0, out.data_ptr(),
                torch.get_num_threads())
        return out


class _Plan(NamedTuple):
    """A step's kernel calls: (function, its metadata arguments), and the tensors whose
    pointers those arguments hold (kept alive with the plan)."""

    calls: tuple[tuple[str, tuple], ...]
    tensors: tuple[torch.Tensor, ...]


def _plan(meta: AttentionMetadata) -> _Plan | None:
    """The kernel calls for ``meta``, or None where its tensors have another layout or rows
    belong to no sequence (the kernels would leave them unwritten)."""
    if not _layout_ok(meta) or sum(meta.query_lens_cpu) != meta.num_tokens:
        return None
    by_rows = _row_by_row(meta)
    if meta.is_decode_only and all(by_rows):  # the common step: no gathering
        return _Plan((("lo_paged_decode", _decode_args(meta.slot_mapping, meta.block_tables,
                                                        meta.seq_lens, None, meta.num_seqs)),),
                     ())
    chunks = [i for i, rows in enumerate(by_rows) if not rows]
    calls, kept = [], []
    if chunks:
        seq_ids = None if len(chunks) == meta.num_seqs else torch.tensor(chunks,
                                                                         dtype=torch.int32)
        calls.append(("lo_paged_prefill", _prefill_args(meta, seq_ids, len(chunks))))
        kept.append(seq_ids)
    if len(chunks) < meta.num_seqs:
        rows, tables, seen = _rows_of(meta, [i for i, rows in enumerate(by_rows) if rows])
        calls.append(("lo_paged_decode", _decode_args(
            meta.slot_mapping, tables, seen, rows if chunks else None, len(rows))))
        kept += [rows, tables, seen]
    return _Plan(tuple(calls), tuple(t for t in kept if t is not None))


def _row_by_row(meta: AttentionMetadata) -> list[bool]:
    """Per sequence, whether ``lo_paged_decode`` takes its rows: a decode or a verify chunk
    of at most ``SHORT_QUERY`` rows (without ``decode_cpu``: a step's one-row queries, or all
    of a ``decode_or_verify`` step's)."""
    lens = meta.query_lens_cpu
    decode = meta.decode_cpu or [meta.decode_or_verify or n == 1 for n in lens]
    return [d and n <= SHORT_QUERY for d, n in zip(decode, lens)]


def _rows_of(meta: AttentionMetadata, seqs: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query rows of sequences ``seqs``, each as a sequence of ``lo_paged_decode``: its
    row index, its sequence's block table and the keys it sees (its position plus one, which
    is causal attention within a verify chunk, since the kernel writes every row's key and
    value before it attends)."""
    lens = torch.tensor([meta.query_lens_cpu[i] for i in seqs])
    seq_of_row = torch.repeat_interleave(torch.tensor(seqs), lens)
    offset = torch.arange(len(seq_of_row)) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    rows = meta.query_start_loc[seq_of_row].long() + offset
    seen = (meta.context_lens[seq_of_row].long() + offset + 1).to(torch.int32)
    return rows, meta.block_tables[seq_of_row].contiguous(), seen


def _decode_args(slots: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor,
                 rows: torch.Tensor | None, seqs: int) -> tuple:
    """lo_paged_decode's (slot_mapping, block_tables, its row stride, seq_lens, rows, seqs)."""
    return (slots.data_ptr(), tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
            None if rows is None else rows.data_ptr(), seqs)


def _prefill_args(meta: AttentionMetadata, seq_ids: torch.Tensor | None, count: int) -> tuple:
    """lo_paged_prefill's (slot_mapping, block_tables, its row stride, query_start_loc,
    seq_lens, sequences, seq_ids, count)."""
    tables = meta.block_tables
    return (meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0),
            meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(), meta.num_seqs,
            None if seq_ids is None else seq_ids.data_ptr(), count)


def _layout_ok(meta: AttentionMetadata) -> bool:
    """The dtypes and strides the kernels read the metadata in."""
    return (meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous()
            and meta.block_tables.dtype == torch.int32 and meta.block_tables.stride(1) == 1
            and meta.query_start_loc.dtype == torch.int32
            and meta.query_start_loc.is_contiguous()
            and meta.seq_lens.dtype == torch.int32 and meta.seq_lens.is_contiguous())


def _native_layout(q, k, v, kv_cache) -> bool:
    return (q.dtype == F32 and k.dtype == F32 and v.dtype == F32 and kv_cache.dtype in KV_DTYPES
            and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
            and kv_cache.is_contiguous())
