"""W4A16 on NVIDIA's tensor cores: ``csrc/w4a16_mma.cu`` (its comments describe the fragment
orders), built at first use by the machine's ``nvcc`` and called through ctypes on torch's
current stream, so CUDA graphs capture it. Two kernels: one for up to ``FEW_ROWS`` rows that
stages a split's x once, and one for blocks of 16 to 64 rows (any M) that streams x with the
weights; ``block_rows`` picks. It reads the layout ``kernels.w4a16.pack`` writes, so the same
packed weight serves it, the Triton paths (wherever this kernel is not built: no ``nvcc``,
ROCm, before sm_80) and the dequantize path. It takes integer zero points (AWQ, GPTQ) with
float16 scales and groups of a power of two from 32 or one group, N a multiple of 32 and K
of 8.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedserve.platforms.cuda import native_build
from pagedserve.platforms.cuda.kernels.device import sm_count
from pagedserve.platforms.cuda.kernels.pdl import launch_options

if TYPE_CHECKING:
    from pagedserve.platforms.cuda.kernels.w4a16 import PackedW4

SOURCE = native_build.CSRC / "w4a16_mma.cu"
FEW_ROWS = 16
# Both kernels' blocks are 128 output features (4 warps of 32) by the columns of one split of K.
# The few-rows kernel stages its rows of x (up to 8, or 16 from 9 rows) in shared memory, a
# row of them 32 elements longer than the split, beside the weights' cp.async stages. The
# staged x is kept within X_BYTES, which bounds a split's tiles of 128 columns, so that
# several blocks fit in a multiprocessor.
BLOCK_N = 128
_TILE_K = 128
X_BYTES = 32 * 1024
_ROW_PAD = 32
# Splits of K aim at this many blocks per multiprocessor: enough weight loads in flight
# (4 beat 1 and 2 at every M in the sweep of 2026-12-01, scripts/bench_w4a16.py --sweep-mma).
PROGRAMS_PER_SM = 4
# The many-rows kernel's: each split leaves M x N float32 partial sums to write and read back,
# and one block per multiprocessor beat 2 and 4 at 16, 64 and 128 rows in the sweep of
# 2026-12-02 (M = 16: 86 us for the four 8B layers against 92 and 106).
MANY_ROWS_PROGRAMS_PER_SM = 1
# The rows per block for M up to each bound (None: any M): 0 for the few-rows kernel, else
# the many-rows kernel's 16, 32 or 64. The sweeps of 2026-12-02 (scripts/bench_w4a16.py
# --sweep-mma): the few-rows kernel to 7 rows; blocks of 16 from 8 rows (M = 8: 80 us for
# the four 8B layers against 88 for the few-rows kernel, once rows past M were zero-filled
# instead of read: 107 before), and at 16 (86 against 119); of 32 at 32 (121 against 128 for
# 16); of 64 from 65 (M = 128: 277 against 282 for 32, M = 256: 439 against 494).
BLOCK_ROWS = ((7, 0), (16, 16), (32, 32), (64, 32), (None, 64))


ARGS_HEADER = native_build.CSRC / "w4a16_args.h"


class Args(ctypes.Structure):
    """``W4A16MmaArgs`` of ``csrc/w4a16_args.h`` (this library's and the wgmma kernel's), field
    for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("x", "qweight", "scales", "zeros", "out", "partial", "counters")] + [
                (name, ctypes.c_int) for name in
                ("m", "n", "k", "x_stride", "out_stride", "group_shift", "scale_rows", "tiles",
                 "tiles_per_split", "splits", "bf16", "variant", "device", "block_rows",
                 "pdl")]


@functools.cache
def library(capability: tuple[int, int], sweep: bool = False) -> ctypes.CDLL | None:
    """The built kernels for GPUs of ``capability``, or None (no ``nvcc``, a failed build).
    ``sweep`` also compiles the variants ``scripts/bench_w4a16.py`` times."""
    lib = native_build.load_library(SOURCE, capability, ("W4A16_MMA_SWEEP",) if sweep else ())
    if lib is not None:
        lib.w4a16_mma.argtypes = [ctypes.POINTER(Args), ctypes.c_void_p]
        lib.w4a16_mma.restype = ctypes.c_int
        lib.w4a16_mma_variants.argtypes = []
        lib.w4a16_mma_variants.restype = ctypes.c_int
    return lib


def eligible(x: torch.Tensor, w: PackedW4) -> bool:
    """Whether the kernel takes these operands on an NVIDIA GPU of sm_80 or later (the
    library aside): 16-bit x of up to ``MAX_M`` aligned rows, zero points, float16 scales,
    groups of a power of two from 32 (or one), N a multiple of 32, K of 8."""
    m, k = x.shape
    n = w.qweight.shape[1]
    return (x.device.type == "cuda" and torch.version.hip is None
            and x.dtype in (torch.bfloat16, torch.float16) and m >= 1
            and w.zero_point and w.scales.dtype == torch.float16
            and (w.scales.shape[0] == 1 or _power_of_two(w.group_size) and w.group_size >= 32)
            and n % 32 == 0 and k % 8 == 0 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def group_shift(w: PackedW4) -> int:
    """The kernels' ``group_shift``: log2 of the group size, 31 for one group."""
    return 31 if w.scales.shape[0] == 1 else w.group_size.bit_length() - 1


def _power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def usable(x: torch.Tensor, w: PackedW4) -> bool:
    """``eligible`` and the library built."""
    return eligible(x, w) and library(torch.cuda.get_device_capability(x.device)) is not None


class Plan(NamedTuple):
    block_rows: int  # 0: the few-rows kernel; else the many-rows kernel's rows per block
    tiles_per_split: int
    splits: int


def block_rows(m: int) -> int:
    return next(rows for bound, rows in BLOCK_ROWS if bound is None or m <= bound)


def plan(m: int, n: int, tiles: int, sms: int, counters: int, split_k: int | None = None,
         rows: int | None = None) -> Plan:
    """How to run M rows (``rows``: a block's rows, else ``block_rows(m)``) over K's
    ``tiles``: ``split_k`` splits, or enough for the kernel's blocks per multiprocessor;
    the few-rows kernel's x within ``X_BYTES`` a split, and the many-rows kernel split only
    where its blocks of the output have ``counters``."""
    rows = block_rows(m) if rows is None else rows
    if rows == 0 and m > FEW_ROWS:
        raise ValueError(f"the few-rows kernel takes up to {FEW_ROWS} rows, not {m}")
    columns = -(-n // BLOCK_N)
    if rows == 0:
        max_tiles = (X_BYTES // (2 * min(m, 8 if m <= 8 else 16)) - _ROW_PAD) // _TILE_K
        blocks, per_sm = columns, PROGRAMS_PER_SM
    else:
        max_tiles = tiles
        blocks, per_sm = columns * -(-m // rows), MANY_ROWS_PROGRAMS_PER_SM
        if blocks > counters:
            split_k = 1
    splits = min(max(split_k or -(-per_sm * sms // blocks), 1), tiles)
    per_split = min(tiles // splits, max_tiles)  # rounded down: at least ``splits`` splits
    return Plan(rows, per_split, -(-tiles // per_split))


def launch_args(x: torch.Tensor, w: PackedW4, out: torch.Tensor, partial: torch.Tensor,
                per_split: int, splits: int, variant: int, rows: int) -> Args:
    """Both libraries' arguments for ``out = x @ W^T`` in ``splits`` splits of ``per_split``
    tiles (``partial``: their sums where ``splits > 1``)."""
    (m, k), n = x.shape, w.qweight.shape[1]
    return Args(x.data_ptr(), w.qweight.data_ptr(), w.scales.data_ptr(), w.shifts.data_ptr(),
                out.data_ptr(), partial.data_ptr(), w.counters.data_ptr(),
                m, n, k, x.stride(0), out.stride(0), group_shift(w), w.scales.shape[0],
                w.qweight.shape[0] // 16, per_split, splits, x.dtype == torch.bfloat16, variant,
                x.device.index or 0, rows, launch_options(x.device)["PDL"])


def matmul(x: torch.Tensor, w: PackedW4, out: torch.Tensor, split_k: int | None = None,
           variant: int = 0, rows: int | None = None) -> torch.Tensor:
    """``out = x @ W^T`` for ``eligible`` operands (``out`` contiguous ``[M, N]``); ``variant``
    picks a compiled number of stages of the sweep build, ``rows`` the kernel and its block
    (``Plan.block_rows``; the few-rows kernel takes up to ``FEW_ROWS``)."""
    if out.stride(0) % 4 or out.stride(1) != 1 or out.data_ptr() % 8:
        # The kernel stores four outputs at once.
        return out.copy_(matmul(x, w, torch.empty_like(out, memory_format=torch.contiguous_format),
                                split_k, variant, rows))
    m = x.shape[0]
    n = w.qweight.shape[1]
    tiles = w.qweight.shape[0] // 16
    rows, per_split, splits = plan(m, n, tiles, sm_count(x.device), w.counters.numel(), split_k,
                                   rows)
    partial = torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32,
                          device=x.device)
    lib = library(torch.cuda.get_device_capability(x.device), variant != 0)
    args = launch_args(x, w, out, partial, per_split, splits, variant, rows)
    err = lib.w4a16_mma(ctypes.byref(args), torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"w4a16_mma launch failed: CUDA error {err}")
    return out
