"""``y = x @ (W * scale).T`` for a few rows of ``x`` and an FP8 weight: the decode-time
(batch 1 and 2) companion of ``torch._scaled_mm``, and the weight-only FP8 matmul of GPUs
without FP8 (``dequantize`` + ``torch.mm`` above a few rows).

At a few rows a matmul only streams the weight; ``_scaled_mm``'s tensor-core tiles are 64 or
more rows tall and its activation quantization is one more launch, so here the weight is read
once by CUDA cores, converted to float32 in registers and multiplied by the activations as they
are (weight-only FP8: the activations keep their 16 bits, which is the more accurate product).
One program reads ``BLOCK_N`` whole rows of the weight (K contiguous, coalesced) for one row of
``x``; the programs of one block of N for the different rows of ``x`` are adjacent in the grid,
so the second and later rows find the weight in L2.

Weights given as uint8 (the e4m3fn bits) are decoded with integer operations, so the kernels
run where Triton has no FP8 type (NVIDIA before sm_89, AMD before MI300); FP8-typed weights
use the hardware conversion.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options

# The most rows of x this kernel takes; above, ``_scaled_mm``.
MAX_M = 2


class _Config(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _config(m: int) -> _Config:
    # Swept on the H200 over the 8B shapes at M = 1 (BLOCK_N 8-32, BLOCK_K 256-1024, 4 or 8
    # warps, 2 or 4 stages): 76% of the copy rate, against 57-73% for the others but one.
    return _Config(8, 1024, 4, 2)


@triton.jit
def fp8_as_float(w):
    """FP8 weights as float32: FP8 types by conversion; uint8 as e4m3fn bits (sign, 4-bit
    exponent of bias 7, 3-bit mantissa; exponent 0 is subnormal: ``mantissa * 2**-9``).
    e4m3fn's one NaN pattern per sign (0x7F/0xFF) never occurs in a quantized weight."""
    if w.dtype == tl.uint8:
        bits = w.to(tl.int32)
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
        return tl.where((bits & 0x80) != 0, -magnitude, magnitude)
    else:
        return w.to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                     stride_om, PER_TENSOR: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    gate(PDL)
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # Per-thread partial sums, reduced along K once at the end.
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + pid_m.to(tl.int64) * stride_xm + offs_k, mask=mask_k, other=0.0)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += fp8_as_float(w) * x.to(tl.float32)[None, :]
    if PER_TENSOR:
        scale = tl.load(scale_ptr)
    else:
        scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    y = tl.sum(acc, axis=1) * scale
    tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + offs_n,
             y.to(out_ptr.dtype.element_ty), mask=mask_n)


def matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           out_features: int) -> torch.Tensor:
    """``x [M, K]`` (M <= ``MAX_M``) times ``weight [N', K' >= K]`` (FP8, or uint8 holding
    e4m3fn bits; row-major, columns past K are never read) with float32 ``scale`` per tensor
    (0-dim) or per row (``[1, N']`` or ``[N']``): ``[M, out_features]`` in ``x``'s dtype."""
    m, k = x.shape
    if m > MAX_M or weight.shape[1] < k or weight.stride(1) != 1:
        raise ValueError(f"the FP8 GEMV takes up to {MAX_M} rows and a row-major weight at "
                         f"least {k} columns wide")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((m, out_features), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = _config(m)
    _fp8_gemv_kernel[(m, triton.cdiv(out_features, cfg.block_n))](
        x, weight, scale, out, m, out_features, k, x.stride(0), weight.stride(0), out.stride(0),
        PER_TENSOR=scale.dim() == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(x.device))
    return out


@triton.jit
def _fp8_dequant_kernel(w_ptr, scale_ptr, out_ptr, N, K, stride_wn, PER_TENSOR: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    gate(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=mask,
                other=0)
    if PER_TENSOR:
        scale = tl.load(scale_ptr)
    else:
        scale = tl.load(scale_ptr + offs_n, mask=offs_n < N, other=0.0)[:, None]
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
             (fp8_as_float(w) * scale).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, out_features: int, in_features: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[out_features, in_features]`` weight of ``dtype`` (rounded once)."""
    out = torch.empty((out_features, in_features), dtype=dtype, device=weight.device)
    block_n, block_k = 16, 256
    _fp8_dequant_kernel[(triton.cdiv(out_features, block_n), triton.cdiv(in_features, block_k))](
        weight, scale, out, out_features, in_features, weight.stride(0),
        PER_TENSOR=scale.dim() == 0, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **launch_options(out.device))
    return out
