"""RMSNorm, optionally fused with the residual add before it, one program per token.

Rounding follows the torch reference (``pagedserve.models.layer_ops``): the residual sum is
rounded to the activation dtype, normalised in float32, rounded again, then multiplied by the
weight, so bf16 results match the unfused ops bit for bit up to ``rsqrt``'s last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
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
    out = h.to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """``x`` ``[T, hidden]`` (rows may be strided, columns contiguous). With ``residual``
    (same shape, contiguous columns) the sum ``x + residual`` is written into ``residual`` in
    place and ``(out, residual)`` is returned; otherwise ``out``."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs contiguous rows")
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = residual.view(-1, x.shape[-1]) if residual is not None else x2
    hidden = x2.shape[1]
    block = triton.next_power_of_2(hidden)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, residual)
