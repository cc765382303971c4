"""Integers packed into int32 words, as AWQ and GPTQ store them."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``[..., M]`` -> uint8 ``[..., M * 32 // bits]``: each word's fields in turn,
    lowest bits first (field ``i`` of word ``m`` lands at ``m * 32 // bits + i``)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    # An arithmetic shift of a negative word brings in ones from the top; the mask drops them.
    fields = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return fields.to(torch.uint8).flatten(-2)
