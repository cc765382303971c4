"""GGUF's Q4_0, Q4_1 and Q8_0 blocks, as a converted GGUF folder stores them.

``models.gguf_convert`` keeps these tensors as their raw blocks, ``uint8 [N, K / 32 * block
bytes]`` under ``<module>.gguf_<type>``; other types were dequantized to float32 there. Every
block holds 32 consecutive weights of one row and a float16 scale ``d``:

- Q4_0 (18 bytes): ``d``, 16 bytes of nibbles; ``w = (q - 8) * d``.
- Q4_1 (20 bytes): ``d``, ``m``, 16 bytes of nibbles; ``w = q * d + m``.
- Q8_0 (34 bytes): ``d``, 32 int8 values; ``w = q * d``.

Byte ``j`` of a 4-bit block holds weight ``j`` in its low nibble and weight ``j + 16`` in its
high nibble.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pagedserve.quant.formats.base import CheckpointFormat, Tensors
from pagedserve.quant.weights import GroupQuantWeight, LoadedWeight

BLOCK = 32
PART_PREFIX = "gguf_"
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}


class GgufFormat(CheckpointFormat):
    name = "gguf"

    def read(self, tensors: Tensors) -> Iterator[tuple[str, LoadedWeight]]:
        for name, tensor in tensors:
            module, _, part = name.rpartition(".")
            if part.startswith(PART_PREFIX):
                yield f"{module}.weight", unpack_blocks(tensor, part[len(PART_PREFIX):])
            else:
                yield name, tensor


def unpack_blocks(raw: torch.Tensor, kind: str) -> GroupQuantWeight:
    """``raw`` uint8 ``[N, blocks * block bytes]`` of type ``kind`` -> 32-wide groups."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[kind])
    d = _f16(blocks[..., 0:2])
    if kind == "q8_0":
        values = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return _weight(values, d, -128 * d, 8)
    start = 4 if kind == "q4_1" else 2
    nibbles = blocks[..., start:start + 16]
    values = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)
    offsets = _f16(blocks[..., 2:4]) if kind == "q4_1" else -8 * d
    return _weight(values, d, offsets, 4)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """``[..., blocks, 2]`` uint8 -> float32 ``[..., blocks]``."""
    return two_bytes.contiguous().view(torch.float16)[..., 0].float()


def _weight(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
            bits: int) -> GroupQuantWeight:
    return GroupQuantWeight(values.reshape(values.shape[0], -1).contiguous(),
                            scales.contiguous(), offsets.contiguous(), bits, BLOCK)
