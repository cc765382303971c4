"""Activations quantized to FP8 for a W8A8 matmul, one program per token.

``row_scale`` and ``to_fp8_grid`` are the arithmetic, and ``store_row_fp8`` the whole step for
a row held in registers, shared with ``rms_norm_fp8`` and ``silu_and_mul_fp8``, which quantize
their own output the same way.

``x [M, K]`` (rows may be strided, columns contiguous) becomes ``q [M, K_out]`` in the output's
FP8 type (e4m3fn, or e4m3fnuz on MI300) and float32 scales ``[M, 1]``, with
``x[m, k] ~= float(q[m, k]) * scale[m]``. Columns ``K .. K_out`` of ``q`` are written as zeros, so
a matmul whose K must be a multiple of 16 reads a padded copy at no extra cost.

- dynamic (per token): ``scale[m] = max(absmax(x[m]) / fmax, tiny)``: the row's largest
  magnitude maps to the type's largest finite value (448 for e4m3fn); the floor keeps an
  all-zero row's scale positive.
- static (per tensor): the given scale, read from a device tensor (no host sync, so it can be
  captured in a CUDA graph); values beyond ``fmax`` saturate.

Each value is ``x * inv`` in float32, ``inv`` being ``1 / scale`` correctly rounded once per
row (``div_rn``), then rounded to nearest even on the FP8 grid. A correctly rounded division
per value, as this kernel first did, cost more than the memory traffic: the kernel ran at about
a third of the copy rate on the H200, and 58% with the reciprocal (``scripts/profile_step.py``,
batch 1,000). On NVIDIA GPUs the cast itself rounds to nearest even (and saturates); in
Triton's interpreter it does not, and e4m3fnuz's cast never ran on an AMD GPU here, so there
``reshape_and_cache``'s ``_round_to_e4m3`` rounds first and the cast is exact. e4m3fnuz's grid
is e4m3fn's halved (its exponent bias is one larger), so it rounds ``2 * q`` on e4m3fn's grid
and halves the result, both steps exact.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options
from pagedserve.platforms.cuda.kernels.reshape_and_cache import _round_to_e4m3

_BLOCK = 1024


@triton.jit
def row_scale(absmax, fmax, min_scale):
    """A row's dynamic scale from its largest magnitude (float32)."""
    return tl.maximum(tl.div_rn(absmax, fmax), min_scale)


@triton.jit
def to_fp8_grid(x, scale, fmax, FNUZ: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    """``x / scale`` (float32) saturated and, where the cast would not, rounded to the FP8
    grid; still float32, for the caller to cast on store."""
    q = tl.clamp(x * tl.div_rn(1.0, scale), -fmax, fmax)
    if FNUZ:
        q = _round_to_e4m3(q * 2.0) * 0.5
    elif SOFTWARE_ROUNDING:
        q = _round_to_e4m3(q)
    return q


@triton.jit
def store_row_fp8(y, q_ptrs, scale_ptr, row, store_mask, fmax, min_scale,
                  STATIC: tl.constexpr, FNUZ: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr):
    """Quantize one row ``y`` (float32, whole in registers) to ``q_ptrs``' FP8 type: with its
    dynamic scale (written to ``scale_ptr + row``) or the static one at ``scale_ptr``. Padding
    columns (zeros in ``y``) get zeros. For the ops that produce a row before a W8A8 matmul."""
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        scale = row_scale(tl.max(tl.abs(y), axis=0), fmax, min_scale)
        tl.store(scale_ptr + row, scale)
    q = to_fp8_grid(y, scale, fmax, FNUZ, SOFTWARE_ROUNDING)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=store_mask)


@triton.jit
def _fp8_quant_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, K, K_OUT, fmax, min_scale,
    STATIC: tl.constexpr, FNUZ: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        absmax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < K, other=0.0)
            absmax = tl.maximum(absmax, tl.abs(x.to(tl.float32)))
        scale = row_scale(tl.max(absmax, axis=0), fmax, min_scale)
        tl.store(scale_ptr + row, scale)
    for start in range(0, K_OUT, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < K, other=0.0)
        q = to_fp8_grid(x.to(tl.float32), scale, fmax, FNUZ, SOFTWARE_ROUNDING)
        tl.store(q_ptr + row * stride_q + start + cols, q.to(q_ptr.dtype.element_ty),
                 mask=start + cols < K_OUT)


def quantize_per_token(x: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                       padded_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, padded_k], scales float32 [M, 1])``, a scale per row."""
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    return _launch(x, fp8_dtype, padded_k, scales, static=False), scales


def quantize_static(x: torch.Tensor, scale: torch.Tensor,
                    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                    padded_k: int | None = None) -> torch.Tensor:
    """``x [M, K]`` -> ``q [M, padded_k]`` with one float32 ``scale`` (a one-element tensor)."""
    return _launch(x, fp8_dtype, padded_k, scale, static=True)


def fp8_kernel_args(fp8_dtype: torch.dtype | None) -> dict:
    """The arguments every kernel that may write FP8 activations takes: the type's largest
    value, the smallest dynamic scale, and how values reach the grid (``to_fp8_grid``); for
    ``None`` (no FP8 output) placeholders the kernel never reads."""
    if fp8_dtype is None:
        return dict(fmax=1.0, min_scale=1.0, FNUZ=False, SOFTWARE_ROUNDING=False)
    return dict(fmax=torch.finfo(fp8_dtype).max, min_scale=torch.finfo(torch.float32).tiny,
                FNUZ=fp8_dtype == torch.float8_e4m3fnuz,
                SOFTWARE_ROUNDING=os.environ.get("TRITON_INTERPRET") == "1")


def _launch(x: torch.Tensor, fp8_dtype: torch.dtype, padded_k: int | None,
            scales: torch.Tensor, static: bool) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError("fp8 quantization needs a 2-D input with contiguous rows")
    m, k = x.shape
    k_out = k if padded_k is None else padded_k
    q = torch.empty((m, k_out), dtype=fp8_dtype, device=x.device)
    if m:
        _fp8_quant_kernel[(m,)](
            x, q, scales, x.stride(0), q.stride(0), k, k_out, STATIC=static,
            BLOCK=min(_BLOCK, triton.next_power_of_2(k_out)), num_warps=4,
            **fp8_kernel_args(fp8_dtype), **launch_options(x.device),
        )
    return q
