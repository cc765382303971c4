"""SwiGLU over a fused gate/up projection: ``silu(x[:, :I]) * x[:, I:]`` in one pass.

silu is evaluated in float32 and rounded to the activation dtype before the product, as
``F.silu(gate) * up`` does in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, 2I]`` with contiguous columns -> ``[T, I]``."""
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs contiguous rows")
    x2 = x.reshape(-1, x.shape[-1])
    inter = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(_BLOCK, triton.next_power_of_2(inter))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], inter)
