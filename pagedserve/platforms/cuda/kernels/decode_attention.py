"""Decode attention (one query token per sequence) over the paged KV cache, flash-decoding style.

Inputs (``S`` sequences, ``H`` query heads, ``KVH`` kv heads, ``D`` head size):

- ``q``: ``[S, H, D]``, any strides; row ``i`` is sequence ``i``'s newest token.
- ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, KVH, D]`` sharing strides; fp32,
  fp16, bf16 or float8_e4m3fn (read as ``stored * k_scale`` / ``stored * v_scale``, matmuls in
  fp16).
- ``block_tables``: int32 ``[S, max_blocks]``; ``seq_lens``: int32 ``[S]``, keys per sequence
  including the new token, which the backend has already written to the cache. A sequence with
  ``seq_len == 0`` (padding) gets a zero output.

Stage 1, grid ``(S, KVH / heads, num_partitions)``: each program attends ``heads`` kv heads'
GQA groups of query heads (rows of one ``tl.dot``, padded to 16; more than one head at large
batches, ``tile_columns``) over one partition of ``partition_size`` keys, so a batch of one
with a 32k context still spreads over every SM. It writes the
partition's normalized output and its log2-sum-exp. Stage 2, grid ``(S, H)``, merges the
partitions of each head with those weights. When the whole context fits one partition, stage 1
writes the final output and stage 2 is skipped.

With a window (``SLIDING``, the layer's ``window`` as an argument) a sequence's keys start at
``max(seq_len - window, 0)``, every one of them visible to its one query row: the partitions
cover those keys alone, so a windowed layer's decode reads ``window`` keys however long the
context, and needs no mask beyond the ragged end. A score cap (``SOFTCAP``) as in
``prefill_attention``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.device import gpu_arch, sm_count
from pagedserve.platforms.cuda.kernels.e4m3_pairs import split_e4m3_pairs
from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options
from pagedserve.platforms.cuda.kernels.prefill_attention import (
    LOG2E,
    NEG_BIG,
    attend_tile,
    capped,
    check_cache_pair,
    dot_precision,
    fp8_compute_dtype,
    softmax_step,
    tile_columns,
)

# Shortest partition the heuristic picks: shorter ones spend more on the merge than they save.
MIN_PARTITION_SIZE = 128


@triton.jit
def _attend_tile_e4m3(
    acc_even, acc_odd, m_i, l_i, q_even, q_odd, n0, kv_end,
    k_ptr, v_ptr, bt_row_ptr, stride_btn, stride_cb, stride_cs, stride_ch, qk_scale, offs_w,
    w_mask, row_head, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    PTX: tl.constexpr, HEADS: tl.constexpr, SOFTCAP: tl.constexpr, softcap,
):
    """``attend_tile`` for an fp8 cache read as int16 words (``e4m3_pairs``): element pairs
    split into even and odd halves, two dots per matmul, one accumulator per half."""
    _, n_valid, slots, col_head = tile_columns(
        n0, kv_end, bt_row_ptr, stride_btn, stride_cb, stride_cs, stride_ch, BLOCK_SIZE,
        BLOCK_N, MASKED, HEADS)
    k_ptrs = (k_ptr + slots[None, :]).to(tl.pointer_type(tl.int16)) + offs_w[:, None]
    v_ptrs = (v_ptr + slots[:, None]).to(tl.pointer_type(tl.int16)) + offs_w[None, :]
    if MASKED:
        k_words = tl.load(k_ptrs, mask=n_valid[None, :] & w_mask[:, None], other=0)
    else:
        k_words = tl.load(k_ptrs, mask=w_mask[:, None], other=0)
    k_even, k_odd = split_e4m3_pairs(k_words, PTX)
    s = (tl.dot(q_even, k_even) + tl.dot(q_odd, k_odd)) * qk_scale
    if SOFTCAP:
        s = capped(s, softcap)
    if HEADS > 1:
        mine = col_head[None, :] == row_head[:, None]
        s = tl.where(mine & n_valid[None, :] if MASKED else mine, s, float("-inf"))
    elif MASKED:
        s = tl.where(n_valid[None, :], s, float("-inf"))
    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)

    if MASKED:
        v_words = tl.load(v_ptrs, mask=n_valid[:, None] & w_mask[None, :], other=0)
    else:
        v_words = tl.load(v_ptrs, mask=w_mask[None, :], other=0)
    v_even, v_odd = split_e4m3_pairs(v_words, PTX)
    p = p.to(tl.float16)
    acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even)
    acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd)
    return acc_even, acc_odd, m_new, l_i


@triton.jit
def _attend_partition(
    q, q_pos, start, end, k_ptr, v_ptr, bt_row_ptr, stride_btn,
    stride_cb, stride_cs, stride_ch, stride_cd, qk_scale, offs_d, d_mask, row_head,
    GROUP_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, HEADS: tl.constexpr,
    SOFTCAP: tl.constexpr, softcap,
):
    """Unnormalized output, running max and sum over keys ``start .. end`` of a 16- or 32-bit
    cache; ``BLOCK_N // HEADS`` keys a step."""
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    keys: tl.constexpr = BLOCK_N // HEADS
    full_end = start + (end - start) // keys * keys
    for n0 in range(start, full_end, keys):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, n0, end, k_ptr, v_ptr, bt_row_ptr, stride_btn,
            stride_cb, stride_cs, stride_cd, qk_scale, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, False, DOT_PREC, HEADS, stride_ch, row_head,
            SOFTCAP=SOFTCAP, softcap=softcap)
    if full_end < end:  # the ragged last tile of the sequence
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, full_end, end, k_ptr, v_ptr, bt_row_ptr, stride_btn,
            stride_cb, stride_cs, stride_cd, qk_scale, offs_d, d_mask,
            BLOCK_SIZE, BLOCK_N, True, DOT_PREC, HEADS, stride_ch, row_head,
            SOFTCAP=SOFTCAP, softcap=softcap)
    return acc, m_i, l_i


@triton.jit
def _attend_partition_e4m3(
    q, start, end, k_ptr, v_ptr, bt_row_ptr, stride_btn, stride_cb, stride_cs, stride_ch,
    qk_scale, row_head, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PTX: tl.constexpr,
    HEADS: tl.constexpr, SOFTCAP: tl.constexpr, softcap,
):
    """``_attend_partition`` over an fp8 cache; the output's even and odd columns are
    accumulated apart and interleaved at the end."""
    q_even, q_odd = tl.split(tl.reshape(q, (GROUP_PAD, HEAD_PAD // 2, 2)))
    offs_w = tl.arange(0, HEAD_PAD // 2)
    w_mask = offs_w < HEAD_SIZE // 2
    acc_even = tl.zeros([GROUP_PAD, HEAD_PAD // 2], dtype=tl.float32)
    acc_odd = tl.zeros([GROUP_PAD, HEAD_PAD // 2], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    keys: tl.constexpr = BLOCK_N // HEADS
    full_end = start + (end - start) // keys * keys
    for n0 in range(start, full_end, keys):
        acc_even, acc_odd, m_i, l_i = _attend_tile_e4m3(
            acc_even, acc_odd, m_i, l_i, q_even, q_odd, n0, end, k_ptr, v_ptr, bt_row_ptr,
            stride_btn, stride_cb, stride_cs, stride_ch, qk_scale, offs_w, w_mask, row_head,
            BLOCK_SIZE, BLOCK_N, False, PTX, HEADS, SOFTCAP, softcap)
    if full_end < end:  # the ragged last tile of the sequence
        acc_even, acc_odd, m_i, l_i = _attend_tile_e4m3(
            acc_even, acc_odd, m_i, l_i, q_even, q_odd, full_end, end, k_ptr, v_ptr,
            bt_row_ptr, stride_btn, stride_cb, stride_cs, stride_ch, qk_scale, offs_w, w_mask,
            row_head, BLOCK_SIZE, BLOCK_N, True, PTX, HEADS, SOFTCAP, softcap)
    acc = tl.reshape(tl.join(acc_even, acc_odd), (GROUP_PAD, HEAD_PAD))
    return acc, m_i, l_i


# Ints that change from step to step (block-table width, partition count) are not specialised
# on (Triton compiles a variant per "== 1" / "divisible by 16" pattern), so a new batch shape
# never pays a compile mid-run.
@triton.jit(do_not_specialize=["partition_size", "stride_bt", "stride_ps", "stride_ph",
                               "window"])
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr,
    sm_scale, partition_size, window, softcap,
    stride_qs, stride_qh, stride_qd,
    stride_os, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt, stride_btn,
    stride_ps, stride_ph, stride_pp,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr, HAS_SCALES: tl.constexpr, DOT_PREC: tl.constexpr,
    PTX: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr,
):
    gate(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) * HEADS  # the first of the program's HEADS kv heads
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    if SLIDING:
        start += tl.maximum(seq_len - window, 0)

    rows = tl.arange(0, GROUP_PAD)
    row_head = rows // GROUP  # which of the program's kv heads a query row attends with
    head = kv_head * GROUP + rows
    offs_d = tl.arange(0, HEAD_PAD)
    d_mask = offs_d < HEAD_SIZE
    io_mask = (rows < GROUP * HEADS)[:, None] & d_mask[None, :]
    o_ptrs = (out_ptr + seq.to(tl.int64) * stride_os + head[:, None] * stride_oh
              + offs_d[None, :] * stride_od)
    if start >= seq_len:
        # Partitions past this sequence's end (the grid fits the longest) have nothing to do;
        # stage 2 only reads the partitions a sequence has. Padding rows still get an output.
        if SINGLE_PARTITION:
            zeros = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=out_ptr.dtype.element_ty)
            tl.store(o_ptrs, zeros, mask=io_mask)
        return

    q_ptrs = (q_ptr + seq.to(tl.int64) * stride_qs + head[:, None] * stride_qh
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    if HAS_SCALES:
        q = fp8_compute_dtype(q)
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32) + (seq_len - 1)
    qk_scale = sm_scale if SOFTCAP else sm_scale * LOG2E
    if HAS_SCALES:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    k_ptr = k_cache_ptr + kv_head * stride_ch
    v_ptr = v_cache_ptr + kv_head * stride_ch
    bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    end = tl.minimum(start + partition_size, seq_len)
    if HAS_SCALES:
        acc, m_i, l_i = _attend_partition_e4m3(
            q, start, end, k_ptr, v_ptr, bt_row_ptr, stride_btn, stride_cb, stride_cs,
            stride_ch, qk_scale, row_head, GROUP_PAD, HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, BLOCK_N,
            PTX, HEADS, SOFTCAP, softcap)
    else:
        acc, m_i, l_i = _attend_partition(
            q, q_pos, start, end, k_ptr, v_ptr, bt_row_ptr, stride_btn, stride_cb, stride_cs,
            stride_ch, stride_cd, qk_scale, offs_d, d_mask, row_head, GROUP_PAD, HEAD_PAD,
            BLOCK_SIZE, BLOCK_N, DOT_PREC, HEADS, SOFTCAP, softcap)

    out = acc / l_i[:, None]
    if SINGLE_PARTITION:
        if HAS_SCALES:
            out = out * tl.load(v_scale_ptr)
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # v_scale is applied once, after the merge.
        p_off = seq.to(tl.int64) * stride_ps + head * stride_ph + part * stride_pp
        tl.store(part_out_ptr + p_off[:, None] * HEAD_PAD + offs_d[None, :], out, mask=io_mask)
        tl.store(part_lse_ptr + p_off, m_i + tl.log2(l_i), mask=rows < GROUP * HEADS)


@triton.jit(do_not_specialize=["partition_size", "stride_ps", "stride_ph", "window"])
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, v_scale_ptr,
    partition_size, window,
    stride_os, stride_oh, stride_od,
    stride_ps, stride_ph, stride_pp,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_SCALES: tl.constexpr, SLIDING: tl.constexpr, PDL: tl.constexpr,
):
    gate(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if SLIDING:  # the keys stage 1 attended: the window's
        seq_len = tl.minimum(seq_len, window)
    num_parts = tl.cdiv(seq_len, partition_size)
    offs_d = tl.arange(0, HEAD_PAD)
    base = seq.to(tl.int64) * stride_ps + head * stride_ph

    # Online merge over chunks of partitions, so long contexts need no large register tile.
    m = tl.full([], NEG_BIG, dtype=tl.float32)
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_mask = offs_p < num_parts
        lse = tl.load(part_lse_ptr + base + offs_p * stride_pp, mask=p_mask, other=float("-inf"))
        o_ptrs = part_out_ptr + (base + offs_p * stride_pp)[:, None] * HEAD_PAD + offs_d[None, :]
        o = tl.load(o_ptrs, mask=p_mask[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new

    out = acc / tl.maximum(total, 1e-30)  # total is 0 only for an empty (padding) sequence
    if HAS_SCALES:
        out = out * tl.load(v_scale_ptr)
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)


def pick_partition_size(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int
) -> int:
    """Partition length giving about four stage-1 programs per SM, never under 128 keys.

    Large batches fill the GPU on their own and get a single partition (no merge pass).
    """
    programs = max(1, num_seqs * num_kv_heads)
    want_parts = triton.cdiv(4 * num_sms, programs)
    size = triton.next_power_of_2(triton.cdiv(max(max_seq_len, 1), want_parts))
    return max(size, MIN_PARTITION_SIZE, block_n)


class DecodeConfig(NamedTuple):
    """Stage 1's tile: its columns (``block_n``, ``heads`` kv heads of ``block_n // heads`` keys
    each: ``tile_columns``), and the launch's warps and pipeline stages."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    heads: int = 1


def _decode_config(head_pad: int, dtype: torch.dtype, cache_dtype: torch.dtype, group: int,
                   num_kv_heads: int, seq_heads: int, programs: int,
                   num_sms: int) -> DecodeConfig:
    """The tile for H100/H200-class GPUs, for a stage 1 of ``seq_heads`` (sequence, kv head)
    pairs over ``programs`` programs (times the partitions).

    From sweeps on an H200 (head 128, GQA 4, grids sized for 8,192 keys as under CUDA graphs;
    ``scripts/bench_attention.py --sweep-decode``, ``benchmarks/results/issue30/``).

    - Where even a program per four kv heads fills the GPU three times over (a large batch;
      GQA of 4 or less, so the four heads' query rows fit one 16-row dot), four kv heads a
      program: a step covers 16 (16-bit cache) or 32 (fp8) keys of each, so a ragged end wastes
      a quarter of what one head's 64 or 128 keys did, while each step moves as many bytes. At
      1,000 x 129-256 keys (the throughput run's decodes): 3,914 against 3,649 GB/s over a
      16-bit cache, 3,224 against 2,346 over fp8 (128 columns); at 256 x 2,048 fp8 4,052
      against 3,526, and at 256 x 8,192 4,168 against 3,617; 16-bit equal there. With fewer
      programs it loses (at 64 x 4,096, 128 programs: 2,415 against 4,231).
    - Otherwise, where the pairs alone fill the GPU three times over, either cache: 64 keys, 2
      warps, 3 stages (at 1,000 x 129-256, 3,712 against 3,340 GB/s for 4 warps over a 16-bit
      cache, 2,853 against 2,201 for 128 keys over fp8; 32 keys lost 15% at 64 x 4,096).
    - Otherwise, 16-bit caches: 64 keys, 4 warps, 3 stages. An fp8 cache: 128 keys a tile, and
      where there are programs enough to fill the GPU a few times over, 2 warps and 3 stages
      (3,537 against 2,808 GB/s with 4 warps at 32 x 4,096); fewer, longer-running programs
      (batch 1) keep 4 warps and 2 stages (961 against 893 GB/s at 1 x 4,096).
    """
    fp8 = cache_dtype == torch.float8_e4m3fn
    if dtype == torch.float32 or head_pad > 128:
        return DecodeConfig(32, 4, 2)
    if group <= 4 and num_kv_heads % 4 == 0 and seq_heads >= 4 * 3 * num_sms:
        return DecodeConfig(128 if fp8 else 64, 2, 3, heads=4)
    if seq_heads >= 3 * num_sms:
        return DecodeConfig(64, 2, 3)
    if fp8:
        return DecodeConfig(128, *((2, 3) if programs >= 3 * num_sms else (4, 2)))
    return DecodeConfig(64, 4, 3)


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    config: DecodeConfig | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One decode step of attention; layouts in the module docstring. ``window``/``softcap``:
    the layer's (``AttentionBackend``), None for none.

    ``max_seq_len`` sizes the grid and must be at least every ``seq_lens`` entry (an upper bound
    is fine, e.g. under CUDA graphs). ``partition_size`` (a power of two, multiple of the
    tile's ``block_n``) overrides the heuristic; fix it when capturing graphs so the grid is
    stable. ``config`` overrides the tile: tests cover tile edges with it, the benchmark sweeps
    it.
    """
    num_seqs, num_heads, head_size = q.shape
    num_kv_heads = key_cache.shape[2]
    check_cache_pair(key_cache, value_cache)
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"decode takes one query row per sequence: q has {num_seqs} rows, "
                         f"seq_lens {seq_lens.shape[0]}")
    has_scales = key_cache.dtype == torch.float8_e4m3fn
    if has_scales and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    # An fp8 cache is read in 16-bit pairs of elements (e4m3_pairs): each half is still a
    # dot's K of at least 16.
    head_pad = max(32 if has_scales else 16, triton.next_power_of_2(head_size))
    if has_scales and (head_size % 2 or key_cache.stride(3) != 1):
        raise ValueError("an fp8 cache is read in pairs of elements: it needs an even head "
                         f"size and contiguous heads, not {head_size} and stride "
                         f"{key_cache.stride(3)}")
    num_sms = sm_count(q.device)
    if window is not None:  # no sequence attends more keys than its window
        max_seq_len = min(max_seq_len, window)
    if partition_size is None:
        # The default tiles (at most 128 keys) never raise the heuristic's floor of 128.
        partition_size = pick_partition_size(num_seqs, num_kv_heads, max_seq_len, num_sms,
                                             config.block_n if config else 16)
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    num_parts = triton.cdiv(max(max_seq_len, 1), partition_size)
    config = config or _decode_config(head_pad, q.dtype, key_cache.dtype, group, num_kv_heads,
                                      num_seqs * num_kv_heads,
                                      num_seqs * num_kv_heads * num_parts, num_sms)
    heads = config.heads
    if num_kv_heads % heads:
        raise ValueError(f"{heads} kv heads a program must divide the {num_kv_heads} kv heads")
    block_n = min(max(config.block_n, 16), partition_size * heads)
    if partition_size % (block_n // heads):
        raise ValueError(f"partition_size {partition_size} must be a multiple of the "
                         f"{block_n // heads} keys a step")
    group_pad = max(16, triton.next_power_of_2(group * heads))  # tl.dot wants M >= 16
    single = num_parts == 1

    if single:  # stage 1 writes `out`; the buffers are never read
        part_out = part_lse = out
        part_strides = (0, 0, 0)
    else:
        part_lse = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32,
                               device=q.device)
        part_out = torch.empty(num_seqs, num_heads, num_parts, head_pad, dtype=torch.float32,
                               device=q.device)
        part_strides = part_lse.stride()
    scales = (k_scale, v_scale) if has_scales else (seq_lens, seq_lens)
    _decode_partition_kernel[(num_seqs, num_kv_heads // heads, num_parts)](
        q, key_cache, value_cache, out, part_out, part_lse,
        block_tables, seq_lens, *scales,
        scale, partition_size, window or 0, softcap or 1.0,
        *q.stride(), *out.stride(), *key_cache.stride(), *block_tables.stride(),
        *part_strides,
        GROUP=group, GROUP_PAD=group_pad, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_SIZE=key_cache.shape[1], BLOCK_N=block_n, HEADS=heads,
        SINGLE_PARTITION=single, HAS_SCALES=has_scales,
        DOT_PREC=dot_precision(q.dtype, gpu_arch(q.device)),
        PTX=q.device.type == "cuda" and gpu_arch(q.device) is None,
        SLIDING=window is not None, SOFTCAP=softcap is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(q.device),
    )
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, seq_lens, scales[1],
            partition_size, window or 0,
            *out.stride(), *part_strides,
            HEAD_SIZE=head_size, HEAD_PAD=head_pad,
            BLOCK_P=min(32, triton.next_power_of_2(num_parts)),
            HAS_SCALES=has_scales, SLIDING=window is not None,
            num_warps=4, **launch_options(q.device),
        )
    return out
