"""Write a step's new keys and values into the paged KV cache.

Inputs (``N`` new tokens, ``KVH`` kv heads, ``D`` head size):

- ``key`` / ``value``: ``[N, KVH, D]``, any strides (views of a fused qkv projection work).
- ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, KVH, D]`` sharing strides.
- ``slot_mapping``: int64 ``[N]``; token ``t`` goes to block ``slot // block_size``, offset
  ``slot % block_size``. A negative slot skips the token (padding rows, e.g. under CUDA graphs).

An fp8 (float8_e4m3fn) cache stores ``clamp(x / scale, -448, 448)`` rounded to nearest even,
with ``k_scale`` / ``v_scale`` one-element float32 tensors; readers multiply by the scale back.
Other caches store ``x`` cast to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.platforms.cuda.kernels.pdl import gate, launch_options

FP8_E4M3_MAX = tl.constexpr(448.0)
# Elements one program copies per tensor: a whole token for common shapes.
_MAX_TILE = 4096


@triton.jit
def _round_to_e4m3(x):
    """``x`` (float32, ``|x| <= 448``) rounded to the nearest-even e4m3 value, still float32.

    The cast to fp8 that follows is then exact on every backend. Casting directly is right on
    GPUs, but Triton's interpreter rounds ties away and drops the carry when the mantissa
    overflows (31.1 -> 16; triton-lang/triton#8322), which would leave the CPU tests blind.
    """
    bits = x.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of fp32's 23 mantissa bits; a carry runs on into the exponent.
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -0x100000).to(tl.float32, bitcast=True)
    # Below 2**-6 e4m3 is subnormal with a fixed step of 2**-9: adding 1.5 * 2**14 puts x in a
    # binade whose fp32 step is 2**-9, so the add itself rounds to nearest even. On |x| so the
    # sign survives even when the result is zero.
    subnormal = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = tl.where(bits < 0, -subnormal, subnormal)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _store_token(
    src_ptr, dst_ptr, scale_ptr, mask,
    HAS_SCALES: tl.constexpr,
):
    x = tl.load(src_ptr, mask=mask, other=0.0)
    if HAS_SCALES:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.clamp(x, -FP8_E4M3_MAX, FP8_E4M3_MAX)  # e4m3fn has no inf: saturate, not NaN
        x = _round_to_e4m3(x)
    tl.store(dst_ptr, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_SCALES: tl.constexpr, PDL: tl.constexpr,
):
    gate(PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_SIZE)[None, :]
    cache_off = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
                 + heads[:, None] * stride_ch + offs_d[None, :] * stride_cd)
    tok64 = tok.to(tl.int64)
    k_src = key_ptr + tok64 * stride_kt + heads[:, None] * stride_kh + offs_d[None, :] * stride_kd
    v_src = (value_ptr + tok64 * stride_vt + heads[:, None] * stride_vh
             + offs_d[None, :] * stride_vd)
    _store_token(k_src, k_cache_ptr + cache_off, k_scale_ptr, mask, HAS_SCALES)
    _store_token(v_src, v_cache_ptr + cache_off, v_scale_ptr, mask, HAS_SCALES)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter ``key``/``value`` rows into the cache in place; layouts in the module docstring."""
    if key_cache.stride() != value_cache.stride() or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must share dtype and strides")
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    has_scales = key_cache.dtype == torch.float8_e4m3fn
    if has_scales and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    head_pad = triton.next_power_of_2(head_size)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // head_pad))
    scales = (k_scale, v_scale) if has_scales else (slot_mapping, slot_mapping)
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key, value, key_cache, value_cache, slot_mapping, *scales,
        *key.stride(), *value.stride(), *key_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        BLOCK_H=block_h, HEAD_PAD=head_pad, BLOCK_SIZE=key_cache.shape[1],
        HAS_SCALES=has_scales,
        num_warps=4, **launch_options(key.device),
    )
