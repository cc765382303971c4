"""Random grouped-int weights and their float64 products, for kernel and merge tests."""

from __future__ import annotations

import torch

from pagedserve.quant.weights import GroupQuantWeight


def random_weight(n: int, k: int, bits: int, group: int, seed: int,
                  act_order: bool = False, zero_points: bool = False) -> GroupQuantWeight:
    """Offsets near ``-2**(bits - 1) * s`` (GGUF Q4_1 style: no integer zero point), or, with
    ``zero_points``, ``-z * s`` for random integers ``z`` (AWQ's and GPTQ's)."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    values = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).half().float()
    if zero_points:
        offsets = -torch.randint(0, 2 ** bits, (n, groups), generator=g).float() * scales
    else:
        offsets = (-(2 ** (bits - 1)) * scales
                   + torch.randn(n, groups, generator=g).half() * 0.01)
    perm = torch.randperm(k, generator=g) if act_order else None
    return GroupQuantWeight(values, scales, offsets, bits, group, perm)


def reference(x: torch.Tensor, w: GroupQuantWeight) -> torch.Tensor:
    """float64, from the definition: W[n, k] = v * s[n, k // G] + o[n, k // G]; act-order
    columns in checkpoint order."""
    k = w.values.shape[1]
    groups = torch.arange(k) // w.group_size
    dense = (w.values.double() * w.scales.double()[:, groups]
             + w.offsets.double()[:, groups])
    if w.input_perm is not None:
        original = torch.empty_like(dense)
        original[:, w.input_perm] = dense
        dense = original
    return x.double() @ dense.T
