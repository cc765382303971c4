"""RMSNorm, optionally fused with the residual add before it, one program per token.

Rounding follows the torch reference (``pagedserve.models.layer_ops``): the residual sum is
rounded to the activation dtype, normalised in float32, rounded again, then multiplied by the
weight, so bf16 results match the unfused ops bit for bit up to ``rsqrt``'s last place.

``rms_norm_fp8`` writes the output quantized to FP8 instead (``kernels.fp8_quant``'s layout and
rounding), as the W8A8 matmul after the norm reads it: the normalised row, rounded to the
activation dtype as the plain kernel would store it, is still in registers, so its scale and
FP8 values cost no second pass over memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.fp8_quant import fp8_kernel_args, store_row_fp8
from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, scale_ptr,
    stride_x, stride_r, stride_o, hidden, out_cols, eps, fmax, min_scale,
    HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr, STATIC: tl.constexpr,
    FNUZ: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r + cols
        x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(residual_ptr.dtype.element_ty)
        tl.store(r_ptrs, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (h.to(x.dtype).to(tl.float32) * w).to(x.dtype)
    if FP8_OUT:  # columns past ``hidden`` (the matmul's padding) get zeros
        store_row_fp8(out.to(tl.float32), out_ptr + row * stride_o + cols, scale_ptr, row,
                      cols < out_cols, fmax, min_scale, STATIC, FNUZ, SOFTWARE_ROUNDING)
    else:
        tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """``x`` ``[T, hidden]`` (rows may be strided, columns contiguous). With ``residual``
    (same shape, contiguous columns) the sum ``x + residual`` is written into ``residual`` in
    place and ``(out, residual)`` is returned; otherwise ``out``."""
    _check_rows(x, residual)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2, weight, eps, residual, out, out)
    out = out.view(x.shape)
    return out if residual is None else (out, residual)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None, fp8_dtype: torch.dtype, out_cols: int,
                 static_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm`` of a 2-D ``x`` whose output is quantized to ``fp8_dtype``: ``(q [T,
    out_cols], scales)``, ``out_cols >= hidden`` zero-padded. Scales are float32 ``[T, 1]``,
    one per token, or ``static_scale`` (a one-element tensor) when given. ``residual``, if
    given, receives the sum in place, as in ``rms_norm``."""
    if x.dim() != 2 or out_cols < x.shape[1]:
        raise ValueError("rms_norm_fp8 takes [T, hidden] and writes at least hidden columns")
    _check_rows(x, residual)
    q = torch.empty((x.shape[0], out_cols), dtype=fp8_dtype, device=x.device)
    scales = (static_scale if static_scale is not None else
              torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device))
    _launch(x, weight, eps, residual, q, scales, fp8_dtype, static_scale is not None)
    return q, scales


def _launch(x2: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
            out: torch.Tensor, scales: torch.Tensor, fp8_dtype: torch.dtype | None = None,
            static: bool = False) -> None:
    """``x2 [T, hidden]`` normalised into ``out``; ``scales`` is read or written only with
    ``fp8_dtype``."""
    r2 = residual.view(-1, x2.shape[1]) if residual is not None else x2
    hidden = x2.shape[1]
    block = triton.next_power_of_2(out.shape[1])
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, scales, x2.stride(0), r2.stride(0), out.stride(0), hidden,
            out.shape[1], eps, HAS_RESIDUAL=residual is not None,
            FP8_OUT=fp8_dtype is not None, STATIC=static, BLOCK=block,
            num_warps=min(16, max(1, block // 512)), **fp8_kernel_args(fp8_dtype),
            **launch_options(x2.device),
        )


def _check_rows(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs contiguous rows")
