"""Grouped-quantized linear layers on the CPU through a small C kernel built at first use.

torch's CPU int4/int8 matmuls read quantized weights at a fraction of memory bandwidth on AVX2
machines, so decoding gains little from quantizing. ``csrc/quant_gemm.c`` (its header
describes the packed layout) is built by ``native_build`` at first use and called through
ctypes with tensor data pointers. When no compiler works, ``available()`` says so and callers
keep torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.platforms.cpu import native_build

SOURCE = native_build.CSRC / "quant_gemm.c"
LANES = 8  # rows per block: one per float32 lane of an AVX2 vector
KSTEP = 8  # every group is padded to a multiple of this many columns (one packed chunk)
# With float32 activations: up to this many rows of x the GEMV reads the packed weight once for
# all of them; above, float32 tiles dequantized for torch.mm (MKL) are faster. The int8 kernel
# beats both at every m where it runs (scripts/bench_cpu_int8_gemm.py measures all three).
GEMV_MAX_ROWS = 24
KERNELS = ("gemv", "int8", "dequant")
# Rows of W dequantized per torch.mm call: tiles stay in the L2/L3 caches.
DEQUANT_TILE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class NativeQuantWeight:
    """W [n, k] in the kernel's packed layout: ``qweight`` holds 8-row blocks of values,
    ``scales`` and ``offsets`` are float32 [n_blocks, n_groups, 8]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bits: int
    group_size: int
    n: int
    k: int

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, "offsets": self.offsets}


def available() -> bool:
    """Whether the kernel library builds (or is cached) and loads; logs once if not."""
    return _library() is not None


def library_path(source: bytes | None = None) -> Path:
    """Where the library built from ``source`` (default: the shipped C file) is cached."""
    return native_build.library_path(SOURCE, source)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native_build.load_library(SOURCE)
    return None if lib is None else declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (built from ``SOURCE`` or a variant of it) with its functions' C types set."""
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.pq_matmul.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32, ptr, i32, ptr, i32]
    lib.pq_matmul.restype = i32
    lib.pq_dequant_t.argtypes = [ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, ptr, i32]
    lib.pq_dequant_t.restype = None
    lib.pq_matmul_i8.argtypes = lib.pq_matmul.argtypes
    lib.pq_matmul_i8.restype = i32
    lib.pq_i8_bits_mask.argtypes = []
    lib.pq_i8_bits_mask.restype = i32
    return lib


def int8_supported(bits: int) -> bool:
    """Whether the int8-activation kernel takes ``bits``-bit weights on this CPU (AVX2
    without VNNI: 4 bits only, see quant_gemm.c)."""
    lib = _library()
    return lib is not None and bool(lib.pq_i8_bits_mask() & bits)


def pack(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
         group_size: int) -> NativeQuantWeight:
    """Rearrange W = values * scales + offsets (per group of ``group_size`` columns) into the
    kernel's layout: rows padded to 8-row blocks, each group padded to a multiple of 8
    columns, each block a run of 8-column chunks whose int32 lane r holds row r (4-bit:
    columns j and 4 + j in the low and high nibble of byte j; 8-bit: columns 0-3 in the
    first 32 bytes, 4-7 in the next)."""
    n, k = values.shape
    n_groups = -(-k // group_size)
    if bits not in (4, 8):
        raise ValueError(f"native quant kernels take bits 4 or 8, not {bits}")
    if values.dtype != torch.uint8 or scales.shape != (n, n_groups) \
            or offsets.shape != (n, n_groups):
        raise ValueError(f"expected uint8 values [n, k] and float32 scales/offsets "
                         f"[n, {n_groups}]; got {values.dtype} {tuple(values.shape)}, "
                         f"{tuple(scales.shape)}, {tuple(offsets.shape)}")
    blocks = -(-n // LANES)
    padded = torch.zeros(blocks * LANES, _padded_k(k, group_size), dtype=torch.uint8)
    padded[:n, _padded_columns(k, group_size)] = values
    # [block, row, chunk, half (columns 0-3 / 4-7), column in half]
    chunks = padded.view(blocks, LANES, -1, 2, KSTEP // 2)
    if bits == 4:
        chunks = chunks[:, :, :, :1] | (chunks[:, :, :, 1:] << 4)
    qweight = chunks.permute(0, 2, 3, 1, 4).contiguous()
    return NativeQuantWeight(qweight, _blocked(scales, blocks), _blocked(offsets, blocks),
                             bits, group_size, n, k)


def _padded_k(k: int, group_size: int) -> int:
    stride = -(-group_size // KSTEP) * KSTEP
    last = k - (-(-k // group_size) - 1) * group_size
    return (k - last) // group_size * stride + -(-last // KSTEP) * KSTEP


def _padded_columns(k: int, group_size: int) -> torch.Tensor:
    col = torch.arange(k)
    return col // group_size * (-(-group_size // KSTEP) * KSTEP) + col % group_size


def _blocked(meta: torch.Tensor, blocks: int) -> torch.Tensor:
    out = torch.zeros(blocks * LANES, meta.shape[1], dtype=torch.float32)
    out[:meta.shape[0]] = meta
    return out.view(blocks, LANES, -1).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, w: NativeQuantWeight, int8: bool = True) -> torch.Tensor:
    """float32 x [m, k] @ W^T -> float32 [m, n], by the kernel ``kernel_for`` picks."""
    return run(kernel_for(x.shape[0], w, int8), x, w)


def kernel_for(m: int, w: NativeQuantWeight, int8: bool = True) -> str:
    """The fastest kernel for m rows of x: the int8 one wherever it takes w's bits (it
    measured faster at every m, 1 to 512), else the float32 GEMV up to GEMV_MAX_ROWS rows and
    dequantized tiles above. ``int8=False`` keeps the activations float32."""
    if int8 and int8_supported(w.bits):
        return "int8"
    return "gemv" if m <= GEMV_MAX_ROWS else "dequant"


def run(kernel: str, x: torch.Tensor, w: NativeQuantWeight) -> torch.Tensor:
    """float32 x [m, k] @ W^T through one of ``KERNELS``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown native quant kernel {kernel!r}; expected one of {KERNELS}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"expected float32 x [m, {w.k}], got {x.dtype} {tuple(x.shape)}")
    lib = _library()
    if lib is None:
        raise RuntimeError("native CPU quant kernels are unavailable (see the log)")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.n, dtype=torch.float32)
    if kernel == "dequant":
        return _dequant_mm(lib, x, w, y)
    if kernel == "int8" and not int8_supported(w.bits):
        raise ValueError(f"the int8 kernel does not take {w.bits}-bit weights on this CPU")
    fn = {"gemv": lib.pq_matmul, "int8": lib.pq_matmul_i8}[kernel]
    if m and fn(*_weight_args(w), x.data_ptr(), m, y.data_ptr(), torch.get_num_threads()):
        raise MemoryError("native quant matmul could not allocate its scratch buffer")
    return y


def _weight_args(w: NativeQuantWeight) -> tuple:
    return (w.qweight.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(), w.n, w.k, w.bits,
            w.group_size)


def _dequant_mm(lib: ctypes.CDLL, x: torch.Tensor, w: NativeQuantWeight,
                y: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T, W^T dequantized a tile of columns at a time into a reused float32 buffer
    small enough to stay in cache for torch.mm."""
    cols = max(LANES, DEQUANT_TILE_BYTES // (4 * w.k) // LANES * LANES)
    buffer = torch.empty(w.k * min(cols, w.n), dtype=torch.float32)
    threads = torch.get_num_threads()
    for n0 in range(0, w.n, cols):
        n1 = min(n0 + cols, w.n)
        tile = buffer[:w.k * (n1 - n0)].view(w.k, n1 - n0)
        lib.pq_dequant_t(*_weight_args(w), n0, n1, tile.data_ptr(), threads)
        # y[:, n0:n1] has row stride n and unit column stride, which BLAS writes in place.
        torch.mm(x, tile, out=y[:, n0:n1])
    return y
