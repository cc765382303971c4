"""Rotary position embeddings ("rotate half" / neox layout) applied to q and k in place.

One program per token rotates all its query and key heads with the cos/sin row of its
position, in float32, so q and k can stay strided views of the fused qkv projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options


@triton.jit
def _rotate_heads(base_ptr, stride_h, cos, sin, offs_d, d_mask,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < NUM_HEADS)[:, None] & d_mask[None, :]
    first = base_ptr + heads[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = base_ptr.dtype.element_ty
    tl.store(first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, PDL: tl.constexpr,
):
    gate(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + pos * stride_table + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + offs_d, mask=d_mask, other=0.0)[None, :]
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, cos, sin, offs_d, d_mask,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF)
    _rotate_heads(k_ptr + tok * stride_kt, stride_kh, cos, sin, offs_d, d_mask,
                  NUM_K_HEADS, K_HEADS_PAD, HALF)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, H, D]`` and k ``[T, Hkv, D]`` (head dim contiguous, other strides free)
    in place and return them. ``cos``/``sin``: contiguous float32 ``[max_positions, D/2]``."""
    num_tokens, num_q_heads, head_dim = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rotary_embedding needs a contiguous head dimension")
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1],
            Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
            K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
            HALF=half, HALF_PAD=triton.next_power_of_2(half),
            num_warps=4, **launch_options(q.device),
        )
    return q, k
