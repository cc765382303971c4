"""The routed experts of a mixture-of-experts layer in 4- or 8-bit integers with a scale and an
integer zero point per group of input columns (AWQ, GPTQ with or without ``sym``,
compressed-tensors int4, GGUF Q4_0 and Q8_0), multiplied as they are by the platform's
``LayerOps.fused_moe_int`` (16-bit activations times integer weights: W4A16 or W8A16), made
once at load (``models/kernel_experts.py``) in ``PackedIntWeight`` form: codes packed along K
(4-bit two a byte, as ``ExpertStack`` holds them), float32 scales and uint8 zero points per
row and group. Each row of ``w13`` keeps its own scales, so gate and up simply concatenate.

Left on the per-step dequantize path (``models/quantized_experts.py``): GPTQ act-order
(``desc_act``: each projection's columns in an order of its own, which the activations
would have to follow per expert and per projection), offsets that are not integer zero
points (GGUF Q4_1's minimum), and groups whose width has no power-of-2 factor of 16 or more
(the kernel's K tiles each lie in one group).
"""

from __future__ import annotations

from pagedserve.models.kernel_experts import KernelExperts
from pagedserve.models.quantized_experts import QuantizedExperts
from pagedserve.quant.expert_stack import ExpertStack, Stacked
from pagedserve.quant.weights import GroupQuantWeight, PackedIntWeight, zero_points

# The narrowest K tile of the kernel: a group must hold whole tiles of at least this width.
_MIN_TILE = 16


class IntExperts(KernelExperts):
    op = "fused_moe_int"

    @classmethod
    def takes(cls, experts: QuantizedExperts) -> bool:
        """Grouped integer experts that ``PackedIntWeight`` holds, gate and up alike."""
        gate, up, down = experts.gate, experts.up, experts.down
        return (gate.form is GroupQuantWeight and gate.static == up.static
                and all(_packs(s) for s in (gate, up, down)))

    @classmethod
    def layout(cls, weight: Stacked, gate_or_up: bool) -> Stacked:
        packed = (PackedIntWeight.from_group(weight) if isinstance(weight, GroupQuantWeight)
                  else None)
        if packed is None:
            raise ValueError(f"a layer of integer experts read as they are was given a "
                             f"{type(weight).__name__} that is not 4- or 8-bit groups with "
                             f"integer zero points and columns in order (no act-order)")
        return packed


def _packs(stack: ExpertStack) -> bool:
    """Whether ``PackedIntWeight.from_group`` takes every expert of ``stack``, in groups the
    kernel's K tiles fit."""
    if stack.form is not GroupQuantWeight or getattr(stack, "input_perm", None) is not None:
        return False
    bits, group = stack.static["bits"], stack.static["group_size"]
    one_group = stack.scales.shape[-1] == 1
    return (bits in (4, 8) and (one_group or group & -group >= _MIN_TILE)
            and zero_points(stack.scales, stack.offsets, bits) is not None)
