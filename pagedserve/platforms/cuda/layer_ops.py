"""Fused Triton versions of a decoder layer's ops: one kernel each for RMSNorm (with the
residual add), SwiGLU and rotary embeddings, where torch launches five to ten, and the experts
of a mixture-of-experts layer as two grouped GEMMs that read the routing on the device (no
host sync, so MoE decode steps run in CUDA graphs), FP8 and 4- or 8-bit integer experts read by
the same kernel as they are stored (W8A16, W4A16)."""

from __future__ import annotations

from typing import ClassVar

from pagedserve.models.layer_ops import LayerOps
from pagedserve.platforms.cuda.kernels.activation import silu_and_mul
from pagedserve.platforms.cuda.kernels.fused_moe import fused_moe
from pagedserve.platforms.cuda.kernels.rms_norm import rms_norm
from pagedserve.platforms.cuda.kernels.rotary import rotary_embedding


class TritonLayerOps(LayerOps):
    fused_moe_in_graphs: ClassVar[bool] = True
    rms_norm = staticmethod(rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    rotary = staticmethod(rotary_embedding)
    fused_moe = staticmethod(fused_moe)
    # The kernel's variant follows the weights' form. (In the class body ``fused_moe`` is the
    # staticmethod already: wrapped again, the class would hand out the wrapper.)
    fused_moe_fp8 = fused_moe_int = fused_moe
