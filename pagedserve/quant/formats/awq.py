"""AWQ checkpoints in AutoAWQ's GEMM packing (``version: gemm``), 4-bit with zero points.

Each quantized linear layer ``[N, K]`` (out, in) with groups of ``G`` input columns is stored as

- ``qweight`` int32 ``[K, N / 8]``: eight 4-bit values of one input row per word,
- ``qzeros`` int32 ``[K / G, N / 8]``: the zero points, packed the same way,
- ``scales`` float16 ``[K / G, N]``,

with ``W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]``. A word's nibbles, lowest first, hold
output columns ``8c + [0, 2, 4, 6, 1, 3, 5, 7]`` (the order AWQ's CUDA kernel unpacks fastest).
Layers listed in ``modules_to_not_convert`` are stored dense and pass through.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.quant.formats.base import PackedFormat, QuantConfigError, require
from pagedserve.quant.formats.int32_packing import unpack_int32
from pagedserve.quant.weights import GroupQuantWeight

# Nibble i of a word holds column AWQ_ORDER[i] of its eight; column j is in nibble REVERSE[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


class AwqFormat(PackedFormat):
    name = "awq"
    parts = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AwqFormat:
        # transformers writes bits/group_size; AutoAWQ's own quant_config w_bit/q_group_size.
        require(config, "w_bit" if "w_bit" in config else "bits", (4,))
        group_key = "q_group_size" if "q_group_size" in config else "group_size"
        group_size = require(config, group_key, (32, 64, 128))
        require(config, "zero_point", (True,), True)
        version = config.get("version", "gemm")
        if str(version).lower() != "gemm":  # AutoAWQ writes "GEMM"; transformers "gemm"
            raise QuantConfigError(f"quantization_config.version: {version!r} is not supported "
                                   f"(only AutoAWQ's GEMM packing is read); supported: 'gemm'")
        skipped = config.get("modules_to_not_convert")
        if skipped is not None and not isinstance(skipped, list):
            raise QuantConfigError(
                f"quantization_config.modules_to_not_convert: expected a list, got {skipped!r}")
        return cls(group_size)

    def unpack(self, module: str, parts: dict[str, torch.Tensor]) -> GroupQuantWeight:
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        k, n = qweight.shape[0], scales.shape[1]
        groups = -(-k // self.group_size)
        if (qweight.shape[1] * 8 != n or scales.shape[0] != groups
                or tuple(qzeros.shape) != (groups, qweight.shape[1])):
            raise QuantConfigError(
                f"awq checkpoint: {module} has qweight {tuple(qweight.shape)}, qzeros "
                f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}: not the GEMM layout of "
                f"quantization_config.group_size {self.group_size}")
        values = _unpack_columns(qweight).T.contiguous()
        zeros = _unpack_columns(qzeros).T.float()
        scales = scales.T.float().contiguous()
        return GroupQuantWeight(values, scales, -zeros * scales, 4, self.group_size)


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, N / 8]`` -> uint8 ``[R, N]`` in column order."""
    rows = packed.shape[0]
    nibbles = unpack_int32(packed, 4).view(rows, -1, 8)
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(rows, -1)
