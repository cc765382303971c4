"""The routed experts of a mixture-of-experts layer as two grouped GEMMs (vLLM's ``fused_moe``
design), with no host sync, so a CUDA graph captures it for any routing.

``LayerOps.fused_moe`` states the contract. Here the ``T * K`` (token, expert) pairs are laid
out by ``moe_align.align_pairs`` (grouped by expert, each expert's rows padded to whole blocks
of ``BLOCK_M``). Each program of ``_expert_gemm_kernel`` takes one block of rows, all of one
expert, and one block of ``BLOCK_N`` output columns: it gathers its rows of ``a`` by pair id,
multiplies them by that expert's weight in float32 and scatters each row to its pair's row of
the output. The layer is then

1. ``gate_up[p] = hidden[p // K] @ w13[e_p].T``, ``[T*K, 2I]``;
2. ``act = silu_and_mul(gate_up)``, ``[T*K, I]`` (``kernels/activation.py``);
3. ``down[p] = topk_weights[p] * (act[p] @ w2[e_p].T)``, ``[T, K, H]``;
4. ``out[t] = sum_k down[t, k]``, summed in float32 by a torch reduction.

Every output element is written by one program in a fixed order and no float atomics are used,
so results are bit-reproducible from run to run. Rounding follows the torch reference: each
GEMM rounds its float32 result to the activation dtype once (the second after the routing
weight, where torch rounds before and after it).

FP8 experts (W8A16, ``LayerOps.fused_moe_fp8``): ``w13`` and ``w2`` may instead be stacked
``Fp8Weight`` (values ``[E, N, K]`` float8_e4m3fn, a scale per output row ``[E, N]``, a
per-tensor scale repeated per row) or ``BlockFp8Weight`` (scales ``[E, ceil(N / bn),
ceil(K / bk)]`` for blocks of ``bn x bk``). The same kernel, specialised by ``SCALES``, loads
the FP8 tiles, converts them exactly to the activation dtype in registers and multiplies the
16-bit activations by them; row scales multiply the accumulator once at the end, block scales
each K tile's partial product as it is added (``BLOCK_K`` divides ``bk``, so a tile lies in
one block). No step dequantizes a weight or reads anything on the host.

Integer experts (W4A16 and W8A16, ``LayerOps.fused_moe_int``): ``PackedIntWeight`` stacks,
codes ``[E, N, ceil(K * bits / 8)]`` (4-bit: two a byte along K), float32 scales and uint8
zero points ``[E, N, ceil(K / G)]``. The kernel (``INT_BITS`` 4 or 8) takes each tile's
codes out of their bytes and makes ``q - z`` in the activation dtype, exact (integers of at
most 8 bits), so the dot multiplies the checkpoint's integers; the group's scale then
multiplies the tile's partial product as block scales do (``SCALE_COLS`` = ``G``, ``BLOCK_K``
a divisor of it), or, with one group a row (per channel), the accumulator once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.activation import silu_and_mul
from pagedserve.platforms.cuda.kernels.device import (
    converts_e4m3fn,
    gpu_arch,
    shared_memory_bytes,
)
from pagedserve.platforms.cuda.kernels.fp8_gemv import fp8_as_float
from pagedserve.platforms.cuda.kernels.moe_align import AlignedPairs, align_pairs
from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options
from pagedserve.platforms.cuda.kernels.prefill_attention import dot_precision
from pagedserve.quant.weights import BlockFp8Weight, Fp8Weight, PackedIntWeight

# An expert stack as the kernel reads it: 16-bit ``[E, N, K]``, or FP8 or integer codes with
# their scales.
ExpertWeights = torch.Tensor | Fp8Weight | BlockFp8Weight | PackedIntWeight


@dataclass(frozen=True, slots=True)
class MoeConfig:
    block_m: int  # rows of one expert a program takes (the alignment's padding unit)
    block_n: int
    block_k: int
    group_m: int  # blocks of rows that sweep the columns together, for the L2 cache
    num_warps: int
    num_stages: int


# By the rows an expert gets on average (T * K / E): decode steps stream each expert's weight
# through few rows; prefill steps reuse each weight tile over many. Started from vLLM's tables
# for Mixtral-8x7B and Qwen3-30B-A3B on the H100, regrouped by rows per expert; then swept on
# an H100 (2026-12-05, scripts/bench_fused_moe.py --sweep, benchmarks/results/issue30/s52/
# fused_moe_sweep_h100.json): each row was the fastest candidate or within 3% of it, but for
# 9-32 rows, where blocks of 64 rows and no grouping took 1,030 against 1,059 us (Mixtral, 128
# tokens) and 533 against 572 (Qwen3-30B-A3B, 512 tokens) for vLLM's 32-row tiles.
_CONFIGS = (
    (8, MoeConfig(16, 64, 128, 1, 4, 4)),
    (32, MoeConfig(64, 128, 128, 1, 8, 4)),
    (96, MoeConfig(64, 128, 64, 8, 8, 4)),
    (None, MoeConfig(128, 256, 64, 8, 8, 4)),
)


def moe_config(rows_per_expert: float, dtype: torch.dtype, arch: str | None,
               shared_bytes: int | None = None) -> MoeConfig:
    """The tiles for a step whose experts get ``rows_per_expert`` rows on average, ``fit``
    to the dtype and the GPU."""
    cfg = next(c for bound, c in _CONFIGS if bound is None or rows_per_expert <= bound)
    return fit(cfg, dtype, arch, shared_bytes)


def fit(cfg: MoeConfig, dtype: torch.dtype, arch: str | None,
        shared_bytes: int | None) -> MoeConfig:
    """A row of the table as launched: float32 halves ``block_k`` (the same shared memory per
    stage). AMD GPUs (``arch``, None on NVIDIA) take 2 stages, within the 64 KiB of LDS of all
    but gfx950 (compile-only: ``scripts/amd_compile_sweep.py``). On NVIDIA the stages are cut
    to what ``shared_bytes`` (a program's shared memory; None: no limit, as under the
    interpreter) holds, a copy of both tiles each: the largest tiles take 192 KiB at 4 stages,
    which fits the H100 and not an A100."""
    if dtype == torch.float32:
        cfg = replace(cfg, block_k=cfg.block_k // 2)
    if arch is not None:
        return replace(cfg, num_stages=2)
    if shared_bytes is None:
        return cfg
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * dtype.itemsize
    return replace(cfg, num_stages=max(1, min(cfg.num_stages, shared_bytes // stage)))


@triton.jit
def _int_weights(q, ks, z, DTYPE: tl.constexpr, INT_BITS: tl.constexpr):
    """A ``[BLOCK_K, BLOCK_N]`` tile of uint8 codes (4-bit: the byte of each pair of rows,
    row ``k`` in its ``k % 2`` nibble) less each column's zero point ``z``, in ``DTYPE``,
    exact. 16-bit types take the code under the exponent of 1024 (float16, ``0x6400``) or 128
    (bfloat16, 4-bit only: ``0x4300``), which reads ``1024 + q`` or ``128 + q`` with integer
    ops alone, less ``1024 + z`` or ``128 + z`` (one binade: exact) in place of a conversion
    per code, a quarter-rate instruction."""
    q = q.to(tl.int32)
    if INT_BITS == 4:
        q = (q >> ((ks % 2) * 4)[:, None]) & 0xF
    z = z.to(tl.float32)[None, :]
    if DTYPE == tl.float16:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (z + 1024.0).to(DTYPE)
    elif DTYPE == tl.bfloat16 and INT_BITS == 4:
        return (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (z + 128.0).to(DTYPE)
    else:
        return q.to(DTYPE) - z.to(DTYPE)


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, c_ptr, route_ptr, sorted_ids_ptr, block_experts_ptr, total_ptr, scale_ptr,
    zero_ptr, N, K, num_pairs, pairs_per_a_row, num_m_blocks, stride_am, stride_we, stride_wn,
    stride_cm, stride_se, stride_sn, stride_sk,
    ROUTE_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
    SCALES: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    INT_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    """``c[p] = (route[p] *) a[p // pairs_per_a_row] @ w[expert of p].T`` for the pairs of one
    block of aligned rows; ``a`` ``[*, K]``, ``w`` ``[E, N, K]``, ``c`` ``[P, N]``, all with
    contiguous last dimensions. ``SCALES``: "none" (``w`` in ``a``'s dtype), "row"
    (``scale[e, n]``) or "block" (``scale[e, n // SCALE_ROWS, k // SCALE_COLS]``). ``INT_BITS``
    0: ``w`` holds floats, FP8 ones as float8_e4m3fn or as its bits in uint8; 4 or 8: integer
    codes (4-bit two a byte along K, ``w`` ``[E, N, ceil(K / 2)]``) less ``zero[e, n, g]``,
    ``zero`` in the scales' layout and strides."""
    gate(PDL)
    PACK: tl.constexpr = 2 if INT_BITS == 4 else 1  # codes a byte
    pid = tl.program_id(0)
    # GROUP_M consecutive blocks of rows take each block of columns in turn, so the programs
    # running together share weight tiles in the L2 cache.
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = min(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # past the padded total: the grid is sized for any routing
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + rows)
    valid = pairs < num_pairs  # padding rows hold the sentinel num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    a_rows = (pairs // pairs_per_a_row).to(tl.int64)
    # Columns past N wrap to valid ones (loads need no mask); their results are not stored.
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    w_ptrs = (w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
              + (ks // PACK)[:, None])
    # Each column's scales (and zero points): its row of the block grid (SCALE_ROWS is 1 for
    # row scales and integer groups).
    scale_offs = expert * stride_se + (cols // SCALE_ROWS) * stride_sn
    if INT_BITS and SCALES == "row":
        z = tl.load(zero_ptr + scale_offs)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & (ks[None, :] < left), other=0.0)
            w = tl.load(w_ptrs, mask=ks[:, None] < left, other=0.0)
        if SCALES == "block":
            # BLOCK_K divides SCALE_COLS: this tile's columns share one scale per column.
            group_offs = scale_offs + (k * BLOCK_K // SCALE_COLS) * stride_sk
            s = tl.load(scale_ptr + group_offs)
            if INT_BITS:
                z = tl.load(zero_ptr + group_offs)
        if INT_BITS:
            w = _int_weights(w, ks, z, a.dtype, INT_BITS)
        else:
            if w.dtype == tl.uint8:
                w = fp8_as_float(w)
            w = w.to(a.dtype)  # exact from e4m3 to any 16-bit float
        if SCALES == "block":
            acc += tl.dot(a, w, input_precision=DOT_PREC) * s[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // PACK
    if SCALES == "row":
        acc = acc * tl.load(scale_ptr + scale_offs)[None, :]
    if ROUTE_WEIGHT:
        acc = acc * tl.load(route_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + out_cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (out_cols[None, :] < N))


def fused_moe(hidden: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``LayerOps.fused_moe``'s contract, and ``LayerOps.fused_moe_fp8``'s and
    ``fused_moe_int``'s where ``w13`` and ``w2`` are FP8 or integer: ``hidden`` ``[T, H]``,
    ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``, ``topk_ids`` ``[T, K]``, ``topk_weights``
    ``[T, K]`` -> ``[T, H]``."""
    num_tokens, top_k = topk_ids.shape
    cfg = step_config(num_tokens * top_k / w13.shape[0], hidden.dtype, hidden.device)
    return fused_moe_with(cfg, hidden, w13, w2, topk_ids, topk_weights)


def step_config(rows_per_expert: float, dtype: torch.dtype, device: torch.device) -> MoeConfig:
    """``moe_config`` for the GPU ``device`` (the tiles ``fused_moe`` launches)."""
    return moe_config(rows_per_expert, dtype, gpu_arch(device), shared_memory_bytes(device))


def fused_moe_with(cfg: MoeConfig, hidden: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights,
                   topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``fused_moe`` with the tiles ``cfg`` (the tests and the benchmark pick them)."""
    first, second = _operand(w13, hidden, cfg), _operand(w2, hidden, cfg)
    num_tokens, top_k = topk_ids.shape
    hidden_size, dtype = hidden.shape[1], hidden.dtype
    if num_tokens == 0:
        return torch.empty_like(hidden)
    aligned = align_pairs(topk_ids, w13.shape[0], cfg.block_m)
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=dtype, device=hidden.device)
    _gemm(cfg, hidden, first, gate_up, aligned, top_k, None)
    down = torch.empty(num_tokens, top_k, hidden_size, dtype=dtype, device=hidden.device)
    _gemm(cfg, silu_and_mul(gate_up), second, down.view(-1, hidden_size), aligned, 1,
          topk_weights.reshape(-1).float())
    if top_k == 1:
        return down.view(num_tokens, hidden_size)
    return down.sum(dim=1, dtype=torch.float32).to(dtype)


class _Operand(NamedTuple):
    """An expert stack as one launch reads it."""
    values: torch.Tensor  # [E, N, K]: 16-bit, float8_e4m3fn or its bits as uint8; or codes
    scales: torch.Tensor  # float32 [E, N] or [E, N blocks, K blocks]; unread for 16-bit
    zeros: torch.Tensor  # uint8 zero points in the scales' layout; unread but for integers
    mode: str  # the kernel's SCALES
    block: tuple[int, int]  # SCALE_ROWS, SCALE_COLS
    block_k: int  # the K tile: the config's, or less to fit in a block of scales
    int_bits: int  # the kernel's INT_BITS
    columns: int  # K


def _operand(w: ExpertWeights, hidden: torch.Tensor, cfg: MoeConfig) -> _Operand:
    if isinstance(w, torch.Tensor):
        _check_rows(hidden, w)
        if w.dtype != hidden.dtype:
            raise ValueError(f"fused_moe takes one dtype: hidden {hidden.dtype}, experts "
                             f"{w.dtype}")
        return _Operand(w, w, w, "none", (1, 1), cfg.block_k, 0, w.shape[2])
    values = w.values
    _check_rows(hidden, values)
    if isinstance(w, PackedIntWeight):
        return _int_operand(w, cfg)
    if values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fused_moe's FP8 experts are float8_e4m3fn, not {values.dtype}")
    if not converts_e4m3fn(values.device):
        values = values.view(torch.uint8)
    scales = w.scales.float()
    k = w.shape[2]
    if isinstance(w, Fp8Weight):
        return _Operand(values, scales, scales, "row", (1, 1), cfg.block_k, 0, k)
    block_k = _tile_in(w.block[1], cfg, "FP8 blocks")
    return _Operand(values, scales, scales, "block", w.block, block_k, 0, k)


def _int_operand(w: PackedIntWeight, cfg: MoeConfig) -> _Operand:
    if w.scales.dtype != torch.float32 or w.zeros.dtype != torch.uint8:
        raise ValueError(f"fused_moe's integer experts have float32 scales and uint8 zero "
                         f"points, not {w.scales.dtype} and {w.zeros.dtype}")
    if w.scales.shape[-1] == 1:  # one group a row: scaled once at the end
        return _Operand(w.values, w.scales, w.zeros, "row", (1, 1), cfg.block_k, w.bits,
                        w.columns)
    block_k = _tile_in(w.group_size, cfg, "integer groups")
    return _Operand(w.values, w.scales, w.zeros, "block", (1, w.group_size), block_k, w.bits,
                    w.columns)


def _tile_in(width: int, cfg: MoeConfig, what: str) -> int:
    """The K tile for scales that change every ``width`` columns: the config's, or the largest
    power of 2 dividing ``width`` where that is less."""
    block_k = min(cfg.block_k, width & -width)
    if block_k < 16:
        raise ValueError(f"fused_moe reads {what} {width} columns wide in tiles of 16 or more "
                         f"columns that divide them: {width} has none")
    return block_k


def _gemm(cfg: MoeConfig, a: torch.Tensor, w: _Operand, out: torch.Tensor,
          aligned: AlignedPairs, pairs_per_a_row: int, route: torch.Tensor | None) -> None:
    """One grouped GEMM into ``out`` ``[P, N]``; ``route``: float32 ``[P]`` routing weights
    multiplied into each row, or None."""
    num_m_blocks = aligned.block_experts.numel()
    values, scales = w.values, w.scales
    n, k = values.shape[1], w.columns
    if w.int_bits and w.mode == "row":  # [E, N, 1]: no K dimension, as FP8 row scales
        scales, zeros = scales[..., 0], w.zeros[..., 0]
    else:
        zeros = w.zeros
    scale_strides = (*scales.stride(), 0)[:3]  # row scales have no K dimension
    if w.int_bits and zeros.stride() != scales.stride():
        raise ValueError("fused_moe reads integer experts' zero points in their scales' strides")
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n),)
    _expert_gemm_kernel[grid](
        a, values, out, route if route is not None else out, aligned.sorted_ids,
        aligned.block_experts, aligned.total, scales, zeros, n, k, out.shape[0],
        pairs_per_a_row, num_m_blocks, a.stride(0), values.stride(0), values.stride(1),
        out.stride(0), *scale_strides, ROUTE_WEIGHT=route is not None,
        EVEN_K=k % w.block_k == 0, DOT_PREC=dot_precision(a.dtype, gpu_arch(a.device)),
        SCALES=w.mode, SCALE_ROWS=w.block[0], SCALE_COLS=w.block[1], INT_BITS=w.int_bits,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=w.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(a.device),
    )


def _check_rows(hidden: torch.Tensor, values: torch.Tensor) -> None:
    if hidden.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("fused_moe needs contiguous rows of hidden and of each expert weight")
