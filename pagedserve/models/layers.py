"""Building blocks shared by the decoder models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise ``x`` (after adding ``residual``, if given, whose sum is also returned as
        the next residual) in float32, as the reference models do."""
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(nn.Module):
    """SwiGLU on a fused gate/up projection: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class PagedAttention(nn.Module):
    """Runs the platform's attention backend against this layer's slice of the KV cache."""

    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache, meta)
