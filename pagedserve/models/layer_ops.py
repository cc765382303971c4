"""The elementwise and normalisation ops of a decoder layer, in plain torch.

This is the portable implementation and the numerical reference: RMSNorm in float32 as the
Hugging Face models compute it, SwiGLU, and neox-style rotary embeddings. A platform with fused
kernels subclasses ``LayerOps`` and overrides the methods (``Platform.layer_ops``); each of
these plain versions launches several kernels, which on a GPU costs more than the matmuls at
small batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerOps:
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """``weight * normalise(x)``; with ``residual``, ``x + residual`` is normalised and also
        returned as the next residual: ``(out, x + residual)``. An override may write that
        sum into ``residual`` in place."""
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """SwiGLU on a fused gate/up projection ``[T, 2I]``: ``silu(gate) * up``, ``[T, I]``."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[T, H, D]`` and k ``[T, Hkv, D]`` by each row's position ("rotate half"
        layout); ``cos``/``sin`` are float32 ``[max_positions, D/2]`` tables. An override may
        rotate q and k in place."""
        cos = cos[positions][:, None, :]
        sin = sin[positions][:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
