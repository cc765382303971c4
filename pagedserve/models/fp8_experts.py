"""The routed experts of a mixture-of-experts layer in FP8, multiplied as they are by the
platform's ``LayerOps.fused_moe_fp8`` (16-bit activations times FP8 weights: W8A16). No step
dequantizes a weight or reads the routing on the host, so these layers run in captured graphs.

Made once at load, when the layer's last expert weight has arrived, from the per-projection
stacks of ``QuantizedExperts`` where they are FP8 (per tensor or per row, ``Fp8Weight``; block
FP8, ``BlockFp8Weight``), on a platform whose ops have the entry point; the stacks are then
dropped. The kernel's layout: gate and up meet in ``w13`` ``[E, 2I, H]`` (each expert's gate
rows, then its up rows, with their scales) and the down stack is ``w2`` ``[E, H, I]`` as it is.
Block scales of gate and up concatenate where the gate's rows end on a block (``I`` a multiple
of the block's rows, as 768 is of Qwen3-30B-A3B's 128); where they do not (a block straddles
the seam), each row of ``w13`` gets its own row of scales (blocks of ``1 x bk``), which
dequantizes to the same weight.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.quantized_experts import QuantizedExperts
from pagedserve.quant.expert_stack import ExpertStack
from pagedserve.quant.weights import BlockFp8Weight, Fp8Weight, LoadedWeight

_FP8_FORMS = (Fp8Weight, BlockFp8Weight)


def fuses(experts: QuantizedExperts) -> bool:
    """Whether ``experts`` are FP8 in a layout ``Fp8Experts`` takes: gate and up of one form
    (and one block), down any FP8 form."""
    gate, up, down = experts.gate, experts.up, experts.down
    return (gate.form in _FP8_FORMS and down.form in _FP8_FORMS
            and (gate.form, gate.static) == (up.form, up.static))


class Fp8Experts(nn.Module):
    # Nothing in a step reads the device on the host (``SparseMoeBlock.syncs_with_host``).
    syncs_with_host: ClassVar[bool] = False

    def __init__(self, experts: QuantizedExperts) -> None:
        """``experts``: complete FP8 stacks (``fuses``)."""
        super().__init__()
        self.w13 = ExpertStack.holding(_gate_up(experts.gate.whole(), experts.up.whole()))
        self.w2 = ExpertStack.holding(experts.down.whole())

    def put(self, expert: int, proj: str, weight: LoadedWeight) -> None:
        """A new weight for one expert's projection (``LLM.load_weights`` after load), written
        into its rows of the layout: down as its stack takes it, gate and up in their half of
        ``w13`` with their scales in its form (a row of scales per row where it has those)."""
        if proj == "down":
            self.w2.put(expert, weight)
            return
        block = self.w13.static.get("block")
        if type(weight) is not self.w13.form or (block and weight.block[1] != block[1]):
            raise ValueError(f"expert {expert}'s {proj} projection is {type(weight).__name__} "
                             f"unlike the layer's experts ({self.w13.form.__name__} {block})")
        if block and block[0] == 1:
            weight = _scale_per_row(weight)
        rows = weight.shape[0]
        start = 0 if proj == "gate" else rows
        first = start // (block[0] if block else 1)
        self.w13.values[expert, start:start + rows].copy_(weight.values)
        self.w13.scales[expert, first:first + weight.scales.shape[0]].copy_(weight.scales)

    def forward(self, ops: type[LayerOps], hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """``LayerOps.fused_moe``'s contract, the weights being this module's."""
        return ops.fused_moe_fp8(hidden, self.w13.whole(), self.w2.whole(), topk_ids,
                                 topk_weights)


def _gate_up(gate: Fp8Weight | BlockFp8Weight,
             up: Fp8Weight | BlockFp8Weight) -> Fp8Weight | BlockFp8Weight:
    """Gate's rows then up's, each expert's, with their scales."""
    values = torch.cat([gate.values, up.values], dim=1)
    if isinstance(gate, Fp8Weight):
        return Fp8Weight(values, torch.cat([gate.scales, up.scales], dim=1))
    if gate.shape[-2] % gate.block[0]:
        gate, up = _scale_per_row(gate), _scale_per_row(up)
    return BlockFp8Weight(values, torch.cat([gate.scales, up.scales], dim=1), gate.block)


def _scale_per_row(w: BlockFp8Weight) -> BlockFp8Weight:
    """The same weight in blocks of one row (a stack ``[E, N, K]`` or one expert's)."""
    rows = w.shape[-2]
    scales = w.scales.repeat_interleave(w.block[0], dim=-2)[..., :rows, :]
    return BlockFp8Weight(w.values, scales.contiguous(), (1, w.block[1]))
