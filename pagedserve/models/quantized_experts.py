"""The routed experts of a mixture-of-experts layer kept quantized in memory (FP8 per tensor or
per row, block FP8, AWQ/GPTQ/compressed-tensors 4- and 8-bit groups), run by dequantizing the
experts a step routes tokens to.

Each step finds the experts its tokens chose (a host sync: which ones, and how many), turns
only those into 16-bit ``w13`` ``[A, 2I, H]`` and ``w2`` ``[A, H, I]`` (dequantized in float32,
then rounded once to the activations' dtype, as the dense layers are at load), renumbers the
routing ids ``0 .. A-1`` and runs the platform's ``LayerOps.fused_moe`` on them. So memory is
the quantized checkpoint's plus one step's active experts in 16 bits; speed is a dequantize pass
over those experts per layer and step. The sync keeps these layers out of captured graphs
(``SparseMoeBlock.syncs_with_host``). FP8 and grouped integer experts, on a platform with
``LayerOps.fused_moe_fp8`` or ``fused_moe_int``, leave this path once loaded
(``models/kernel_experts.py``); GPTQ act-order, GGUF Q4_1 and every quantized expert on the
CPU stay on it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pagedserve.models.layer_ops import LayerOps
from pagedserve.quant.expert_stack import ExpertStack
from pagedserve.quant.weights import LoadedWeight


class QuantizedExperts(nn.Module):
    """Every expert's gate, up and down projections (this rank's part of each), one
    ``ExpertStack`` a projection: gate and up may differ in form (GPTQ act-order orders each
    projection's columns its own way), so they meet in ``w13`` only once dequantized."""

    # Each step reads which experts it routes to on the host.
    syncs_with_host: ClassVar[bool] = True

    def __init__(self, num_experts: int, device: torch.device) -> None:
        super().__init__()
        self.gate = ExpertStack(num_experts, device)
        self.up = ExpertStack(num_experts, device)
        self.down = ExpertStack(num_experts, device)

    def put(self, expert: int, proj: str, weight: LoadedWeight) -> None:
        """``proj``: gate | up | down."""
        getattr(self, proj).put(expert, weight)

    def forward(self, ops: type[LayerOps], hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """``LayerOps.fused_moe``'s contract, the weights being this module's."""
        active = topk_ids.unique()  # sorted; the host sync
        w13 = torch.cat([self._dense(self.gate, active, hidden.dtype),
                         self._dense(self.up, active, hidden.dtype)], dim=1)
        w2 = self._dense(self.down, active, hidden.dtype)
        local_ids = torch.searchsorted(active, topk_ids)
        return ops.fused_moe(hidden, w13, w2, local_ids, topk_weights)

    @staticmethod
    def _dense(stack: ExpertStack, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return stack.take(ids).dequantize(torch.float32).to(dtype)
