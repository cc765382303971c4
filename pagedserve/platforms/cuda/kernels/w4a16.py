"""``y = x @ W.T`` with a 4-bit grouped weight, dequantized in registers (W4A16).

Layout the kernel reads (built once at load by ``pack``):

- ``qweight`` int32 ``[ceil(K / 8), N]``: word ``[j, n]`` holds ``W[n, 8j .. 8j + 7]``, nibble
  ``i`` (bits ``4i .. 4i + 3``) for column ``8j + i``; K is padded with zero nibbles. N is the
  contiguous dimension, so a tile of words is read coalesced along the output features.
- ``scales``, ``shifts`` ``[ceil(K / G), N]``: with ``zero_point``,
  ``W[n, k] = (q[n, k] - shifts[g, n]) * scales[g, n]`` (``g = k // G``), which keeps AWQ's and
  GPTQ's integer zero points exact in float16; otherwise ``q * scales + shifts`` (GGUF's
  ``q * d + m``). Float16 where that form is exact in it (checkpoints store float16 scales),
  else float32, so packing never rounds the weight.

One kernel serves every M: a program computes a ``BLOCK_M x BLOCK_N`` tile of ``y`` over one
of ``SPLIT_K`` slices of K, reading each tile of W once for all its rows. Decode (small M) uses
one block of rows and splits K so that enough programs stream the weight; prefill (large M)
uses large tiles and no split. Accumulation is float32; a split writes float32 partial sums
that are added in order (deterministic). Configurations are fixed per range of M (no
autotuning) and M is not specialized on, so a new batch size compiles nothing; nothing in
``matmul`` synchronizes with the host, so CUDA graphs capture it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class PackedW4(NamedTuple):
    qweight: torch.Tensor  # int32 [ceil(K / 8), N]
    scales: torch.Tensor  # float16 or float32 [ceil(K / G), N]
    shifts: torch.Tensor  # same dtype and shape as scales
    in_features: int
    group_size: int
    zero_point: bool


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pack(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
         device: torch.device) -> PackedW4:
    """From ``GroupQuantWeight`` fields (values ``[N, K]`` in 0..15, float32 scales and offsets
    ``[N, ceil(K / G)]``) to the kernel's layout on ``device``."""
    n, k = values.shape
    words = -(-k // 8)
    v = torch.nn.functional.pad(values.to(device), (0, words * 8 - k)).view(n, words, 8)
    packed = torch.zeros((n, words), dtype=torch.int64, device=device)
    for i in range(8):  # a nibble at a time: int64 of [N, K / 8], not of [N, K]
        packed |= v[..., i].to(torch.int64) << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    s = scales.to(device=device, dtype=torch.float64)
    o = offsets.to(device=device, dtype=torch.float64)
    z = -o / s  # inf or nan where a scale is 0: not exact in half, so the offset form
    if _exact_in_half(s) and _exact_in_half(z):
        zero_point, shifts, dtype = True, z, torch.float16
    else:  # float32 is exact for the inputs as they are
        zero_point, shifts = False, o
        dtype = torch.float16 if _exact_in_half(s) and _exact_in_half(o) else torch.float32
    return PackedW4(packed.T.contiguous(), s.T.to(dtype).contiguous(),
                    shifts.T.to(dtype).contiguous(), k, group_size, zero_point)


def _exact_in_half(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all() and torch.equal(t.half().double(), t))


@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_om, stride_os,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ONE_GROUP_PER_BLOCK: tl.constexpr, ZERO_POINT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    shifts = (tl.arange(0, BLOCK_K) % 8) * 4
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_n[None, :]
        words = tl.load(qw_ptr + (offs_k // 8)[:, None].to(tl.int64) * N + offs_n[None, :],
                        mask=mask_w, other=0)
        q = ((words >> shifts[:, None]) & 0xF).to(tl.float32)
        if ONE_GROUP_PER_BLOCK:
            g_ptrs = (k0 // group_size) * N + offs_n[None, :]
            s = tl.load(s_ptr + g_ptrs, mask=mask_n[None, :], other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g_ptrs, mask=mask_n[None, :], other=0.0).to(tl.float32)
        else:
            g_ptrs = (offs_k // group_size)[:, None] * N + offs_n[None, :]
            s = tl.load(s_ptr + g_ptrs, mask=mask_w, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g_ptrs, mask=mask_w, other=0.0).to(tl.float32)
        if ZERO_POINT:
            w = ((q - z) * s).to(x.dtype)
        else:
            w = (q * s + z).to(x.dtype)
        if x.dtype == tl.float32:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out_ptrs = (out_ptr + pid_s.to(tl.int64) * stride_os
                + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :])
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _config(m: int) -> _Config:
    # Fixed configurations by M; small M streams W (bandwidth), large M amortizes the dequant
    # of each W tile over many rows (compute).
    if m <= 16:
        return _Config(16, 64, 128, 4, 4)
    if m <= 64:
        return _Config(64, 64, 64, 4, 4)
    if m <= 256:
        return _Config(64, 128, 64, 4, 4)
    return _Config(128, 128, 64, 8, 3)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(programs: int, k_blocks: int, device: torch.device) -> int:
    """Slices of K so that about two waves of programs stream the weight, each slice at least
    four blocks of K long."""
    target = 2 * _num_sms(device)
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), k_blocks // 4))


def matmul(x: torch.Tensor, w: PackedW4, split_k: int | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (float16, bfloat16 or float32) times the packed weight: ``[M, N]`` in
    ``x``'s dtype, written into ``out`` (contiguous) if given. ``split_k`` overrides the
    choice of slices (tests)."""
    m, k = x.shape
    n = w.qweight.shape[1]
    if k != w.in_features:
        raise ValueError(f"x has {k} columns, the weight {w.in_features}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = _config(m)
    block_k = cfg.block_k
    if w.group_size < block_k and w.group_size % 16 == 0:
        block_k = w.group_size  # so that each block of K lies in one group
    grid_mn = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    k_blocks = triton.cdiv(k, block_k)
    splits = split_k or _split_k(grid_mn[0] * grid_mn[1], k_blocks, x.device)
    k_per_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    target = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32,
                                                  device=x.device)
    one_group = w.group_size % block_k == 0 or w.scales.shape[0] == 1
    _w4a16_kernel[(grid_mn[0], grid_mn[1], splits)](
        x, w.qweight, w.scales, w.shifts, target,
        m, n, k, w.group_size, k_per_split,
        x.stride(0), target.stride(-2), target.stride(0) if splits > 1 else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        ONE_GROUP_PER_BLOCK=one_group, ZERO_POINT=w.zero_point,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        out.copy_(target.sum(0))
    return out
