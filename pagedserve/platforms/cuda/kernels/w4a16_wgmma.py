"""W4A16 on Hopper's warpgroup MMA: ``csrc/w4a16_wgmma.cu`` (its comments describe the operand
orders), built at first use by the machine's ``nvcc`` for ``sm_90a`` and called through ctypes
on torch's current stream, so CUDA graphs capture it. It is the path for many rows (large
decode batches and prefill), where the other kernels either decode each weight too often per
row (the Triton tiles) or write and read a dense copy of the weight (dequantize + cuBLAS). It
reads the layout ``kernels.w4a16.pack`` writes and takes what ``w4a16_mma.eligible`` takes, on
sm_90 only.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedserve.platforms.cuda import native_build
from pagedserve.platforms.cuda.kernels import w4a16_mma
from pagedserve.platforms.cuda.kernels.device import sm_count

if TYPE_CHECKING:
    from pagedserve.platforms.cuda.kernels.w4a16 import PackedW4

SOURCE = native_build.CSRC / "w4a16_wgmma.cu"
CAPABILITY = (9, 0)
BLOCK_ROWS = (64, 128, 256)
BLOCK_N = 128  # output features per block: two warpgroups of 64


@functools.cache
def library(sweep: bool = False) -> ctypes.CDLL | None:
    """The built kernel, or None (no ``nvcc``, a failed build). ``sweep`` also compiles the
    variants ``scripts/bench_w4a16.py`` times."""
    lib = native_build.load_library(SOURCE, CAPABILITY, ("W4A16_WGMMA_SWEEP",) if sweep else (),
                                    arch_specific=True)
    if lib is not None:
        lib.w4a16_wgmma.argtypes = [ctypes.POINTER(w4a16_mma.Args), ctypes.c_void_p]
        lib.w4a16_wgmma.restype = ctypes.c_int
        lib.w4a16_wgmma_variants.argtypes = []
        lib.w4a16_wgmma_variants.restype = ctypes.c_int
    return lib


def eligible(x: torch.Tensor, w: PackedW4) -> bool:
    """``w4a16_mma.eligible`` on an sm_90 GPU (the library aside)."""
    return (w4a16_mma.eligible(x, w)
            and torch.cuda.get_device_capability(x.device) == CAPABILITY)


def usable(x: torch.Tensor, w: PackedW4) -> bool:
    """``eligible`` and the library built."""
    return eligible(x, w) and library() is not None


def block_rows(m: int, n: int, tiles: int, sms: int) -> int:
    """Rows of x per block for M rows, N features and K's ``tiles`` on ``sms``
    multiprocessors. From the H200 sweep (2026-12-05, the 8B layers at 64-512 rows): 64 up to
    64 rows, and up to 128 where blocks of 128 would not fill the GPU (qkv at 128 rows: 28
    against 41 us, down 58 against 67); 256 from 256 rows where its blocks do (gate_up at 256:
    125 against 144 us; where they do not, 256 was the slowest: qkv 79 against 36). Past 128
    rows, 64 where blocks of 64 fill the GPU at most once and K is short
    (``SHORT_K_TILES``): blocks of 128 would split so short a K that each split's fixed cost
    shows (o at 256 rows: 28 against 42 us on the H200, 27 against 40 on an H100; down, whose
    K is 3.5 times as long, keeps 128: 84 against 91). Else 128."""
    features = -(-n // BLOCK_N)
    if m <= 64 or (m <= 128 and features < sms):
        return 64
    if m >= 256 and -(-m // 256) * features >= sms:
        return 256
    if -(-m // 64) * features <= sms and tiles <= SHORT_K_TILES:
        return 64
    return 128


# K's tiles (of 128 columns) up to which a K counts as short for ``block_rows``.
SHORT_K_TILES = 32


class Plan(NamedTuple):
    tiles_per_split: int
    splits: int


def plan(m: int, n: int, tiles: int, rows: int, sms: int, counters: int,
         split_k: int | None = None) -> Plan:
    """K's ``tiles`` in ``split_k`` splits, or by default in as many as fill the GPU's ``sms``
    once (a block holds a multiprocessor: its stages take most of the shared memory) where the
    blocks of the output are fewer; only where they have ``counters``. No split is empty."""
    blocks = -(-m // rows) * -(-n // BLOCK_N)
    if split_k is None:
        split_k = max(sms // blocks, 1)
    if blocks > counters:
        split_k = 1
    per_split = -(-tiles // min(max(split_k, 1), tiles))
    return Plan(per_split, -(-tiles // per_split))


def matmul(x: torch.Tensor, w: PackedW4, out: torch.Tensor, rows: int | None = None,
           variant: int = 0, split_k: int | None = None) -> torch.Tensor:
    """``out = x @ W^T`` for ``eligible`` operands; ``rows`` (one of ``BLOCK_ROWS``) overrides
    ``block_rows``, ``variant`` picks a compiled number of stages of the sweep build and
    ``split_k`` the splits of K (``plan``)."""
    if out.stride(1) != 1 or out.stride(0) % 2 or out.data_ptr() % 4:
        # The kernel stores two outputs at once.
        return out.copy_(matmul(x, w, torch.empty_like(out, memory_format=torch.contiguous_format),
                                rows, variant, split_k))
    m = x.shape[0]
    n = w.qweight.shape[1]
    sms = sm_count(x.device)
    tiles = w.qweight.shape[0] // 16
    rows = rows or block_rows(m, n, tiles, sms)
    if rows not in BLOCK_ROWS:
        raise ValueError(f"rows per block: one of {BLOCK_ROWS}, not {rows}")
    per_split, splits = plan(m, n, tiles, rows, sms, w.counters.numel(), split_k)
    partial = torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32,
                          device=x.device)
    lib = library(variant != 0)
    args = w4a16_mma.launch_args(x, w, out, partial, per_split, splits, variant, rows)
    err = lib.w4a16_wgmma(ctypes.byref(args), torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"w4a16_wgmma launch failed: CUDA error {err}")
    return out
