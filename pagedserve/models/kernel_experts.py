"""The routed experts of a mixture-of-experts layer in a quantized layout that a platform's
kernel multiplies as it is (16-bit activations times FP8 or integer weights), through one
``LayerOps`` entry. No step dequantizes a weight or reads the routing on the host, so these
layers run in captured graphs.

Made once at load, when the layer's last expert weight has arrived, from the per-projection
stacks of ``QuantizedExperts``, on a platform whose ops have the entry point; the stacks are
then dropped. The layout: gate and up meet in ``w13`` ``[E, 2I, H]`` (each expert's gate rows,
then its up rows, each tensor of the form concatenated along its rows) and the down stack is
``w2`` ``[E, H, I]``. A subclass says which experts it takes, the entry it calls and how a
checkpoint's form becomes the kernel's (``layout``): ``models/fp8_experts.py``,
``models/int_experts.py``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from pagedserve.models.layer_ops import LayerOps
from pagedserve.models.quantized_experts import QuantizedExperts
from pagedserve.quant.expert_stack import ExpertStack, Stacked
from pagedserve.quant.weights import LoadedWeight


class KernelExperts(nn.Module):
    # Nothing in a step reads the device on the host (``SparseMoeBlock.syncs_with_host``).
    syncs_with_host: ClassVar[bool] = False
    op: ClassVar[str]  # the name of the ``LayerOps`` entry that reads the layout

    def __init__(self, experts: QuantizedExperts) -> None:
        """``experts``: complete stacks that ``takes`` accepts."""
        super().__init__()
        gate = self.layout(experts.gate.whole(), gate_or_up=True)
        up = self.layout(experts.up.whole(), gate_or_up=True)
        self.w13 = ExpertStack.holding(_cat_rows(gate, up))
        self.w2 = ExpertStack.holding(self.layout(experts.down.whole(), gate_or_up=False))

    @classmethod
    def reads(cls, ops: type[LayerOps]) -> bool:
        """Whether the platform's ops have this layout's entry point."""
        return getattr(ops, cls.op) is not None

    @classmethod
    def takes(cls, experts: QuantizedExperts) -> bool:
        """Whether ``experts`` (complete stacks) have this layout."""
        raise NotImplementedError

    @classmethod
    def layout(cls, weight: Stacked, gate_or_up: bool) -> Stacked:
        """A checkpoint's form of one projection (one expert's, or a stack's) as the kernel
        reads it; ``gate_or_up``: its rows go into ``w13``."""
        raise NotImplementedError

    def put(self, expert: int, proj: str, weight: LoadedWeight) -> None:
        """A new weight for one expert's projection (``LLM.load_weights`` after load), written
        into its rows of the layout: down as ``w2`` takes it, gate and up into their half of
        that expert's rows of each tensor of ``w13``."""
        if proj == "down":
            self.w2.put(expert, self.layout(weight, gate_or_up=False))
        else:
            self.w13.put_half(expert, self.layout(weight, gate_or_up=True), proj == "up")

    def forward(self, ops: type[LayerOps], hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """``LayerOps.fused_moe``'s contract, the weights being this module's."""
        return getattr(ops, self.op)(hidden, self.w13.whole(), self.w2.whole(), topk_ids,
                                     topk_weights)


def _cat_rows(gate: Stacked, up: Stacked) -> Stacked:
    """Gate's rows then up's, each expert's: every tensor field concatenated along its rows
    (dimension 1 of a stack), the other fields gate's."""
    fields = {}
    for field in dataclasses.fields(gate):
        value = getattr(gate, field.name)
        if isinstance(value, torch.Tensor):
            value = torch.cat([value, getattr(up, field.name)], dim=1)
        fields[field.name] = value
    return type(gate)(**fields)
