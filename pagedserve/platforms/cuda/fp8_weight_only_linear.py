"""Weight-only FP8 linear layers for GPUs without FP8 matmuls (NVIDIA before sm_89, AMD
before MI300): the weight stays in FP8 (half of bfloat16's memory) and is dequantized inside
the matmul; the activations keep their 16 bits.

Up to ``fp8_gemv.MAX_M`` rows (decode at small batch) a GEMV kernel streams the weight and
multiplies it in registers; above, the weight is expanded to a dense copy in the activation
dtype and multiplied by ``torch.mm``. Both decode the e4m3fn bits with integer operations,
since Triton has no FP8 type on these GPUs.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.platforms.cuda.kernels import fp8_gemv
from pagedserve.quant.linear_method import LinearMethod
from pagedserve.quant.weights import Fp8Weight


class Fp8WeightOnlyLinearMethod(LinearMethod):
    def create_weights(self, layer, weight: Fp8Weight, dtype, device) -> None:
        # Parameters (never trained), so weight byte counts include them.
        layer.fp8_weight_bits = nn.Parameter(weight.values.view(torch.uint8).to(device),
                                             requires_grad=False)
        layer.fp8_weight_scale = nn.Parameter(weight.scales.float().to(device),
                                              requires_grad=False)

    def apply(self, layer, x):
        x2 = x.reshape(-1, x.shape[-1])
        bits, scale = layer.fp8_weight_bits, layer.fp8_weight_scale
        if x2.shape[0] <= fp8_gemv.MAX_M:
            out = fp8_gemv.matmul(x2, bits, scale, bits.shape[0])
        else:
            dense = fp8_gemv.dequantize(bits, scale, bits.shape[0], bits.shape[1], x.dtype)
            out = torch.mm(x2, dense.t())
        return out.reshape(*x.shape[:-1], out.shape[1])
