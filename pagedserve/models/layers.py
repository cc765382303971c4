"""Building blocks shared by the decoder models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: its weight is an offset from one, ``x * (1 + weight)``, multiplied in
    float32 before the cast back (Llama's casts first), as transformers computes it. Plain
    torch ops: the platforms' fused norms compute Llama's."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                into: Linear | None = None):
        """As ``RMSNorm.forward``; ``into`` is ignored (the next layer quantizes, if it does)."""
        if residual is not None:
            x = residual = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


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


class GeluAndMul(nn.Module):
    """GeGLU on a fused gate/up projection: gelu(gate) * up, gelu in its tanh approximation
    (transformers' ``gelu_pytorch_tanh``)."""

    def forward(self, x: torch.Tensor, into: Linear | None = None) -> torch.Tensor:
        """``into`` is ignored (the next layer quantizes, if it does)."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class PagedAttention(nn.Module):
    """Runs the platform's attention backend against this layer's slice of the KV cache, with
    the layer's sliding window and score cap (``AttentionBackend``; None: none)."""

    def __init__(self, backend: AttentionBackend, window: int | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.window, self.softcap = window, softcap

    def forward(self, q, k, v, kv_cache: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache, ctx.attn, self.window, self.softcap)
