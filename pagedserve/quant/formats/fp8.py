"""FP8 checkpoints as vLLM, llm-compressor's ``fp8`` export and transformers write them.

Each quantized linear layer stores:

- ``<module>.weight``: float8_e4m3fn ``[N, K]``;
- ``<module>.weight_scale``: float32, one per tensor (a scalar or ``[1]``), so
  ``W = float(weight) * weight_scale``;
- ``<module>.input_scale`` (``activation_scheme: static`` only): the activation scale.

Block-wise checkpoints (``weight_block_size: [bn, bk]``: DeepSeek-V3, Qwen3-FP8) store instead
of ``weight_scale``

- ``<module>.weight_scale_inv``: ``[ceil(N / bn), ceil(K / bk)]``, one scale per tile of the
  weight, multiplied (despite its name): ``W[n, k] = float(weight[n, k]) *
  weight_scale_inv[n // bn, k // bk]``. Their activations are scaled at run time
  (``activation_scheme: dynamic``).

A layer the checkpoint left unquantized (``modules_to_not_convert`` / ``ignored_layers``, the LM
head) stores a plain float ``weight``: a weight is quantized exactly when its dtype is float8.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagedserve.quant.formats.base import PackedFormat, QuantConfigError, Tensors, require
from pagedserve.quant.weights import BlockFp8Weight, Fp8Weight, LoadedWeight

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
              torch.float8_e5m2fnuz)


class Fp8Format(PackedFormat):
    name = "fp8"
    parts = ("weight", "weight_scale")

    def __init__(self, static_inputs: bool, unconverted: tuple[str, ...] = (),
                 block: tuple[int, int] | None = None) -> None:
        # A static scheme stores input_scale for every layer, so a layer is complete with it.
        self.parts = (*Fp8Format.parts, "input_scale") if static_inputs else Fp8Format.parts
        if block is not None:
            self.parts = ("weight", "weight_scale_inv")
        self.unconverted = unconverted
        self.block = block

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Format:
        require(config, "fmt", ("e4m3",), "e4m3")
        block = _block_size(config.get("weight_block_size"))
        schemes = ("dynamic",) if block else ("static", "dynamic")
        scheme = require(config, "activation_scheme", schemes, "dynamic")
        unconverted = (config.get("modules_to_not_convert") or []) + (
            config.get("ignored_layers") or [])
        return cls(scheme == "static", tuple(unconverted), block)

    def claims(self, module: str, part: str, tensor: torch.Tensor) -> bool:
        quantized = is_fp8(module, tensor) if part == "weight" else part in self.parts
        if quantized and listed(module, self.unconverted):
            raise QuantConfigError(f"fp8 checkpoint: {module} is in quantization_config."
                                   f"modules_to_not_convert but stores a quantized {part}")
        return quantized

    def read(self, tensors: Tensors) -> Iterator[tuple[str, LoadedWeight]]:
        # A dynamic scheme ignores any activation scales a checkpoint carries anyway.
        kept = ((n, t) for n, t in tensors
                if "input_scale" in self.parts or not n.endswith(".input_scale"))
        return super().read(kept)

    def unpack(self, module: str, parts: dict[str, torch.Tensor]) -> LoadedWeight:
        weight = parts["weight"]
        if self.block is not None:
            return _block_weight(module, weight, parts["weight_scale_inv"], self.block)
        scale = parts["weight_scale"]
        if scale.numel() != 1:
            raise QuantConfigError(f"fp8 checkpoint: {module}.weight_scale has shape "
                                   f"{tuple(scale.shape)}; a per-tensor scale is expected")
        return Fp8Weight(weight, row_scales(scale, weight.shape[0], f"{module}.weight_scale"),
                         scalar(parts.get("input_scale"), f"{module}.input_scale"))


def _block_size(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and v > 0 for v in value)):
        raise QuantConfigError(f"quantization_config.weight_block_size: {value!r} is not two "
                               f"positive integers [rows, columns]")
    return value[0], value[1]


def _block_weight(module: str, weight: torch.Tensor, scales: torch.Tensor,
                  block: tuple[int, int]) -> BlockFp8Weight:
    grid = tuple(-(-size // b) for size, b in zip(weight.shape, block))
    if tuple(scales.shape) != grid:
        raise QuantConfigError(
            f"fp8 checkpoint: {module}.weight_scale_inv has shape {tuple(scales.shape)}; "
            f"{module}.weight {tuple(weight.shape)} in blocks of {list(block)} "
            f"(quantization_config.weight_block_size) needs {grid}")
    return BlockFp8Weight(weight, scales.float(), block)


def is_fp8(module: str, weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a float8 e4m3 weight; other float8 kinds are refused."""
    if weight.dtype not in FP8_DTYPES:
        return False
    if weight.dtype != torch.float8_e4m3fn:
        raise QuantConfigError(f"{module}.weight is {weight.dtype}; only float8_e4m3fn FP8 "
                               f"weights are supported")
    return True


def listed(module: str, names: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``names`` or lies under or ends with one, matched whole
    dot-separated components (``lm_head``, ``model.layers.0.mlp``)."""
    dotted = f".{module}."
    return any(f".{name}." in dotted for name in names)


def row_scales(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    """A per-tensor (one value) or per-row (``[N]``, ``[N, 1]``) scale as float32 ``[N]``."""
    if scale.numel() not in (1, rows):
        raise QuantConfigError(f"{name} has shape {tuple(scale.shape)}; expected one scale or "
                               f"one per output row ({rows})")
    return scale.float().reshape(-1).expand(rows).contiguous()


def scalar(scale: torch.Tensor | None, name: str) -> float | None:
    if scale is None:
        return None
    if scale.numel() != 1:
        raise QuantConfigError(f"{name} has shape {tuple(scale.shape)}; a per-tensor "
                               f"activation scale is expected")
    return float(scale.float().reshape(()))
