"""The CPU's linear methods for grouped-quantized weights (AWQ, GPTQ, GGUF, compressed-tensors
int4).

``NativeQuantLinearMethod``: the C kernels of ``native_quant`` (built at first use), with
activations quantized to int8 per weight group where the CPU has the int8 kernel for the
weight's bits, else in float32 (``--no-int8-activations`` keeps float32); where no C compiler
works, ``Int4PackLinearMethod``: torch's own CPU kernels, in the model's dtype.

In torch's kernels, 4-bit weights go through ``_weight_int4pack_mm_for_cpu``, which dequantizes
``(q - 8) * scale + zero`` per group inside its matmul, so ``zero = offset + 8 * scale``. Its
scales and zeros share the activation dtype, and its group size must divide K: a K that is not a
multiple of the group is padded with zero columns (and zero activations), and N with zero rows
to the multiple of 16 it needs (sliced off the output). 8-bit weights of any
group size split into two 4-bit halves, ``q = 16 * hi + lo``, each its own int4 matmul:
``_weight_int8pack_mm`` takes one scale per row only, and Q8_0 or GPTQ 8-bit have one per group.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.platforms.cpu import native_quant
from pagedserve.quant.linear_method import LinearMethod
from pagedserve.quant.weights import GroupQuantWeight

_INT4_GROUPS = (32, 64, 128, 256)


class NativeQuantLinearMethod(LinearMethod):
    def __init__(self, int8_activations: bool = True) -> None:
        self.int8_activations = int8_activations

    def create_weights(self, layer, weight: GroupQuantWeight, dtype, device) -> None:
        packed = native_quant.pack(weight.values, weight.scales, weight.offsets, weight.bits,
                                   weight.group_size)
        for name, tensor in packed.tensors().items():
            _param(layer, name, tensor)
        # The kernel's weight holds the layer's parameters, not the tensors they were made
        # from: where a parameter's data moves later (CPU weight offload's staging views),
        # the kernel reads it there.
        layer.native = dataclasses.replace(
            packed, **{name: getattr(layer, name) for name in packed.tensors()})
        layer.input_perm = weight.input_perm

    def apply(self, layer, x):
        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        out = native_quant.matmul(x.reshape(-1, x.shape[-1]).float(), layer.native,
                                  self.int8_activations)
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


class Int4PackLinearMethod(LinearMethod):
    def create_weights(self, layer, weight: GroupQuantWeight, dtype, device) -> None:
        group = kernel_group(weight.group_size)
        halves = ([weight.values] if weight.bits == 4
                  else [weight.values >> 4, weight.values & 0x0F])
        for i, values in enumerate(halves):
            # For 8-bit: w = 16 * s * hi + (s * lo + o), so the high half carries 16 * s and
            # the low half the offset.
            scale = weight.scales * (16 if len(halves) == 2 and i == 0 else 1)
            offset = weight.offsets if i == len(halves) - 1 else torch.zeros_like(scale)
            packed, scale_zero = _pack(values, scale, offset, weight.group_size, group, dtype)
            _param(layer, f"packed{i}", packed)
            _param(layer, f"scale_zero{i}", scale_zero)
        layer.num_halves = len(halves)
        layer.kernel_group = group
        layer.out_features, layer.padded_k = weight.shape[0], _padded(weight.shape[1], group)
        layer.input_perm = weight.input_perm

    def apply(self, layer, x):
        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        if x.shape[-1] != layer.padded_k:
            x = F.pad(x, (0, layer.padded_k - x.shape[-1]))
        out = None
        for i in range(layer.num_halves):
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, getattr(layer, f"packed{i}"), layer.kernel_group,
                getattr(layer, f"scale_zero{i}"))
            out = part if out is None else out + part
        return out if out.shape[-1] == layer.out_features else out[..., :layer.out_features]


def kernel_group(group_size: int) -> int | None:
    """The kernel's group: the largest it supports that splits ``group_size`` evenly (each
    kernel group then lies in one of the checkpoint's groups), or None if none does."""
    return next((g for g in reversed(_INT4_GROUPS) if group_size % g == 0), None)


def _padded(k: int, group: int) -> int:
    return -(-k // group) * group


def _pack(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
          kernel_group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[N, K]`` in 0..15 -> the kernel's packed weight and ``[K' / g, N', 2]`` scales
    and zeros, K padded to ``K'``, a multiple of the kernel group ``g``, and N to ``N'``, a
    multiple of 16."""
    n, k = values.shape
    padded, rows = _padded(k, kernel_group), _padded(n, 16)
    values = F.pad(values.to(torch.int32), (0, padded - k, 0, rows - n))
    scales, offsets = (F.pad(t, (0, 0, 0, rows - n)) for t in (scales, offsets))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 1)
    # Kernel group j lies in the checkpoint's group j * g // group_size.
    groups = torch.arange(padded // kernel_group) * kernel_group // group_size
    groups = groups.clamp(max=scales.shape[1] - 1)
    scale = scales[:, groups]
    zero = offsets[:, groups] + 8 * scale
    return packed, torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(dtype)


def _param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    # A parameter (never trained), so weight byte counts include it.
    setattr(layer, name, nn.Parameter(tensor, requires_grad=False))
