"""Paged KV pools for the CPU decode attention tests, and the float64 attention they are
checked against."""

from __future__ import annotations

import random

import torch

from pagedserve.attention.metadata import AttentionMetadata


def decode_case(block_size: int, heads: int, kv_heads: int, dim: int, seq_lens: list[int],
                seed: int, dtype: torch.dtype = torch.float32):
    """A NaN-poisoned pool of ``dtype`` holding each sequence's context (rounded into it); the
    step's k/v are not in it. The keys and values returned are float32, unrounded."""
    gen = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    cache = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    free = list(range(num_blocks))
    gen.shuffle(free)
    tables, keys, values, slots = [], [], [], []
    for n in seq_lens:
        blocks = [free.pop() for _ in range(-(-n // block_size))]
        tables.append(blocks)
        k, v = torch.randn(2, n, kv_heads, dim).unbind()
        keys.append(k)
        values.append(v)
        for p in range(n - 1):
            cache[0, blocks[p // block_size], p % block_size] = k[p]
            cache[1, blocks[p // block_size], p % block_size] = v[p]
        slots.append(blocks[(n - 1) // block_size] * block_size + (n - 1) % block_size)
    # Padding past a table's end points at a poisoned block, which must never be read.
    width = max(len(t) for t in tables) + 1
    table_t = torch.tensor([t + [free[0]] * (width - len(t)) for t in tables],
                           dtype=torch.int32)
    num = len(seq_lens)
    meta = AttentionMetadata(
        num_seqs=num, num_tokens=num, max_query_len=1, max_seq_len=max(seq_lens),
        block_size=block_size, query_start_loc=torch.arange(num + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(seq_lens, dtype=torch.int32) - 1, block_tables=table_t,
        slot_mapping=torch.tensor(slots), query_lens_cpu=[1] * num, seq_lens_cpu=seq_lens)
    return cache, keys, values, meta


def dense_reference(q, keys, values, scale, group, dtype: torch.dtype = torch.float32):
    """Attention in float64 over the keys and values as a cache of ``dtype`` holds them."""
    outs = []
    for qi, k, v in zip(q.double(), keys, values):
        k = k.to(dtype).double().repeat_interleave(group, dim=1)
        v = v.to(dtype).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", qi, k) * scale
        outs.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(outs)
