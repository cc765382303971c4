"""Fused Triton versions of a decoder layer's elementwise ops: one kernel each for RMSNorm
(with the residual add), SwiGLU and rotary embeddings, where torch launches five to ten."""

from __future__ import annotations

from pagedserve.models.layer_ops import LayerOps
from pagedserve.platforms.cuda.kernels.activation import silu_and_mul
from pagedserve.platforms.cuda.kernels.rms_norm import rms_norm
from pagedserve.platforms.cuda.kernels.rotary import rotary_embedding


class TritonLayerOps(LayerOps):
    rms_norm = staticmethod(rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    rotary = staticmethod(rotary_embedding)
