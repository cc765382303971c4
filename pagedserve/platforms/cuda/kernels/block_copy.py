"""KV block moves between the device pool and page-locked host memory, by the GPU's own loads and
stores through unified addressing (the host pool's pages are mapped into the device's address
space, so a kernel reads and writes them over the bus as it would device memory).

Why a kernel and not DMA copies: the device pool is layer-major (``[layers, 2, blocks, ...]``,
so each layer attends over its own slice) and the host pool block-major (one contiguous unit
per block of all layers, for the bus and for the block's file). A DMA per block and layer is 64
copies of 32 KiB for a Llama-3-8B block; gathering into a staging tensor first still took one
DMA per run of consecutive host blocks, and LRU-allocated host blocks are mostly runs of one:
the host then spent tens of microseconds queuing each, which in the multi-turn benchmark added
up to 12 s of a 25 s run. Here a batch of any size is one launch, and the layout change happens
in the same pass.

The grid is a fixed number of programs looping over the batch's (pair, piece, chunk) items
(``_PROGRAMS``): a copy is bound by the bus, and a few dozen programs keep enough bytes in flight
to fill it while leaving the SMs to the forward pass running beside it on the compute stream.
Both pools are read as int32 words (every piece, a block's keys or values of one layer, is a
multiple of 4 bytes), so any KV dtype moves bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PROGRAMS = 64
_CHUNK = 2048  # int32 words a program moves per item: 8 KiB


def to_host(pool: torch.Tensor, host: torch.Tensor, ids: torch.Tensor) -> None:
    """``host[ids[1, i]] = pool[:, :, ids[0, i]]`` for each pair ``i`` (``ids`` int64 [2, n] on
    the pool's device; ``host`` page-locked)."""
    _launch(pool, host, ids, to_host=True)


def to_device(host: torch.Tensor, pool: torch.Tensor, ids: torch.Tensor) -> None:
    """``pool[:, :, ids[1, i]] = host[ids[0, i]]`` for each pair ``i``."""
    _launch(pool, host, ids, to_host=False)


def _words(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous() or t.shape[-1] * t.element_size() % 4:
        raise ValueError(f"KV pools move as int32 words: got a {'non-' * (not t.is_contiguous())}"
                         f"contiguous {t.dtype} tensor of shape {tuple(t.shape)}")
    return t.view(torch.int32)


def _launch(pool: torch.Tensor, host: torch.Tensor, ids: torch.Tensor, to_host: bool) -> None:
    pairs = ids.shape[1]
    if not pairs:
        return
    layers, kv, num_blocks = pool.shape[:3]
    pieces = layers * kv
    piece = pool[0, 0, 0].numel() * pool.element_size() // 4
    chunks = triton.cdiv(piece, _CHUNK)
    items = pairs * pieces * chunks
    _move_blocks[(min(items, _PROGRAMS),)](
        _words(pool), _words(host), ids, ids.stride(0), items, pieces, chunks, piece,
        num_blocks, TO_HOST=to_host, CHUNK=_CHUNK)


@triton.jit(do_not_specialize=["items", "pieces", "chunks", "piece", "num_blocks"])
def _move_blocks(pool_ptr, host_ptr, ids_ptr, stride_ids, items, pieces, chunks, piece,
                 num_blocks, TO_HOST: tl.constexpr, CHUNK: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        pair = item // (pieces * chunks)
        p = (item // chunks % pieces).to(tl.int64)
        within = (item % chunks) * CHUNK + offs
        mask = within < piece
        src = tl.load(ids_ptr + pair)
        dst = tl.load(ids_ptr + stride_ids + pair)
        if TO_HOST:  # the pool's block src of piece p -> host block dst's piece p
            pool_at = (p * num_blocks + src) * piece
            host_at = (dst * pieces + p) * piece
            tl.store(host_ptr + host_at + within,
                     tl.load(pool_ptr + pool_at + within, mask=mask), mask=mask)
        else:
            host_at = (src * pieces + p) * piece
            pool_at = (p * num_blocks + dst) * piece
            tl.store(pool_ptr + pool_at + within,
                     tl.load(host_ptr + host_at + within, mask=mask), mask=mask)
