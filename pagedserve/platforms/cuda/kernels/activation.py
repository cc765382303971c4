"""SwiGLU over a fused gate/up projection: ``silu(x[:, :I]) * x[:, I:]`` in one pass.

silu is evaluated in float32 and rounded to the activation dtype before the product, as
``F.silu(gate) * up`` does in torch.

``silu_and_mul_fp8`` writes the product quantized to FP8 (``kernels.fp8_quant``'s layout and
rounding) for the W8A8 down projection. A dynamic scale needs the whole row's largest value
before any FP8 value is written, so one program takes a row and walks it twice: the second
walk reads the gate and up rows again, from L2, instead of a product written to and read back
from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.fp8_quant import fp8_kernel_args, row_scale, to_fp8_grid

_BLOCK = 1024
# Columns per step of the FP8 kernel's walk along a row.
_FP8_BLOCK = 4096


@triton.jit
def _swiglu(x_ptr, cols, mask, inter, dtype: tl.constexpr):
    """``silu(gate) * up`` at ``cols`` of the row at ``x_ptr``, rounded to ``dtype``."""
    gate = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + inter + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    out = _swiglu(x_ptr + row * stride_x, cols, mask, inter, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, inter, out_cols, fmax, min_scale,
    STATIC: tl.constexpr, FNUZ: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    dtype = x_ptr.dtype.element_ty
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        absmax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, inter, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = _swiglu(x_row, cols, cols < inter, inter, dtype).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(y))
        scale = row_scale(tl.max(absmax, axis=0), fmax, min_scale)
        tl.store(scale_ptr + row, scale)
    for start in range(0, out_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        y = _swiglu(x_row, cols, cols < inter, inter, dtype).to(tl.float32)
        q = to_fp8_grid(y, scale, fmax, FNUZ, SOFTWARE_ROUNDING)  # zeros past ``inter``
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty),
                 mask=cols < out_cols)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, 2I]`` with contiguous columns -> ``[T, I]``."""
    x2 = _rows(x)
    inter = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(_BLOCK, triton.next_power_of_2(inter))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, out_cols: int,
                     static_scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul`` of ``x [T, 2I]`` quantized to ``fp8_dtype``: ``(q [T, out_cols],
    scales)``, ``out_cols >= I`` zero-padded; scales as ``rms_norm_fp8``'s."""
    x2 = _rows(x)
    inter = x2.shape[1] // 2
    if out_cols < inter:
        raise ValueError(f"silu_and_mul_fp8 writes at least {inter} columns, not {out_cols}")
    q = torch.empty((x2.shape[0], out_cols), dtype=fp8_dtype, device=x.device)
    scales = (static_scale if static_scale is not None else
              torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device))
    if x2.shape[0]:
        _silu_and_mul_fp8_kernel[(x2.shape[0],)](
            x2, q, scales, x2.stride(0), q.stride(0), inter, out_cols,
            STATIC=static_scale is not None,
            BLOCK=min(_FP8_BLOCK, triton.next_power_of_2(out_cols)), num_warps=8,
            **fp8_kernel_args(fp8_dtype))
    return q, scales


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs contiguous rows")
    return x.reshape(-1, x.shape[-1])
