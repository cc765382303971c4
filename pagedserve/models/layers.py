"""Building blocks shared by the decoder models."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.backend import AttentionBackend
from pagedserve.models.forward_context import ForwardContext
from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: type[LayerOps]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                into: Linear | None = None):
        """Normalise ``x`` (after adding ``residual``, if given, whose sum is also returned as
        the next residual) in float32, as the reference models do. ``into``: the linear layer
        that takes the output, which it may then get already quantized."""
        quantizer = into.input_quantizer(x.shape[0]) if into is not None else None
        if quantizer is not None:
            return quantizer.rms_norm(x, self.weight, self.eps, residual)
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class SiluAndMul(nn.Module):
    """SwiGLU on a fused gate/up projection: silu(gate) * up."""

    def __init__(self, ops: type[LayerOps]) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor, into: Linear | None = None):
        """``into``: the linear layer that takes the output, which it may then get already
        quantized (``QuantizedActivation``)."""
        quantizer = into.input_quantizer(x.shape[0]) if into is not None else None
        if quantizer is not None:
            return quantizer.silu_and_mul(x)
        return self.ops.silu_and_mul(x)


class PagedAttention(nn.Module):
    """Runs the platform's attention backend against this layer's slice of the KV cache."""

    def __init__(self, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend

    def forward(self, q, k, v, kv_cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache, ctx.attn)
