"""The portable paged attention against a float64 dense reference, with a poisoned pool of
float32 or of bfloat16 under float32 queries (the reference then reads the keys and values
rounded as the pool holds them)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_paged import TorchPagedAttention


def reference(q, keys, values, context_lens, query_lens, scale, group, window=None,
              softcap=None):
    """Dense causal attention per sequence in float64; keys/values are whole sequences. With
    ``window`` a row at position p sees keys p - window + 1 .. p; ``softcap`` caps the scaled
    scores (``AttentionBackend``)."""
    outs, start = [], 0
    for ctx, n, k, v in zip(context_lens, query_lens, keys, values):
        qs = q[start:start + n].double()
        start += n
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos_q, pos_k = torch.arange(ctx, ctx + n)[:, None], torch.arange(ctx + n)[None, :]
        hidden = pos_k > pos_q
        if window is not None:
            hidden |= pos_k <= pos_q - window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


@pytest.mark.parametrize("block_size,heads,kv_heads,head_dim", [
    (4, 4, 4, 16), (8, 8, 2, 32), (16, 6, 3, 64),
])
@pytest.mark.parametrize("shape", ["decode", "prefill", "chunked", "mixed"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_matches_dense_reference(block_size, heads, kv_heads, head_dim, shape, kv_dtype):
    check(block_size, heads, kv_heads, head_dim, shape, kv_dtype)


@pytest.mark.parametrize("shape", ["decode", "prefill", "chunked", "mixed"])
@pytest.mark.parametrize("window,softcap", [(6, None), (None, 2.0), (11, 3.0)], ids=str)
def test_window_and_softcap_match_dense_reference(shape, window, softcap):
    """Windows shorter than the contexts and prompts, not multiples of the block size, and
    caps that bend the scores, through every path (decode batch, short queries, prompts with
    and without cached context)."""
    check(4, 8, 2, 32, shape, torch.float32, window, softcap)


def check(block_size, heads, kv_heads, head_dim, shape, kv_dtype, window=None, softcap=None):
    torch.manual_seed(0)
    cases = {  # (context already cached, new query rows) per sequence
        "decode": [(5, 1), (17, 1), (1, 1), (30, 1)],
        "prefill": [(0, 7), (0, 1), (0, 19)],
        "chunked": [(9, 6), (16, 16), (3, 1)],
        "mixed": [(12, 1), (0, 13), (7, 5), (20, 1)],
    }[shape]
    num_blocks = 64
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"),
                       dtype=kv_dtype)
    perm = torch.randperm(num_blocks).tolist()  # shuffled, non-contiguous block tables
    tables, full_k, full_v, q_rows, new_k, new_v, slots = [], [], [], [], [], [], []
    for ctx, n in cases:
        total = ctx + n
        blocks = [perm.pop() for _ in range(-(-total // block_size))]
        tables.append(blocks)
        k = torch.randn(total, kv_heads, head_dim)
        v = torch.randn(total, kv_heads, head_dim)
        full_k.append(k)
        full_v.append(v)
        for p in range(ctx):  # the cached context is already in the pool
            cache[0, blocks[p // block_size], p % block_size] = k[p]
            cache[1, blocks[p // block_size], p % block_size] = v[p]
        q_rows.append(torch.randn(n, heads, head_dim))
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(ctx, total)]
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query_lens = [n for _, n in cases]
    seq_lens = [c + n for c, n in cases]
    meta = AttentionMetadata(
        num_seqs=len(cases), num_tokens=sum(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc=torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(),
                                     dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in cases], dtype=torch.int32),
        block_tables=table_t, slot_mapping=torch.tensor(slots), query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens)
    q = torch.cat(q_rows)
    scale = head_dim ** -0.5
    backend = TorchPagedAttention(heads, head_dim, kv_heads, scale)
    out = backend.forward(q, torch.cat(new_k), torch.cat(new_v), cache, meta, window, softcap)
    expected = reference(q, [k.to(kv_dtype) for k in full_k], [v.to(kv_dtype) for v in full_v],
                         [c for c, _ in cases], query_lens, scale, heads // kv_heads, window,
                         softcap)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    # The new keys landed in their slots, rounded as torch rounds them.
    flat_k = cache[0].reshape(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[torch.tensor(slots)], torch.cat(new_k).to(kv_dtype))
