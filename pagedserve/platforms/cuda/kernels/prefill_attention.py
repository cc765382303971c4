"""Causal varlen prefill attention over the paged KV cache (prefix caching, chunked prefill).

Inputs (``N`` tokens packed without padding, ``H`` query heads, ``KVH`` kv heads, ``D`` head size):

- ``q``: ``[N, H, D]``, any strides. Sequence ``i`` owns rows ``query_start_loc[i]:[i+1]``.
- ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, KVH, D]``, any strides, but both
  must share them (they are ``kv_cache[0]`` and ``kv_cache[1]`` of one layer). fp32, fp16, bf16
  or float8_e4m3fn; an fp8 cache is read as ``stored * k_scale`` (resp. ``v_scale``), with
  the matmuls in fp16 whatever the query dtype (see ``fp8_compute_dtype``).
- ``block_tables``: int32 ``[num_seqs, max_blocks]``, any strides.
- ``seq_lens``: int32 ``[num_seqs]``, keys per sequence including this step's tokens, which
  must already be in the cache (the backend writes them first). The first
  ``seq_len - query_len`` keys are the cached context; query row ``t`` of a sequence sits at
  absolute position ``context_len + t`` and sees keys ``0..context_len + t``.

Grid ``(cdiv(max_query_len, BLOCK_M // GROUP_PAD), num_seqs, KVH)``: one program takes
``BLOCK_M`` rows made of ``BLOCK_M // GROUP_PAD`` tokens times all ``GROUP`` query heads that
share one kv head, so each K/V tile is loaded once per GQA group and a decode row (query_len 1)
in a mixed batch still fills ``GROUP`` rows of the tile. Key tiles that every row may see run
without a mask; only the diagonal tiles pay for it.

A layer's window and score cap (``AttentionBackend``) are compile-time switches
(``SLIDING``, ``SOFTCAP``) with their values as arguments, so a layer without them compiles to
the same kernel as before. With a window, a program walks only the tiles its rows' windows
reach: those the window's lower edge cuts through take the mask, the rest run without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.device import gpu_arch
from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options

# Finite stand-in for -inf as the running max: exp2(-inf - -inf) would give NaN on rows whose
# first tile is fully masked.
NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def tile_columns(n0, kv_end, bt_row_ptr, stride_btn, stride_cb, stride_cs, stride_ch,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 HEADS: tl.constexpr):
    """A tile's columns in one sequence's paged cache: ``(keys, valid, slots, col_head)``.

    The columns are ``HEADS`` kv heads side by side, each over keys ``n0 .. n0 + BLOCK_N //
    HEADS`` (one head: keys ``n0 .. n0 + BLOCK_N``). Decode packs a GQA group's few query rows
    with other kv heads' rows this way, so one ``tl.dot`` (at least 16 rows) does the work of
    ``HEADS``. ``slots`` are element offsets from the first head's cache (``stride_ch`` apart
    per head), the block table row is at ``bt_row_ptr``, and ``valid`` says which keys lie
    before ``kv_end`` (only read with ``MASKED``)."""
    cols = tl.arange(0, BLOCK_N)
    if HEADS == 1:
        offs_n, col_head = n0 + cols, cols * 0
    else:
        offs_n, col_head = n0 + cols % (BLOCK_N // HEADS), cols // (BLOCK_N // HEADS)
    bt_ptrs = bt_row_ptr + (offs_n // BLOCK_SIZE) * stride_btn
    n_valid = offs_n < kv_end
    if MASKED:
        block_ids = tl.load(bt_ptrs, mask=n_valid, other=0)
    else:
        block_ids = tl.load(bt_ptrs)
    # int64 before scaling: one layer's cache can pass 2**31 elements.
    slots = block_ids.to(tl.int64) * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs
    if HEADS > 1:
        slots += col_head * stride_ch
    return offs_n, n_valid, slots, col_head


@triton.jit
def softmax_step(s, m_i, l_i):
    """One online-softmax update over a tile of log2-domain scores ``s``: the tile's
    unnormalized probabilities, the factor that rescales what came before, the new running
    max and the new running sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def capped(s, softcap):
    """``softcap * tanh(s / softcap)`` for scaled scores ``s``, returned in the log2 domain
    (times log2(e)). tanh as ``1 - 2 / (e^2x + 1)``, which saturates to +-1 where e^2x
    overflows or vanishes, never NaN."""
    tanh = 1.0 - 2.0 / (tl.exp2(s * (2.0 * LOG2E / softcap)) + 1.0)
    return tanh * (softcap * LOG2E)


@triton.jit
def attend_tile(
    acc, m_i, l_i, q, q_pos,
    n0, kv_end,
    k_ptr, v_ptr, bt_row_ptr, stride_btn,
    stride_cb, stride_cs, stride_cd,
    qk_scale,
    offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr, HEADS: tl.constexpr = 1, stride_ch=0, row_head=0,
    SLIDING: tl.constexpr = False, window=0, SOFTCAP: tl.constexpr = False, softcap=1.0,
):
    """One online-softmax step over keys ``n0 .. n0 + BLOCK_N`` of one sequence and kv head.

    ``k_ptr``/``v_ptr`` already point at the kv head; ``bt_row_ptr`` at the sequence's block
    table row. Scores are in the log2 domain (``qk_scale`` includes log2(e), except with
    ``SOFTCAP``, where ``capped`` applies it). With ``MASKED`` keys at or past ``kv_end`` and
    keys after a row's ``q_pos`` are dropped, and with ``SLIDING`` too those at or before
    ``q_pos - window``; without ``MASKED`` every key in the tile must be valid and visible to
    every row.

    ``HEADS > 1`` (decode): the tile's columns are ``HEADS`` kv heads (``stride_ch`` apart) of
    ``BLOCK_N // HEADS`` keys each, ``n0 ..``; row ``r`` attends only to kv head
    ``row_head[r]``'s columns (``tile_columns``).
    """
    offs_n, n_valid, slots, col_head = tile_columns(
        n0, kv_end, bt_row_ptr, stride_btn, stride_cb, stride_cs, stride_ch, BLOCK_SIZE,
        BLOCK_N, MASKED, HEADS)
    k_ptrs = k_ptr + slots[None, :] + offs_d[:, None] * stride_cd
    v_ptrs = v_ptr + slots[:, None] + offs_d[None, :] * stride_cd
    if MASKED:
        k = tl.load(k_ptrs, mask=n_valid[None, :] & d_mask[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)

    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PREC) * qk_scale
    if SOFTCAP:
        s = capped(s, softcap)
    if MASKED:
        visible = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            visible &= offs_n[None, :] > q_pos[:, None] - window
        if HEADS > 1:
            visible &= col_head[None, :] == row_head[:, None]
        s = tl.where(visible, s, float("-inf"))
    elif HEADS > 1:
        s = tl.where(col_head[None, :] == row_head[:, None], s, float("-inf"))
    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)

    if MASKED:
        v = tl.load(v_ptrs, mask=n_valid[:, None] & d_mask[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def fp8_compute_dtype(q):
    """The query in fp16, the dtype the matmuls over an fp8 cache run in.

    e4m3 widens to fp16 exactly in one instruction but to bf16 in several, which made decode
    of a bf16 model over an fp8 cache slower than over a bf16 one. Clamped so a query beyond
    fp16's range saturates instead of becoming inf.
    """
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


# The block-table width changes from step to step: not specialised on, so no mid-run compiles.
@triton.jit(do_not_specialize=["stride_bt", "window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, seq_ids_ptr,
    k_scale_ptr, v_scale_ptr,
    sm_scale, window, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt, stride_btn,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SCALES: tl.constexpr, DOT_PREC: tl.constexpr, HAS_SEQ_IDS: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr,
):
    gate(PDL)
    q_block = tl.program_id(0)
    seq = tl.program_id(1)
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + seq)
    kv_head = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tok0 = q_block * BLOCK_Q
    if tok0 >= q_len:  # the grid is sized for the longest query
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (tok < q_len) & (rows % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    io_mask = row_mask[:, None] & d_mask[None, :]
    q_ptrs = (q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt
              + head[:, None] * stride_qh + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    if HAS_SCALES:
        q = fp8_compute_dtype(q)
    q_pos = ctx_len + tok

    qk_scale = sm_scale if SOFTCAP else sm_scale * LOG2E
    if HAS_SCALES:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    k_ptr = k_cache_ptr + kv_head * stride_ch
    v_ptr = v_cache_ptr + kv_head * stride_ch
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Keys 0..ctx_len + tok0 are visible to every row of this tile: no mask.
    full_end = (ctx_len + tok0 + 1) // BLOCK_N * BLOCK_N
    first = 0
    if SLIDING:
        # The first row's window starts at ctx_len + tok0 - window + 1, the last row's (at
        # rows_end - 1) at rows_end - window: tiles before the first edge's tile hold no
        # visible key, tiles from it to the last one the second edge cuts take the mask, and
        # only the rest run without.
        rows_end = tl.minimum(seq_len, ctx_len + tok0 + BLOCK_Q)
        lo = tl.maximum(ctx_len + tok0 - window + 1, 0) // BLOCK_N * BLOCK_N
        first = tl.minimum(tl.cdiv(tl.maximum(rows_end - window, 0), BLOCK_N) * BLOCK_N,
                           full_end)
        for n0 in range(lo, first, BLOCK_N):
            acc, m_i, l_i = attend_tile(
                acc, m_i, l_i, q, q_pos, n0, seq_len, k_ptr, v_ptr, bt_row_ptr, stride_btn,
                stride_cb, stride_cs, stride_cd, qk_scale, offs_d, d_mask,
                BLOCK_SIZE, BLOCK_N, True, DOT_PREC, SLIDING=True, window=window,
                SOFTCAP=SOFTCAP, softcap=softcap)
    for n0 in range(first, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, n0, seq_len, k_ptr, v_ptr, bt_row_ptr, stride_btn,
            stride_cb, stride_cs, stride_cd, qk_scale, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, False, DOT_PREC, SOFTCAP=SOFTCAP, softcap=softcap)
    kv_end = tl.minimum(seq_len, ctx_len + tok0 + BLOCK_Q)
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, n0, kv_end, k_ptr, v_ptr, bt_row_ptr, stride_btn,
            stride_cb, stride_cs, stride_cd, qk_scale, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, True, DOT_PREC, SLIDING=SLIDING, window=window,
            SOFTCAP=SOFTCAP, softcap=softcap)

    out = acc / l_i[:, None]
    if HAS_SCALES:
        out = out * tl.load(v_scale_ptr)
    o_ptrs = (out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_ot
              + head[:, None] * stride_oh + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def dot_precision(dtype: torch.dtype, arch: str | None = None) -> str:
    """``tl.dot``'s input precision for ``dtype`` on a GPU of architecture ``arch`` (an AMD
    ``gfx`` name; ``None`` for NVIDIA and the interpreter).

    fp32 models expect fp32 results; tf32 would cost ~3 decimal digits. For 16-bit inputs the
    choice changes nothing numerically, but Triton's AMD backend accepts ``tf32`` only on gfx942
    (MI300) and refuses to compile it elsewhere.
    """
    if dtype == torch.float32:
        return "ieee"
    return "tf32" if arch is None or arch.startswith("gfx942") else "ieee"


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.stride() != value_cache.stride() or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must have the same shape and strides")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same dtype")


def _prefill_config(head_pad: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for H100/H200-class GPUs.

    Measured on an H200 (bf16, head 128, GQA 4): 128/64/4/3 led on chunked prefills with cached
    context and was within 4% of the best on a fresh 8k prompt.
    """
    if dtype == torch.float32 or head_pad > 128:
        return 64, 32, 4, 2
    return 128, 64, 4, 3


def prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    seq_ids: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` over the paged cache; layouts in the module docstring.
    ``window``/``softcap``: the layer's (``AttentionBackend``), None for none.

    ``k_scale``/``v_scale`` are one-element float32 tensors, required for an fp8 cache.
    ``block_m``/``block_n`` override the tile shape (tests use them to cover tile edges).
    ``seq_ids`` (int32, on the device) restricts the call to those sequences: only their rows
    of ``out`` are written (the backend sends a mixed step's one-token rows to the decode
    kernel instead).
    """
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = key_cache.shape[2]
    check_cache_pair(key_cache, value_cache)
    has_scales = key_cache.dtype == torch.float8_e4m3fn
    if has_scales and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    if out is None:
        out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_size))
    cfg_m, cfg_n, num_warps, num_stages = _prefill_config(head_pad, q.dtype)
    block_m = max(block_m or cfg_m, 16, group_pad)  # tl.dot wants M >= 16
    block_n = max(block_n or cfg_n, 16)
    num_seqs = seq_lens.shape[0] if seq_ids is None else seq_ids.shape[0]
    if max_query_len == 0 or num_seqs == 0:
        return out
    grid = (triton.cdiv(max_query_len, block_m // group_pad), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, key_cache, value_cache, out,
        block_tables, query_start_loc, seq_lens, seq_lens if seq_ids is None else seq_ids,
        k_scale if has_scales else seq_lens, v_scale if has_scales else seq_lens,
        scale, window or 0, softcap or 1.0,
        *q.stride(), *out.stride(), *key_cache.stride(), *block_tables.stride(),
        GROUP=group, GROUP_PAD=group_pad, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SCALES=has_scales, DOT_PREC=dot_precision(q.dtype, gpu_arch(q.device)),
        HAS_SEQ_IDS=seq_ids is not None, SLIDING=window is not None,
        SOFTCAP=softcap is not None, num_warps=num_warps, num_stages=num_stages,
        **launch_options(q.device),
    )
    return out
