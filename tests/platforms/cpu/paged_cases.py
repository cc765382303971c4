"""Paged KV pools for the CPU attention tests (decode and prefill), and the float64 attention
they are checked against."""

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


def prefill_case(block_size: int, heads: int, kv_heads: int, dim: int, contexts: list[int],
                 news: list[int], seed: int, dtype: torch.dtype = torch.float32):
    """A step of prompt chunks: sequence i has ``contexts[i]`` tokens in a NaN-poisoned pool of
    ``dtype`` (rounded into it) and ``news[i]`` new rows after them, whose k/v the step
    writes. Blocks in no table, table padding and the unwritten tail of a sequence's last
    block stay NaN. Returns (cache, q, k, v, meta, keys, values): each sequence's float32 keys
    and values, unrounded, context and new rows."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in zip(contexts, news)) + 3
    cache = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, keys, values, slots = [], [], [], []
    for c, n in zip(contexts, news):
        blocks = [free.pop() for _ in range(-(-(c + n) // block_size))]
        tables.append(blocks)
        k, v = torch.randn(2, c + n, kv_heads, dim, generator=gen).unbind()
        keys.append(k)
        values.append(v)
        for p in range(c):
            cache[0, blocks[p // block_size], p % block_size] = k[p]
            cache[1, blocks[p // block_size], p % block_size] = v[p]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    width = max(len(t) for t in tables) + 1  # padded with a poisoned block
    table_t = torch.tensor([t + [free[0]] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for n in news:
        starts.append(starts[-1] + n)
    seq_lens = [c + n for c, n in zip(contexts, news)]
    meta = AttentionMetadata(
        num_seqs=len(news), num_tokens=sum(news), max_query_len=max(news),
        max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(contexts, dtype=torch.int32), block_tables=table_t,
        slot_mapping=torch.tensor(slots), query_lens_cpu=list(news), seq_lens_cpu=seq_lens,
        decode_cpu=[False] * len(news))
    # q/k/v are strided views of a fused projection, as in the model.
    rows = sum(news)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen) * 2
    q = qkv[:, :heads * dim].view(rows, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
    k.copy_(torch.cat([kk[c:] for kk, c in zip(keys, contexts)]))
    v.copy_(torch.cat([vv[c:] for vv, c in zip(values, contexts)]))
    return cache, q, k, v, meta, keys, values


def causal_reference(q, keys, values, contexts: list[int], scale: float, group: int,
                     dtype: torch.dtype = torch.float32, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """Float64 attention of each new row of sequence i (row j at position contexts[i] + j)
    over keys 0 .. its position (with ``window``, the last ``window`` of them), as a cache of
    ``dtype`` holds them; ``softcap`` caps the scaled scores (``AttentionBackend``)."""
    outs, start = [], 0
    for k, v, c in zip(keys, values, contexts):
        n = k.shape[0] - c
        k = k.to(dtype).double().repeat_interleave(group, dim=1)
        v = v.to(dtype).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + n].double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        key_pos, query_pos = torch.arange(k.shape[0])[None, :], torch.arange(c, c + n)[:, None]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= key_pos <= query_pos - window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        start += n
    return torch.cat(outs)
