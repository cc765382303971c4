"""The CUDA (and ROCm) linear method for 4-bit grouped weights (AWQ, GPTQ, compressed-tensors
int4, GGUF Q4): the weight stays packed on the device and is dequantized in registers by the
Triton kernel of ``kernels.w4a16``. Act-order (GPTQ ``desc_act``) permutes the activation's
columns on every call; the weight's columns were sorted into groups at load.
"""

from __future__ import annotations

from torch import nn

from pagedserve.quant.linear_method import LinearMethod
from pagedserve.quant.weights import GroupQuantWeight


class W4A16LinearMethod(LinearMethod):
    def create_weights(self, layer, weight: GroupQuantWeight, dtype, device) -> None:
        from pagedserve.platforms.cuda.kernels import w4a16

        packed = w4a16.pack(weight.values, weight.scales, weight.offsets, weight.group_size,
                            device)
        # Parameters (never trained), so weight byte counts include them.
        layer.qweight = nn.Parameter(packed.qweight, requires_grad=False)
        layer.scales = nn.Parameter(packed.scales, requires_grad=False)
        layer.shifts = nn.Parameter(packed.shifts, requires_grad=False)
        # Zero between calls: the kernel's split-K slices count themselves here.
        layer.register_buffer("counters", packed.counters)
        layer.packing = packed._replace(qweight=None, scales=None, shifts=None, counters=None)
        perm = weight.input_perm
        layer.input_perm = (None if perm is None
                            else nn.Parameter(perm.to(device), requires_grad=False))

    def apply(self, layer, x):
        from pagedserve.platforms.cuda.kernels import w4a16

        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        x2 = x.reshape(-1, x.shape[-1])
        packed = layer.packing._replace(qweight=layer.qweight, scales=layer.scales,
                                        shifts=layer.shifts, counters=layer.counters)
        return w4a16.matmul(x2, packed).reshape(*x.shape[:-1], packed.qweight.shape[1])


def supports(weight) -> bool:
    """4-bit (or narrower) grouped weights."""
    return isinstance(weight, GroupQuantWeight) and weight.bits <= 4
