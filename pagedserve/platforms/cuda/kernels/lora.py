"""LoRA shrink (``x @ A.T``) and expand (``out += s @ B.T``) over rows of mixed adapters.

The layout of ``a`` and ``b`` and the grouping of rows (``LoRARows``) are those of
``pagedserve.lora.ops``. Two forms of each, chosen by the number of rows:

- **SGMV** (prefill, large batches): a program per block of ``BLOCK_M`` rows in slot order
  (``sorted_rows``), so that one ``tl.dot`` serves the block's rows of one adapter; a block
  that spans slots (sorted, so only where a slot's rows end) runs a dot per slot among its
  rows, each over that slot's rows alone, and a block of slot -1 rows exits at once. The grid
  is the rows' alone, never rows times slots: with 32 slots, a grid over (row block, slot)
  launched 32 programs per block, all but about one exiting at once, in every step, with
  adapters or without (graphs run the kernels over a buffer of -1 slots too). The shrink
  splits K into parts too where the row blocks alone would leave SMs idle (``_sgmv_parts``):
  a decode step of 512 rows is 32 row blocks, and 32 programs each walking Llama-3-8B's down
  projection's 14,336 columns in 224 dependent steps took longer than the step's matmul.
- **BGMV** (decode, few rows): a program per row and block of output columns (the expand) or
  of ``SPLIT_K`` input columns (the shrink), reading its row's slot and reducing on the CUDA
  cores; rows of slot -1 exit at once. One program per row looping over all of K ran the whole
  shrink of a batch-1 step on one SM, 224 dependent loads deep for the down projection.

Both shrinks write each part's partial sums and both expands add them up, in part order, so
the sums never depend on timing (no atomics).

Dots take the activations' and weights' dtype (16-bit on the tensor cores, accumulating in
float32), float32 ones in IEEE precision rather than TF32. The shrink writes float32
``[P, T, S * R]``, P partial sums (one for a prefill step's SGMV; rows of slot -1 left
unwritten and never read). SGMV's expand rounds each row's sum to B's 16-bit dtype for its dot
(as Punica's and vLLM's expand do), BGMV's reduces in float32; the expand adds into ``out``
(the projection's output, any strides; a block of columns that spans shards runs a dot per
shard, each over that shard's columns alone) in float32 and rounds once to ``out``'s dtype.
The tests bound the error by exactly these roundings (``tests/lora/layouts.py``,
``rounding_bound``).

Ranks are padded with zeros to ``R`` in ``a`` and ``b``, so no kernel reads a rank;
``R`` is padded again to a power of two of at least 16 in registers, masked. Each output row
belongs to one slot, so no two programs write one element. Nothing synchronizes with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.lora.ops import LoRARows, Shards

# Up to this many rows a step uses BGMV (a program per row), beyond it SGMV.
BGMV_MAX_ROWS = 32
# SGMV: rows and input columns per shrink program and dot, rows and output columns per expand
# program, and their warps: the best of ``scripts/bench_lora_kernels.py``'s sweep on the H200
# at the 8B projections (``benchmarks/results/issue28/lora_kernels_h200.json``). The expand's
# 32 x 128 was the fastest at every projection, decode and prefill (gate/up at a 1,000-row
# decode step: 142 us against 189 for 16 x 64 and 223 for 64 x 128), timed against the
# partial sums of a 32 x 128 shrink (9 parts at 1,000 rows). A 64 x 64 shrink was 12% faster
# over a decode step's four projections but splits K in 16 parts there, whose sums every expand
# program adds up: not timed together, so not chosen.
_SHRINK_M = 32
_SHRINK_K = 128
_SHRINK_WARPS = 4
_EXPAND_M = 32
_EXPAND_N = 128
_EXPAND_WARPS = 4
# SGMV's shrink splits K until its grid has this many programs: two waves of an H200's 132 SMs
# (or a part is down to 4 blocks of K).
_SGMV_MIN_PROGRAMS = 264
_SGMV_MIN_PART = 4 * _SHRINK_K
# BGMV: input columns per shrink program, read in one load (a loop of dependent loads was the
# batch-1 shrink's latency: 7 us a call over 8 of them), and output columns per expand program.
_SPLIT_K = 256
_BGMV_N = 64


def _block_r(ranks: int) -> int:
    return max(16, triton.next_power_of_2(ranks))


def _sgmv_parts(t: int, k: int) -> tuple[int, int]:
    """SGMV's shrink's (parts, columns per part) for ``t`` rows over ``k`` input columns:
    one part where the row blocks fill the GPU (prefill), more for a few dozen row blocks."""
    row_blocks = triton.cdiv(t, _SHRINK_M)
    wanted = min(triton.cdiv(_SGMV_MIN_PROGRAMS, row_blocks), triton.cdiv(k, _SGMV_MIN_PART))
    split = triton.cdiv(triton.cdiv(k, max(wanted, 1)), _SHRINK_K) * _SHRINK_K
    return triton.cdiv(k, split), split


def shrink_buffer(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``shrink``'s output for these operands: float32 ``[P, T, S*R]``."""
    t, k = x.shape
    parts = triton.cdiv(k, _SPLIT_K) if t <= BGMV_MAX_ROWS else _sgmv_parts(t, k)[0]
    return torch.empty((parts, t, a.shape[1]), dtype=torch.float32, device=x.device)


def shrink(x: torch.Tensor, a: torch.Tensor, rows: LoRARows, out: torch.Tensor) -> torch.Tensor:
    """``x [T, K] @ a[slot].T`` per row into ``out`` (``shrink_buffer``'s), in P partial sums
    over parts of K (which ``expand`` adds up)."""
    t, k = x.shape
    ranks = a.shape[1]
    if t <= BGMV_MAX_ROWS:
        parts = out.shape[0]
        _bgmv_shrink[(t, parts)](x, a, out, rows.slots, k, ranks, x.stride(0), a.stride(0),
                                 a.stride(1), out.stride(0), SPLIT_K=_SPLIT_K,
                                 BLOCK_R=_block_r(ranks), num_warps=8)
    else:
        parts, split = _sgmv_parts(t, k)
        _sgmv_shrink[(triton.cdiv(t, _SHRINK_M), parts)](
            x, a, out, rows.sorted_rows, rows.slots, t, k, split, ranks, x.stride(0),
            a.stride(0), a.stride(1), out.stride(0), BLOCK_M=_SHRINK_M,
            BLOCK_R=_block_r(ranks), BLOCK_K=_SHRINK_K,
            IEEE=x.dtype == torch.float32 and a.dtype == torch.float32, num_warps=_SHRINK_WARPS)
    return out


def expand(shrunk: torch.Tensor, b: torch.Tensor, out: torch.Tensor, shards: Shards,
           rows: LoRARows) -> None:
    """``out [T, N] += shrunk.sum(0)[:, s*R:(s+1)*R] @ b[slot, :, off:off+n]`` per row and shard
    ``s`` (columns ``off .. off + n - 1``), in place, every shard in one launch (``shrunk``:
    ``shrink``'s partial sums)."""
    if len(shards) > 3:
        raise ValueError(f"a projection of {len(shards)} shards; the kernels take 3 at most")
    t, n = out.shape
    if b.stride(2) != 1:
        raise ValueError("B's output columns must be contiguous")
    rank = b.shape[1]
    # Where shards 1 and 2 begin (n where there is none): a column's shard is how many it passed.
    off1, off2 = ([off for off, _ in shards[1:]] + [n, n])[:2]
    args = (shrunk, b, out, off1, off2, n, rank, shrunk.shape[0], shrunk.stride(0),
            shrunk.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1))
    if t <= BGMV_MAX_ROWS:
        _bgmv_expand[(t, triton.cdiv(n, _BGMV_N))](
            *args, rows.slots, BLOCK_P=triton.next_power_of_2(shrunk.shape[0]),
            BLOCK_R=_block_r(rank), BLOCK_N=_BGMV_N)
    else:
        _sgmv_expand[(triton.cdiv(t, _EXPAND_M), triton.cdiv(n, _EXPAND_N))](
            *args, rows.sorted_rows, rows.slots, t, BLOCK_M=_EXPAND_M, BLOCK_R=_block_r(rank),
            BLOCK_N=_EXPAND_N, IEEE=b.dtype == torch.float32, num_warps=_EXPAND_WARPS)


@triton.jit
def _block_slots(sorted_ptr, slots_ptr, T, BLOCK_M: tl.constexpr):
    """A program's block of rows in slot order: the rows, their mask, their slots (-1 for
    masked rows) and the lowest and highest slot among them (hi < 0: no adapted row)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < T
    rows = tl.load(sorted_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    slots = tl.load(slots_ptr + rows, mask=mask_m, other=-1)
    hi = tl.max(slots, axis=0)
    lo = tl.min(tl.where(slots >= 0, slots, hi), axis=0)
    return rows, mask_m, slots, lo, hi


@triton.jit
def _block_shards(OFF1, OFF2, N, BLOCK_N: tl.constexpr):
    """A program's block of output columns: the columns, their mask, their shards and the
    first and last shard among them."""
    first = tl.program_id(1) * BLOCK_N
    offs_n = first + tl.arange(0, BLOCK_N)
    shard = (offs_n >= OFF1).to(tl.int32) + (offs_n >= OFF2).to(tl.int32)
    last = tl.minimum(first + BLOCK_N, N) - 1
    lo = (first >= OFF1).to(tl.int32) + (first >= OFF2).to(tl.int32)
    hi = (last >= OFF1).to(tl.int32) + (last >= OFF2).to(tl.int32)
    return offs_n, offs_n < N, shard, lo, hi


@triton.jit(do_not_specialize=["T", "K", "SPLIT", "RANKS"])
def _sgmv_shrink(x_ptr, a_ptr, out_ptr, sorted_ptr, slots_ptr, T, K, SPLIT, RANKS,
                 stride_x, stride_al, stride_ar, stride_part,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    rows, mask_m, row_slots, lo, hi = _block_slots(sorted_ptr, slots_ptr, T, BLOCK_M)
    if hi < 0:
        return
    part = tl.program_id(1)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANKS
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # Each slot among the block's rows in turn, its rows alone: the others' inputs are zero,
    # so every row's sum is its own slot's alone.
    for slot in range(lo, hi + 1):
        mine = mask_m & (row_slots == slot)
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            a_base = a_ptr + tl.cast(slot, tl.int64) * stride_al
            for k0 in range(part * SPLIT, tl.minimum(part * SPLIT + SPLIT, K), BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                xs = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                             mask=mine[:, None] & mask_k[None, :], other=0.0)
                at = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                             mask=mask_r[None, :] & mask_k[:, None], other=0.0)
                if IEEE:
                    acc += tl.dot(xs, at, input_precision="ieee")
                else:
                    acc += tl.dot(xs, at.to(xs.dtype))
    tl.store(out_ptr + part.to(tl.int64) * stride_part + rows[:, None] * RANKS
             + offs_r[None, :], acc, mask=(mask_m & (row_slots >= 0))[:, None] & mask_r[None, :])


@triton.jit(do_not_specialize=["K", "RANKS"])
def _bgmv_shrink(x_ptr, a_ptr, out_ptr, slots_ptr, K, RANKS, stride_x, stride_al, stride_ar,
                 stride_part, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANKS
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    offs_k = part * SPLIT_K + tl.arange(0, SPLIT_K)
    mask_k = offs_k < K
    xs = tl.load(x_ptr + row * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :],
                mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(a * xs[None, :], axis=1)
    tl.store(out_ptr + part.to(tl.int64) * stride_part + row * RANKS + offs_r, acc, mask=mask_r)


@triton.jit(do_not_specialize=["OFF1", "OFF2", "N", "RANK", "PARTS", "T"])
def _sgmv_expand(s_ptr, b_ptr, out_ptr, OFF1, OFF2, N, RANK, PARTS, stride_part, stride_s,
                 stride_bl, stride_br, stride_om, stride_on, sorted_ptr, slots_ptr, T,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                 IEEE: tl.constexpr):
    rows, mask_m, row_slots, lo, hi = _block_slots(sorted_ptr, slots_ptr, T, BLOCK_M)
    if hi < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    offs_n, mask_n, col_shards, first_shard, last_shard = _block_shards(OFF1, OFF2, N, BLOCK_N)
    # The output tile is read first, so its latency passes under the loads and dots below.
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = (mask_m & (row_slots >= 0))[:, None] & mask_n[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Each slot's rows alone (as in the shrink), and each shard's columns alone: a column's
    # sum is its own row's slot's and its own shard's, the other dots adding zeros.
    for slot in range(lo, hi + 1):
        mine = mask_m & (row_slots == slot)
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            b_base = b_ptr + tl.cast(slot, tl.int64) * stride_bl
            for shard in range(first_shard, last_shard + 1):
                s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for part in range(0, PARTS):  # the shrink's partial sums, in order
                    s += tl.load(s_ptr + part * stride_part + rows[:, None] * stride_s
                                 + shard * RANK + offs_r[None, :],
                                 mask=mine[:, None] & mask_r[None, :], other=0.0)
                cols = mask_n & (col_shards == shard)
                bt = tl.load(b_base + offs_r[:, None] * stride_br + offs_n[None, :],
                             mask=mask_r[:, None] & cols[None, :], other=0.0)
                if IEEE:
                    delta += tl.dot(s, bt, input_precision="ieee")
                else:
                    delta += tl.dot(s.to(bt.dtype), bt)
    tl.store(out_ptrs, (base.to(tl.float32) + delta).to(base.dtype), mask=mask)


@triton.jit(do_not_specialize=["OFF1", "OFF2", "N", "RANK", "PARTS"])
def _bgmv_expand(s_ptr, b_ptr, out_ptr, OFF1, OFF2, N, RANK, PARTS, stride_part, stride_s,
                 stride_bl, stride_br, stride_om, stride_on, slots_ptr, BLOCK_P: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    offs_n, mask_n, col_shards, first_shard, last_shard = _block_shards(OFF1, OFF2, N, BLOCK_N)
    b_base = b_ptr + slot.to(tl.int64) * stride_bl
    out_ptrs = out_ptr + row * stride_om + offs_n * stride_on
    base = tl.load(out_ptrs, mask=mask_n, other=0.0)  # first, as in SGMV's expand
    offs_p = tl.arange(0, BLOCK_P)
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for shard in range(first_shard, last_shard + 1):  # each shard's columns alone
        # The shrink's partial sums in one load, added up in a fixed order.
        parts = tl.load(s_ptr + offs_p[:, None] * stride_part + row * stride_s + shard * RANK
                        + offs_r[None, :], mask=(offs_p < PARTS)[:, None] & mask_r[None, :],
                        other=0.0)
        s = tl.sum(parts, axis=0)
        b = tl.load(b_base + offs_r[None, :] * stride_br + offs_n[:, None],
                    mask=(mask_n & (col_shards == shard))[:, None] & mask_r[None, :], other=0.0)
        delta += tl.sum(b.to(tl.float32) * s[None, :], axis=1)
    tl.store(out_ptrs, (base.to(tl.float32) + delta).to(base.dtype), mask=mask_n)
