"""FP8 checkpoints as vLLM, llm-compressor's ``fp8`` export and transformers write them.

Each quantized linear layer stores:

- ``<module>.weight``: float8_e4m3fn ``[N, K]``;
- ``<module>.weight_scale``: float32, one per tensor (a scalar or ``[1]``), so
  ``W = float(weight) * weight_scale``;
- ``<module>.input_scale`` (``activation_scheme: static`` only): the activation scale.

A layer the checkpoint left unquantized (``modules_to_not_convert`` / ``ignored_layers``, the LM
head) stores a plain float ``weight``: a weight is quantized exactly when its dtype is float8.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from pagedserve.quant.formats.base import PackedFormat, QuantConfigError, Tensors, require
from pagedserve.quant.weights import Fp8Weight, LoadedWeight

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
              torch.float8_e5m2fnuz)


class Fp8Format(PackedFormat):
    name = "fp8"
    parts = ("weight", "weight_scale")

    def __init__(self, static_inputs: bool, unconverted: tuple[str, ...] = ()) -> None:
        # A static scheme stores input_scale for every layer, so a layer is complete with it.
        self.parts = (*Fp8Format.parts, "input_scale") if static_inputs else Fp8Format.parts
        self.unconverted = unconverted

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Format:
        if config.get("weight_block_size") is not None:
            raise QuantConfigError(
                f"quantization_config.weight_block_size: {config['weight_block_size']!r} "
                f"(block-wise FP8) is not supported; only per-tensor weight scales are")
        require(config, "fmt", ("e4m3",), "e4m3")
        scheme = require(config, "activation_scheme", ("static", "dynamic"), "dynamic")
        unconverted = (config.get("modules_to_not_convert") or []) + (
            config.get("ignored_layers") or [])
        return cls(scheme == "static", tuple(unconverted))

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

    def unpack(self, module: str, parts: dict[str, torch.Tensor]) -> Fp8Weight:
        weight = parts["weight"]
        scale = parts["weight_scale"]
        if scale.numel() != 1:
            raise QuantConfigError(f"fp8 checkpoint: {module}.weight_scale has shape "
                                   f"{tuple(scale.shape)}; a per-tensor scale is expected")
        return Fp8Weight(weight, row_scales(scale, weight.shape[0], f"{module}.weight_scale"),
                         scalar(parts.get("input_scale"), f"{module}.input_scale"))


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
