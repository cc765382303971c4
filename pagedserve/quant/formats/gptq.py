"""GPTQ checkpoints (AutoGPTQ / GPTQModel), 4- or 8-bit, in the ``gptq`` (v1) and ``gptq_v2``
checkpoint formats.

Each quantized linear layer ``[N, K]`` (out, in) with groups of ``G`` input columns (``G = K``
for ``group_size: -1``) is stored as

- ``qweight`` int32 ``[K * bits / 32, N]``: packed along K, input row ``k`` in field ``k % f``
  of word row ``k // f`` (``f = 32 / bits`` fields a word, lowest bits first),
- ``qzeros`` int32 ``[K / G, N * bits / 32]``: packed the same way along N,
- ``scales`` float16 ``[K / G, N]``,
- ``g_idx`` int32 ``[K]``: the group of each input row (may be absent without ``desc_act``),

with ``W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``. v1 stores ``z - 1`` (wrapping
to all ones for ``z = 0``); v2 stores ``z``.

Act-order (``desc_act``) quantized the columns in another order, so a group's columns are
scattered: ``g_idx`` says where. Sorting the columns by group (``input_perm``) makes every
group contiguous again, which each group must then be, ``G`` columns to a group.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.quant.formats.base import PackedFormat, QuantConfigError, require
from pagedserve.quant.formats.int32_packing import unpack_int32
from pagedserve.quant.weights import GroupQuantWeight

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


class GptqFormat(PackedFormat):
    name = "gptq"
    parts = ("qweight", "qzeros", "scales")
    optional_parts = ("g_idx",)

    def __init__(self, bits: int, group_size: int, v1_zeros: bool) -> None:
        self.bits = bits
        self.group_size = group_size  # -1: one group per row
        self.v1_zeros = v1_zeros

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GptqFormat:
        bits = require(config, "bits", (4, 8))
        group_size = require(config, "group_size", (-1, 32, 64, 128))
        require(config, "sym", (True, False), True)
        require(config, "desc_act", (True, False), False)
        # GPTQModel writes checkpoint_format; some of its versions wrote format.
        format_key = ("format" if "format" in config and "checkpoint_format" not in config
                      else "checkpoint_format")
        checkpoint = require(config, format_key, CHECKPOINT_FORMATS, "gptq")
        require(config, "is_marlin_format", (False,), False)
        return cls(bits, group_size, checkpoint == "gptq")

    def unpack(self, module: str, parts: dict[str, torch.Tensor]) -> GroupQuantWeight:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        per_word = 32 // self.bits
        k, n = qweight.shape[0] * per_word, qweight.shape[1]
        group = k if self.group_size == -1 else self.group_size
        groups = -(-k // group)
        if tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n // per_word):
            raise QuantConfigError(
                f"gptq checkpoint: {module} has qweight {tuple(qweight.shape)}, qzeros "
                f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}: not the layout of "
                f"quantization_config.bits {self.bits}, group_size {self.group_size}")
        values = unpack_int32(qweight.T, self.bits)  # [N, K]
        zeros = unpack_int32(qzeros, self.bits)  # [groups, N]
        if self.v1_zeros:
            zeros = (zeros.to(torch.int32) + 1) & ((1 << self.bits) - 1)
        perm = _input_perm(module, parts.get("g_idx"), k, group)
        if perm is not None:
            values = values[:, perm]
        scales = scales.T.float().contiguous()
        return GroupQuantWeight(values.contiguous(), scales, -zeros.T.float() * scales,
                                self.bits, group, perm)


def _input_perm(module: str, g_idx: torch.Tensor | None, k: int,
                group: int) -> torch.Tensor | None:
    """The column order that makes each group contiguous, or None if it already is."""
    if g_idx is None:
        return None
    in_order = torch.arange(k) // group
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != (k,):
        raise QuantConfigError(f"gptq checkpoint: {module}.g_idx has shape "
                               f"{tuple(g_idx.shape)}, expected ({k},)")
    if torch.equal(g_idx, in_order):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], in_order):
        raise QuantConfigError(
            f"quantization_config.desc_act: {module}.g_idx does not put {group} columns "
            f"(quantization_config.group_size) in each group")
    return perm
