"""Random padded LoRA layouts (``pagedserve.lora.ops``) and their float64 reference, computed
row by row from each slot's unpadded weights."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Layout(NamedTuple):
    a: torch.Tensor  # [L, S*R, K]
    b: torch.Tensor  # [L, N, R]
    shards: tuple[tuple[int, int], ...]
    weights: dict  # (slot, shard) -> (A [r, K], B [n, r]) float64, unpadded


def random_layout(num_slots: int, max_rank: int, k: int, shard_sizes: list[int], seed: int,
                  dtype: torch.dtype = torch.float32, empty_slots: tuple[int, ...] = ()
                  ) -> Layout:
    """Each slot adapts a random subset of shards (at least one) at random ranks up to
    ``max_rank``; ``empty_slots`` adapt nothing (an unused slot stays all zero)."""
    gen = torch.Generator().manual_seed(seed)
    offs = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
    shards = tuple(zip(offs, shard_sizes))
    a = torch.zeros(num_slots, len(shards) * max_rank, k, dtype=torch.float64)
    b = torch.zeros(num_slots, sum(shard_sizes), max_rank, dtype=torch.float64)
    weights = {}
    for slot in range(num_slots):
        if slot in empty_slots:
            continue
        chosen = torch.randperm(len(shards), generator=gen)[:1 + int(
            torch.randint(len(shards), (1,), generator=gen))]
        for s in chosen.tolist():
            r = int(torch.randint(1, max_rank + 1, (1,), generator=gen))
            off, n = shards[s]
            wa = torch.randn(r, k, generator=gen, dtype=torch.float64)
            wb = torch.randn(n, r, generator=gen, dtype=torch.float64)
            a[slot, s * max_rank:s * max_rank + r] = wa
            b[slot, off:off + n, :r] = wb
            weights[(slot, s)] = (wa, wb)
    return Layout(a.to(dtype), b.to(dtype), shards, weights)


def reference(layout: Layout, x: torch.Tensor, slots: list[int],
              base: torch.Tensor) -> torch.Tensor:
    out = base.double().clone()
    for row, slot in enumerate(slots):
        for s, (off, n) in enumerate(layout.shards):
            if slot >= 0 and (slot, s) in layout.weights:
                wa, wb = layout.weights[(slot, s)]
                out[row, off:off + n] += (x[row].double() @ wa.T) @ wb.T
    return out
