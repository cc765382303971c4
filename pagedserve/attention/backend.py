"""The contract between model code and a platform's paged-attention kernels."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedserve.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Attention over the paged KV cache for one layer shape.

    ``kv_cache`` is one layer's cache, shaped ``[2, num_blocks, block_size, num_kv_heads,
    head_size]`` (index 0 keys, 1 values). ``forward`` first writes the step's new keys and
    values at ``meta.slot_mapping``, then returns causal attention of ``q`` over each sequence's
    whole context, shaped like ``q``: ``[num_tokens, num_heads, head_size]``. Grouped-query
    attention maps query head ``h`` to kv head ``h // (num_heads // num_kv_heads)``.

    Two per-layer options change which keys a query sees and how it scores them (Gemma's
    layers, Mistral's window): ``window`` (None: the whole context) lets a query at position
    ``p`` see only keys ``p - window + 1 .. p``, itself and the ``window - 1`` before it, as
    transformers' sliding-window mask does; ``softcap`` (None: none) replaces each scaled
    score ``s`` by ``softcap * tanh(s / softcap)`` before the mask and the softmax. Both are
    plain Python values fixed per layer, so a captured graph bakes them in.
    """

    def __init__(
        self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache_dtype = kv_cache_dtype

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...
