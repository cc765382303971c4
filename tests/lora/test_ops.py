"""The portable LoRA matmuls (masked, for Gaudi) and the CPU's grouped ones, and the row
grouping, against a float64 row-by-row reference."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.lora.ops import LoRAOps, group_rows
from pagedserve.platforms.cpu.lora_ops import GroupedLoRAOps
from tests.lora.layouts import random_layout, reference


def test_group_rows_lists_each_slots_rows():
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0], dtype=torch.int32)
    rows = group_rows(slots, num_slots=4)
    assert rows.counts.tolist() == [2, 0, 3, 0]
    for slot in range(4):
        start, count = rows.starts[slot], rows.counts[slot]
        got = sorted(rows.sorted_rows[start:start + count].tolist())
        assert got == [i for i, s in enumerate(slots.tolist()) if s == slot]


@pytest.mark.parametrize("ops", [LoRAOps, GroupedLoRAOps])
@pytest.mark.parametrize("num_rows", [1, 7, 70])
def test_torch_ops_equal_reference(num_rows, ops):
    layout = random_layout(4, 8, 48, [40, 24, 24], seed=num_rows, empty_slots=(3,))
    rng = random.Random(num_rows)
    slots = [rng.choice([-1, 0, 1, 2]) for _ in range(num_rows)]
    x = torch.randn(num_rows, 48)
    out = torch.randn(num_rows, 88)
    expected = reference(layout, x, slots, out)
    rows = group_rows(torch.tensor(slots, dtype=torch.int32), 4)
    ops.expand(ops.shrink(x, layout.a, rows), layout.b, out, layout.shards, rows)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
