"""Paged attention in portable torch ops: the HPU platform's kernel, the CPU platform's
fallback (where its C kernels do not build or read the layout), and the reference the Triton
kernels are tested against.

Decode-only steps gather every sequence's blocks into one padded batch and run one masked
attention. So do the short queries of a mixed step (decodes, and the few tokens of a
speculative verify step, up to ``SHORT_QUERY`` rows each, padded to the longest); longer
prompt chunks attend per sequence, since their query lengths differ.

The cache may hold a narrower type than the queries (a bfloat16 pool under a float32 model):
keys and values are rounded into it and widened back as they are gathered, and a prompt
without cached context attends over its rounded keys too, so its numbers do not depend on
whether its prefix came from the cache.

A layer's window is part of each mask (decodes still gather the whole context), and a layer
that caps its scores attends in float32 spelled out (``_capped_attention``): no fused
attention caps scores.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata

# Queries of at most this many rows over cached context share one padded attention call.
SHORT_QUERY = 16


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the step's keys and values into their cache slots, rounded to its dtype."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping,
                                                              k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_size).index_copy_(0, slot_mapping,
                                                              v.to(kv_cache.dtype))


def context_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  num_tokens: int, block_size: int) -> torch.Tensor:
    """Cache slot of each of the first ``num_tokens`` positions of every sequence, flattened
    ``[batch * num_tokens]``. Positions past a sequence's end repeat its last slot, so every
    gathered key and value was written (finite) and masking the scores is enough."""
    positions = torch.arange(num_tokens, device=block_tables.device)[None, :]
    positions = torch.minimum(positions, (seq_lens.long() - 1)[:, None])
    blocks = block_tables.long().gather(1, positions // block_size)
    return (blocks * block_size + positions % block_size).flatten()


class TorchPagedAttention(AttentionBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Gathered keys and values land in reused buffers, one per dtype (the cache's, and the
        # queries' they are widened into): a fresh tensor of that size is a fresh mmap on the
        # host, and its page faults cost more than the copy itself.
        self._workspaces: dict[torch.dtype, torch.Tensor] = {}

    def _workspace(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first ``n`` elements of the reused buffer of ``dtype``, grown by a quarter."""
        buffer = self._workspaces.get(dtype)
        if buffer is None or buffer.numel() < n or buffer.device != device:
            buffer = self._workspaces[dtype] = torch.empty(n + n // 4, dtype=dtype,
                                                           device=device)
        return buffer[:n]

    def _gather(self, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, num_tokens: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[batch, num_tokens, num_kv_heads, head_size]`` of each sequence,
        in ``dtype``."""
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        slots = context_slots(block_tables, seq_lens, num_tokens, block_size)
        row = num_kv_heads * head_size
        n = slots.numel() * row
        gathered = self._workspace(2 * n, kv_cache.dtype, kv_cache.device)
        torch.index_select(kv_cache[0].view(-1, row), 0, slots, out=gathered[:n].view(-1, row))
        torch.index_select(kv_cache[1].view(-1, row), 0, slots, out=gathered[n:].view(-1, row))
        if dtype != kv_cache.dtype:
            gathered = self._workspace(2 * n, dtype, kv_cache.device).copy_(gathered)
        shape = (block_tables.shape[0], num_tokens, num_kv_heads, head_size)
        return gathered[:n].view(shape), gathered[n:].view(shape)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        keys_seen = _KeysSeen(window, softcap)
        if meta.is_decode_only:
            return self._decode(q, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len,
                                keys_seen)
        out = torch.empty_like(q)
        short = [i for i, (n, total) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu))
                 if n == 1 or n <= SHORT_QUERY and n < total]
        if short:
            self._short_queries(q, kv_cache, meta, short, out, keys_seen)
        self._prefill(q, k, v, kv_cache, meta, out, set(short), keys_seen)
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
        """q ``[B, Lq, H, D]``, keys/values ``[B, Lk, Hkv, D]`` -> ``[B, Lq, H, D]``; ``mask``
        None: causal over ``Lq == Lk`` rows."""
        q, keys, values = (x.transpose(1, 2) for x in (q, keys, values))
        if softcap is not None:  # no fused kernel caps scores: spelled out
            out = _capped_attention(q, keys, values, mask, self.scale, softcap)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2)

    def _decode(self, q, kv_cache, block_tables, seq_lens, max_seq_len: int,
                keys_seen: _KeysSeen) -> torch.Tensor:
        """One query row per sequence, all sequences in one padded, masked attention."""
        keys, values = self._gather(kv_cache, block_tables, seq_lens, max_seq_len, q.dtype)
        positions = torch.arange(max_seq_len, device=q.device)
        valid = keys_seen.mask(positions[None, :], (seq_lens - 1)[:, None])
        return self._attend(q[:, None], keys, values, valid[:, None, None, :],
                            keys_seen.softcap)[:, 0]

    def _short_queries(self, q, kv_cache, meta: AttentionMetadata, seqs: list[int],
                       out: torch.Tensor, keys_seen: _KeysSeen) -> None:
        """Sequences ``seqs``' queries, padded to the longest of them, in one masked attention:
        query row r of a sequence of ``seq_len`` sits at ``seq_len - q_len + r`` and sees the
        keys up to it (a padded row repeats the last one; its result is dropped)."""
        q_lens = [meta.query_lens_cpu[i] for i in seqs]
        width, max_seq_len = max(q_lens), max(meta.seq_lens_cpu[i] for i in seqs)
        index = torch.tensor(seqs, device=q.device)
        starts = meta.query_start_loc[index].long()
        if width == 1:  # decodes only
            out[starts] = self._decode(q[starts], kv_cache, meta.block_tables[index],
                                       meta.seq_lens[index], max_seq_len, keys_seen)
            return
        seq_lens, lens = meta.seq_lens[index].long(), torch.tensor(q_lens, device=q.device)
        r = torch.arange(width, device=q.device)
        rows = starts[:, None] + torch.minimum(r, lens[:, None] - 1)
        keys, values = self._gather(kv_cache, meta.block_tables[index], seq_lens, max_seq_len,
                                    q.dtype)
        query_pos = (seq_lens - lens)[:, None] + r  # [B, width]
        key_pos = torch.arange(max_seq_len, device=q.device)
        mask = keys_seen.mask(key_pos[None, None, :], query_pos[:, :, None])  # [B, width, keys]
        result = self._attend(q[rows], keys, values, mask[:, None], keys_seen.softcap)
        valid = r[None, :] < lens[:, None]
        out[rows[valid]] = result[valid]

    def _prefill(self, q, k, v, kv_cache, meta: AttentionMetadata, out: torch.Tensor,
                 skip: set[int], keys_seen: _KeysSeen) -> None:
        """The other sequences, one attention call each."""
        start = 0
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            rows = slice(start, start + q_len)
            start += q_len
            if i in skip:
                continue
            fresh = q_len == seq_len
            if fresh:
                # No cached context: attend over the fresh keys directly, as the cache holds
                # them.
                keys, values = (_as_cached(x[None, rows], kv_cache.dtype) for x in (k, v))
            else:
                keys, values = self._gather(kv_cache, meta.block_tables[i:i + 1],
                                            meta.seq_lens[i:i + 1], seq_len, q.dtype)
            # Query row r sits at position seq_len - q_len + r; a fresh prompt without a window
            # is plain causal attention, which needs no mask.
            mask = None if fresh and keys_seen.window is None else keys_seen.mask(
                torch.arange(seq_len, device=q.device)[None, :],
                torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None])
            out[rows] = self._attend(q[None, rows], keys, values, mask, keys_seen.softcap)[0]


class _KeysSeen(NamedTuple):
    """A layer's window and score cap (``AttentionBackend``)."""

    window: int | None
    softcap: float | None

    def mask(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """Which keys each query sees (broadcast): those up to its position, and within
        its window."""
        seen = key_pos <= query_pos
        return seen if self.window is None else seen & (key_pos > query_pos - self.window)


def _capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
    """Attention with scores ``softcap * tanh(scale * q.k / softcap)``, in float32; q
    ``[B, H, Lq, D]``, keys/values ``[B, Hkv, Lk, D]``, mask broadcast to ``[B, H, Lq, Lk]``
    (None: causal)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (x.float().repeat_interleave(group, dim=1) for x in (keys, values))
    scores = torch.tanh(q.float() @ keys.transpose(-1, -2) * (scale / softcap)) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ values).to(q.dtype)


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to the cache's dtype and back: the value a gather from the cache gives."""
    return x if x.dtype == cache_dtype else x.to(cache_dtype).to(x.dtype)
