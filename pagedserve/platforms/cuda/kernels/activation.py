"""SwiGLU over a fused gate/up projection: ``silu(x[:, :I]) * x[:, I:]`` in one pass.

silu is evaluated in float32 and rounded to the activation dtype before the product, as
``F.silu(gate) * up`` does in torch.

``silu_and_mul_fp8`` writes the product quantized to FP8 instead (``kernels.fp8_quant``'s
layout and rounding), for a W8A8 down projection: the values are those the plain kernel would
store, so the result equals ``silu_and_mul`` then ``quantize_per_token`` bit for bit, without
writing the ``[T, I]`` product and reading it back. A dynamic scale needs the row's largest
magnitude before the first value is written, so one program holds a whole row in registers, as
``rms_norm_fp8`` does (up to ``MAX_FUSED_COLUMNS``; wider rows are not fused). On the H200 at
Llama-3-8B's 14,336 (``scripts/bench_swiglu_fp8.py``): 22 us at 1,000 rows and 153 at 8,192,
against 39 and 313 for the two kernels, and 36 and 250 for a version that looped over the row
twice in blocks of 1,024 (the second pass from the L2 cache), 4 warps a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.fp8_quant import fp8_kernel_args, store_row_fp8
from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options

_BLOCK = 1024
# The widest padded row silu_and_mul_fp8 takes: 64 values a thread at 16 warps.
MAX_FUSED_COLUMNS = 32768


@triton.jit
def _silu_mul(row_ptr, cols, inter):
    """``silu(gate) * up`` of columns ``cols`` of one row, rounded to the activation dtype
    (zeros past ``inter``)."""
    mask = cols < inter
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0)
    up = tl.load(row_ptr + inter + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (silu * up).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + row * stride_o + cols, _silu_mul(x_ptr + row * stride_x, cols, inter),
             mask=cols < inter)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, inter, k_out, fmax, min_scale,
    STATIC: tl.constexpr, FNUZ: tl.constexpr, SOFTWARE_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    gate(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    y = _silu_mul(x_ptr + row * stride_x, cols, inter).to(tl.float32)
    # Columns past ``inter`` (the matmul's padding) get zeros.
    store_row_fp8(y, q_ptr + row * stride_q + cols, scale_ptr, row, cols < k_out, fmax,
                  min_scale, STATIC, FNUZ, SOFTWARE_ROUNDING)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, 2I]`` with contiguous columns -> ``[T, I]``."""
    x2, inter = _rows(x)
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(_BLOCK, triton.next_power_of_2(inter))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4,
            **launch_options(x2.device))
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, out_cols: int,
                     static_scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul`` of a 2-D ``x [T, 2I]`` quantized to ``fp8_dtype``: ``(q [T,
    out_cols], scales)``, ``I <= out_cols <= MAX_FUSED_COLUMNS`` zero-padded. Scales are
    float32 ``[T, 1]``, one per token, or ``static_scale`` (a one-element tensor) when
    given."""
    if x.dim() != 2:
        raise ValueError("silu_and_mul_fp8 takes a 2-D [T, 2I] input")
    x2, inter = _rows(x)
    if not inter <= out_cols <= MAX_FUSED_COLUMNS:
        raise ValueError(f"silu_and_mul_fp8 writes {inter} to {MAX_FUSED_COLUMNS} columns, "
                         f"not {out_cols}")
    q = torch.empty((x2.shape[0], out_cols), dtype=fp8_dtype, device=x.device)
    scales = (static_scale if static_scale is not None else
              torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device))
    block = triton.next_power_of_2(out_cols)
    if x2.shape[0]:
        _silu_and_mul_fp8_kernel[(x2.shape[0],)](
            x2, q, scales, x2.stride(0), q.stride(0), inter, out_cols,
            STATIC=static_scale is not None, BLOCK=block,
            num_warps=min(16, max(4, block // 512)), **fp8_kernel_args(fp8_dtype),
            **launch_options(x2.device),
        )
    return q, scales


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs contiguous rows")
    x2 = x.reshape(-1, x.shape[-1])
    return x2, x2.shape[1] // 2
