"""RMSNorm, SwiGLU and rotary embeddings in one C call each for float32 activations.

At batch 1 a decoder layer's elementwise ops cost more in torch's per-op overhead than in
arithmetic; ``csrc/layer_ops.c`` (built by ``native_build``) does each in one pass. Other
dtypes, and layouts the kernels do not read (a strided last dimension), fall back to the
portable ``LayerOps``. The attention kernels of the same library (decode and prefill) are
wired in ``attention.py``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedserve.models.layer_ops import LayerOps
from pagedserve.platforms.cpu import native_build

SOURCE = native_build.CSRC / "layer_ops.c"
F32 = torch.float32


def available() -> bool:
    """Whether the library builds (or is cached) and loads; logs once if not."""
    return library() is not None


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = native_build.load_library(SOURCE)
    return None if lib is None else declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (built from ``SOURCE`` or a variant of it) with its functions' C types set."""
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    signatures = {
        "lo_rms_norm": [p, i64, p, i64, p, f32, p, i64, i32, i32, i32],
        "lo_silu_and_mul": [p, i64, p, i64, i32, i32, i32],
        "lo_rotary": [p, p, i64, i64, i32, p, i64, i64, i32, p, p, i32, i32, i32],
        "lo_paged_decode": [p, i64, i64, p, i64, i64, p, i64, i64, p, i32, i64, p, p, i64,
                            p, p, i32, i32, i32, i32, i32, f32, i32, f32, p, i32],
        "lo_paged_prefill": [p, i64, i64, p, i64, i64, p, i64, i64, p, i32, i64, p, p, i64,
                             p, p, i32, p, i32, i32, i32, i32, i32, f32, i32, f32, p, i32],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None
    return lib


def _rows(t: torch.Tensor) -> bool:
    """A float32 [rows, n] tensor whose rows are contiguous."""
    return t.dtype == F32 and t.dim() == 2 and t.stride(1) == 1


class CpuLayerOps(LayerOps):
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """As ``LayerOps.rms_norm``; with ``residual`` the sum is written into it in place."""
        if not (_rows(x) and weight.dtype == F32 and weight.is_contiguous()
                and (residual is None or (_rows(residual) and residual.shape == x.shape))):
            return LayerOps.rms_norm(x, weight, eps, residual)
        out = torch.empty(x.shape, dtype=F32)
        if x.shape[0]:
            library().lo_rms_norm(
                x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                0 if residual is None else residual.stride(0), weight.data_ptr(), eps,
                out.data_ptr(), out.stride(0), x.shape[0], x.shape[1],
                torch.get_num_threads())
        return out if residual is None else (out, residual)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        if not (_rows(x) and x.shape[1] % 2 == 0):
            return LayerOps.silu_and_mul(x)
        inter = x.shape[1] // 2
        out = torch.empty(x.shape[0], inter, dtype=F32)
        if x.shape[0]:
            library().lo_silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), inter,
                                      x.shape[0], inter, torch.get_num_threads())
        return out

    @staticmethod
    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LayerOps.rotary``, rotating q and k in place. Positions are not bounds-checked:
        they must index the tables, as the engine's always do."""
        if not (q.dtype == F32 and k.dtype == F32 and q.stride(2) == 1 and k.stride(2) == 1
                and positions.dtype == torch.int64 and positions.is_contiguous()
                and cos.dtype == F32 and sin.dtype == F32 and cos.is_contiguous()
                and sin.is_contiguous()):
            return LayerOps.rotary(positions, q, k, cos, sin)
        if q.shape[0]:
            library().lo_rotary(
                positions.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), q.shape[1],
                k.data_ptr(), k.stride(0), k.stride(1), k.shape[1], cos.data_ptr(),
                sin.data_ptr(), q.shape[0], q.shape[2], torch.get_num_threads())
        return q, k
