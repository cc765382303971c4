"""The routed experts of a mixture-of-experts layer in FP8, multiplied as they are by the
platform's ``LayerOps.fused_moe_fp8`` (16-bit activations times FP8 weights: W8A16), made once
at load (``models/kernel_experts.py``) from stacks of FP8 per tensor or per row
(``Fp8Weight``) or block FP8 (``BlockFp8Weight``).

Block scales of gate and up concatenate where the gate's rows end on a block (``I`` a multiple
of the block's rows, as 768 is of Qwen3-30B-A3B's 128); where they do not (a block straddles
the seam), each row of ``w13`` gets its own row of scales (blocks of ``1 x bk``), which
dequantizes to the same weight.
"""

from __future__ import annotations

from pagedserve.models.kernel_experts import KernelExperts
from pagedserve.models.quantized_experts import QuantizedExperts
from pagedserve.quant.expert_stack import Stacked
from pagedserve.quant.weights import BlockFp8Weight, Fp8Weight

_FP8_FORMS = (Fp8Weight, BlockFp8Weight)


class Fp8Experts(KernelExperts):
    op = "fused_moe_fp8"

    @classmethod
    def takes(cls, experts: QuantizedExperts) -> bool:
        """FP8 experts: gate and up of one form (and one block), down any FP8 form."""
        gate, up, down = experts.gate, experts.up, experts.down
        return (gate.form in _FP8_FORMS and down.form in _FP8_FORMS
                and (gate.form, gate.static) == (up.form, up.static))

    @classmethod
    def layout(cls, weight: Stacked, gate_or_up: bool) -> Stacked:
        """As it is, but gate and up blocks that straddle the seam of ``w13``: per row."""
        if not isinstance(weight, _FP8_FORMS):
            raise ValueError(f"a layer of FP8 experts was given {type(weight).__name__}")
        if gate_or_up and isinstance(weight, BlockFp8Weight) \
                and weight.shape[-2] % weight.block[0]:
            return _scale_per_row(weight)
        return weight


def _scale_per_row(w: BlockFp8Weight) -> BlockFp8Weight:
    """The same weight in blocks of one row (a stack ``[E, N, K]`` or one expert's)."""
    rows = w.shape[-2]
    scales = w.scales.repeat_interleave(w.block[0], dim=-2)[..., :rows, :]
    return BlockFp8Weight(w.values, scales.contiguous(), (1, w.block[1]))
