"""The LoRA-wrapped linear layer: the base layer's output, whatever its weight format, plus
each row's adapter delta, added before the layer's all-reduce and bias.

Each wrapped projection holds its slots' stacked weights in the layout of ``lora.ops``
(``lora_a [L, S*R, K]``, ``lora_b [L, R, N]``, this rank's part of each) and is filled slot by
slot by ``lora.slots``. Under tensor parallelism A and B are cut as their base layer is: a
column-parallel layer (q/k/v, gate/up) keeps B's rows of its output part and all of A, a
row-parallel one (o, down) A's columns of its input part and all of B, whose per-rank partial
deltas the base layer's all-reduce then sums.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.lora.adapter import LoRAWeights, split_whole
from pagedserve.lora.ops import LoRAOps, LoRARows, group_rows
from pagedserve.models.linear import Linear


class StepRows:
    """The step's rows grouped by slot, built at the first layer that reads them and shared by
    every layer of the model (the context's slot tensor is new each step)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: torch.Tensor | None = None
        self._rows: LoRARows | None = None

    def of(self, slots: torch.Tensor) -> LoRARows:
        if slots is not self._slots:
            self._slots, self._rows = slots, group_rows(slots, self.num_slots)
        return self._rows


def slot_shapes(base: Linear, num_slots: int, max_rank: int
                ) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of a ``LoRALinear``'s stacked A and B over ``num_slots`` slots: A holds each
    output shard's rows (rank padded to ``max_rank``), B every shard's columns."""
    sizes = base.out_sizes
    return ((num_slots, len(sizes) * max_rank, base.in_features),
            (num_slots, max_rank, sum(sizes)))


def slot_bytes(base: Linear, num_slots: int, max_rank: int) -> int:
    """Device bytes a ``LoRALinear`` of these slots takes around ``base``."""
    return base.factory.dtype.itemsize * sum(
        math.prod(shape) for shape in slot_shapes(base, num_slots, max_rank))


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, num_slots: int, max_rank: int, ops: type[LoRAOps],
                 rows: StepRows) -> None:
        super().__init__()
        self.base = base
        self.ops = ops
        self.rows = rows
        self.max_rank = max_rank
        sizes = base.out_sizes
        self.shards = tuple((sum(sizes[:i]), n) for i, n in enumerate(sizes))
        f = base.factory
        a_shape, b_shape = slot_shapes(base, num_slots, max_rank)
        self.register_buffer("lora_a", torch.zeros(a_shape, dtype=f.dtype, device=f.device))
        self.register_buffer("lora_b", torch.zeros(b_shape, dtype=f.dtype, device=f.device))

    @property
    def out_sizes(self) -> list[int]:
        return self.base.out_sizes

    def input_quantizer(self, num_tokens: int) -> None:
        """None: the delta reads plain activations, so the norm before never quantizes them."""
        return None

    def forward(self, x: torch.Tensor, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        if lora_slots is None:
            return self.base.finish(self.base.method.apply(self.base, x))
        rows = self.rows.of(lora_slots)
        shrunk = self.ops.shrink(x, self.lora_a, rows)  # may run beside the base matmul
        out = self.base.method.apply(self.base, x)
        self.ops.expand(shrunk, self.lora_b, out, self.shards, rows)
        return self.base.finish(out)

    def set_slot(self, slot: int, shards: dict[int, LoRAWeights]) -> None:
        """Slot ``slot`` holds these shards' weights (full, as the checkpoint has them) and zero
        for the others."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        inp, r = self.base.in_part, self.max_rank
        shards = split_whole(shards, [p.full for p in self.base.out_parts])
        for shard, w in shards.items():
            out_part, (off, n) = self.base.out_parts[shard], self.shards[shard]
            a = w.a[:, inp.start:inp.start + inp.size]
            b = w.b[out_part.start:out_part.start + out_part.size]
            # From host memory without waiting for the device: a blocking copy would wait for
            # the queued steps, twice per shard of every layer. The copies are ordered after
            # those steps on the stream, so a step still reading this slot's old adapter reads
            # it whole.
            self.lora_a[slot, shard * r:shard * r + w.rank].copy_(a, non_blocking=True)
            # B goes over as it is (contiguous, so from pinned memory the copy is a DMA) and
            # is transposed on the device.
            self.lora_b[slot, :w.rank, off:off + n].copy_(
                b.to(self.lora_b.device, non_blocking=True).T)
