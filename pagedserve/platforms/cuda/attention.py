"""The CUDA attention backend: Triton kernels over the paged KV cache."""

from __future__ import annotations

import math

import numpy as np
import torch

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.errors import KV_CACHE_DTYPES
from pagedserve.platforms.cuda.kernels.decode_attention import decode_attention
from pagedserve.platforms.cuda.kernels.prefill_attention import prefill_attention
from pagedserve.platforms.cuda.kernels.reshape_and_cache import reshape_and_cache

# Verify batches of up to this many sequences attend row by row with the decode kernel.
_ROW_BY_ROW_MAX_SEQS = 4


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton: write the new keys and values, then attend over the cache.

    A decode-only batch (every sequence brings one token) runs the split-context decode kernel;
    so does a small verify batch (speculative decoding: each sequence's last token and its
    drafts), one query row at a time, each row a sequence of its own that ends at its
    position: the prefill kernel's grid there is one program per sequence and kv head, which
    leaves most SMs idle and walks the whole context in each (a batch-1 verify step spent
    about 0.9 ms of 6.3 in it on the H200), while the decode kernel splits the context. Reading
    the keys once per row costs little at such batch sizes. Any other batch runs the varlen
    prefill kernel, except for its sequences of one query row (the decodes of a step that also
    computes prompt chunks), which go to the decode kernel: the prefill kernel would give each a
    tile of BLOCK_M rows to fill four of, and walk a long context in one program per kv head.

    With ``kv_cache_dtype="fp8"`` (or ``"fp8_e4m3"``) the cache is float8_e4m3fn and holds
    ``x / scale`` per tensor (one ``k_scale`` and one ``v_scale`` per layer, float32 on the
    cache's device); reads multiply the scale back in, folded into the softmax scale and the
    output, and the matmuls run in fp16 (e4m3 widens to it in one instruction). The default 1.0
    suits models whose keys and values stay well inside e4m3's +-448 range. Checkpoints
    quantized by llm-compressor or ModelOpt ship per-layer ``k_scale``/``v_scale``
    (``amax / 448``); pass them to ``set_kv_scales``. Without them, calibrate by running a few
    hundred representative prompts, recording each layer's ``max |k|`` and ``max |v|`` and
    setting ``scale = amax / 448``.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        super().__init__(num_heads, head_size, num_kv_heads, scale, kv_cache_dtype)
        self.fp8 = kv_cache_dtype.startswith("fp8")  # every fp8 name means e4m3 here
        self.k_scale = torch.ones(1, dtype=torch.float32)
        self.v_scale = torch.ones(1, dtype=torch.float32)
        # What the layers of one step share, derived once from its metadata (every layer gets
        # the same object): by the function that derives it.
        self._step_meta: AttentionMetadata | None = None
        self._derived: dict = {}

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Set the fp8 cache scales in place (keeps tensor addresses valid for CUDA graphs)."""
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        self.k_scale.fill_(k_scale)
        self.v_scale.fill_(v_scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        self._check_cache_dtype(kv_cache)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        k_scale, v_scale = self._scales_on(kv_cache.device)
        reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
        # The fp8 scales, and the layer's window and score cap.
        layer = dict(k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap)
        if meta.is_decode_only:
            return decode_attention(
                q, key_cache, value_cache, meta.block_tables, meta.seq_lens, self.scale,
                max_seq_len=meta.max_seq_len, **layer)
        if meta.decode_or_verify and meta.num_seqs <= _ROW_BY_ROW_MAX_SEQS:
            tables, row_lens = self._per_step(meta, _rows_of)
            return decode_attention(
                q, key_cache, value_cache, tables, row_lens, self.scale,
                max_seq_len=meta.max_seq_len, **layer)
        split = self._per_step(meta, _one_row_split)
        out = None
        if split is not None:
            rows, tables, lens, others = split
            out = torch.empty_like(q)
            out.index_copy_(0, rows, decode_attention(
                q[rows], key_cache, value_cache, tables, lens, self.scale,
                max_seq_len=meta.max_seq_len, **layer))
        return prefill_attention(
            q, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            self.scale, max_query_len=meta.max_query_len, out=out,
            seq_ids=None if split is None else others, **layer)

    def _per_step(self, meta: AttentionMetadata, derive):
        """``derive(meta)``, once a step: one backend serves every layer, and the step's
        metadata object is the same for all of them."""
        if meta is not self._step_meta:
            self._step_meta, self._derived = meta, {}
        if derive not in self._derived:
            self._derived[derive] = derive(meta)
        return self._derived[derive]

    def _check_cache_dtype(self, kv_cache: torch.Tensor) -> None:
        if (kv_cache.dtype == torch.float8_e4m3fn) != self.fp8:
            raise ValueError(f"KV cache is {kv_cache.dtype} but the backend was built with "
                             f"kv_cache_dtype={self.kv_cache_dtype!r}")

    def _scales_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Moved once, on the first forward; later steps reuse the device copies.
        if self.k_scale.device != device:
            self.k_scale = self.k_scale.to(device)
            self.v_scale = self.v_scale.to(device)
        return self.k_scale, self.v_scale


def _rows_of(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row of a verify step as a sequence of its own: its block table and its
    length. Row j of sequence s (rows qsl[s] .. qsl[s + 1] - 1) sees its context and the rows
    up to itself: seq_lens[s] - (qsl[s + 1] - 1 - j) keys. Built on the device (no host sync,
    so verify graphs capture it)."""
    rows = torch.arange(meta.num_tokens, device=meta.seq_lens.device, dtype=torch.int32)
    ends = meta.query_start_loc[1:]
    seq = torch.searchsorted(ends, rows, right=True)
    return meta.block_tables[seq], meta.seq_lens[seq] - (ends[seq] - 1 - rows)


def _one_row_split(meta: AttentionMetadata
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """For a step mixing sequences of one query row with longer ones: the one-row sequences'
    rows, block tables and lengths, and the other sequences' ids (int32), on the device.
    None when either kind is missing. From the host's query lengths (eager steps only: graphs
    capture decode-only and padded verify steps, which never split)."""
    lens = np.asarray(meta.query_lens_cpu)
    one = lens == 1
    if one.all() or not one.any():
        return None
    device = meta.seq_lens.device
    seqs = torch.from_numpy(np.flatnonzero(one)).to(device)
    rows = torch.from_numpy(np.cumsum(lens)[one] - 1).to(device)
    others = torch.from_numpy(np.flatnonzero(~one).astype(np.int32)).to(device)
    return rows, meta.block_tables[seqs], meta.seq_lens[seqs], others
