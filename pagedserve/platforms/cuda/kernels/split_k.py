"""Split K for the few-row W4A16 kernels (the GEMV and the tiles).

A decode step's weights are read by few output blocks, so K is cut into slices that stream
the weight side by side. Each slice leaves its float32 partial sum; the last slice of an
output block to finish (counted by an atomic per block, kept with the weight and reset by that
slice) adds them in slice order and stores the result: deterministic, and one launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def finish(acc, out_ptr, partial_ptr, counter_ptr, offs_m, offs_n, mask_m, mask_n,
           M, N, stride_om, pid_n, pid_s, num_splits, SPLIT: tl.constexpr, CHUNK: tl.constexpr):
    """Store a ``[BLOCK_M, BLOCK_N]`` float32 result, or with split K, this slice's share
    (``partial_ptr`` holds ``[num_splits, M, N]``; ``counter_ptr + pid_n`` counts the output
    block's slices). The last slice reads the partial sums ``CHUNK`` slices at a time: read one
    at a time, their latencies added up to more than a small weight's own reading time."""
    mask_out = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT:
        tile = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(partial_ptr + pid_s.to(tl.int64) * M * N + tile, acc, mask=mask_out)
        # Every thread's stores before the one thread's atomic (whose release then covers
        # them); the partial sums are read past L1, which may hold a previous call's.
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            total = tl.zeros_like(acc)
            for first in range(0, num_splits, CHUNK):
                slices = first + tl.arange(0, CHUNK)
                parts = tl.load(partial_ptr + slices[:, None, None].to(tl.int64) * M * N
                                + tile[None, :, :],
                                mask=(slices < num_splits)[:, None, None] & mask_out[None, :, :],
                                other=0.0, cache_modifier=".cg")
                total += tl.sum(parts, axis=0)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask_out)
            tl.atomic_xchg(counter_ptr + pid_n, 0)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


def split_count(programs: int, k_blocks: int, target: int, min_blocks: int) -> int:
    """Slices of K so that about ``target`` programs stream the weight, each slice at least
    ``min_blocks`` blocks of K long."""
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), k_blocks // min_blocks))
