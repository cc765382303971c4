"""compressed-tensors checkpoints (llm-compressor's output), in the two layouts read here.

``quantization_config`` holds ``config_groups`` (each a scheme: ``targets``, ``weights``,
``input_activations``, and its ``format``, else the top-level ``format``) and an ``ignore``
list of module names, ``re:`` entries being regular expressions matched at the name's start.

- ``float-quantized`` (``naive-quantized``), FP8 W8A8: ``<module>.weight`` float8_e4m3fn
  ``[N, K]``, ``<module>.weight_scale`` ``[1]`` (strategy ``tensor``) or ``[N, 1]``
  (``channel``), ``W = weight * weight_scale``; ``<module>.input_scale`` ``[1]`` when the
  activations have a static per-tensor scale, nothing when they are scaled per token.
- ``pack-quantized``, int4 W4A16: ``<module>.weight_packed`` int32 ``[N, K / 8]``, eight
  4-bit values per int32 along K, value ``8 i + j`` in bits ``4 j .. 4 j + 3`` of word ``i``,
  each stored as ``q + 8`` (``q`` in -8..7); ``<module>.weight_scale`` ``[N, K / G]`` (strategy
  ``group``) or ``[N, 1]`` (``channel``); ``<module>.weight_shape`` ``[N, K]``. Asymmetric
  schemes add ``<module>.weight_zero_point``, ``z + 8`` packed the same way but along N, int32
  ``[N / 8, K / G]``. ``W = (q - z) * s = (stored q - stored z) * s``.

Every other option is refused by ``from_config``, before any weight is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.quant.formats.base import PackedFormat, QuantConfigError, require
from pagedserve.quant.formats.fp8 import is_fp8, row_scales, scalar
from pagedserve.quant.weights import Fp8Weight, GroupQuantWeight, LoadedWeight

FLOAT_FORMATS = ("float-quantized", "naive-quantized")
PACKED_FORMAT = "pack-quantized"
_PACK_BITS = 4
_PER_WORD = 32 // _PACK_BITS


@dataclass(frozen=True)
class _Scheme:
    packed: bool  # pack-quantized int4, else float-quantized FP8
    symmetric: bool = True
    group_size: int | None = None  # None: one group per row (strategy channel)
    static_inputs: bool = False  # FP8 with a static per-tensor input_scale


class CompressedTensorsFormat(PackedFormat):
    name = "compressed-tensors"
    parts = ("weight", "weight_scale")

    def __init__(self, scheme: _Scheme, ignore: tuple[str, ...] = ()) -> None:
        self.scheme = scheme
        self.ignore = ignore
        if scheme.packed:
            self.parts = ("weight_packed", "weight_scale", "weight_shape") + (
                () if scheme.symmetric else ("weight_zero_point",))
        elif scheme.static_inputs:
            self.parts = ("weight", "weight_scale", "input_scale")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsFormat:
        _check_unsupported_features(config)
        groups = config.get("config_groups") or {}
        if len(groups) != 1:
            raise QuantConfigError(
                f"quantization_config.config_groups: {len(groups)} groups; exactly one "
                f"(targeting Linear) is supported")
        (group_name, group), = groups.items()
        ignore = config.get("ignore") or []
        return cls(_parse_group(group_name, group, config.get("format")), tuple(ignore))

    def claims(self, module: str, part: str, tensor: torch.Tensor) -> bool:
        quantized = part in self.parts and (part != "weight" or is_fp8(module, tensor))
        if quantized and self._ignored(module):
            raise QuantConfigError(f"compressed-tensors checkpoint: {module} matches "
                                   f"quantization_config.ignore but stores a quantized {part}")
        return quantized

    def unpack(self, module: str, parts: dict[str, torch.Tensor]) -> LoadedWeight:
        if self.scheme.packed:
            return self._unpack_int4(module, parts)
        weight = parts["weight"]
        return Fp8Weight(weight, row_scales(parts["weight_scale"], weight.shape[0],
                                            f"{module}.weight_scale"),
                         scalar(parts.get("input_scale"), f"{module}.input_scale"))

    def _unpack_int4(self, module: str, parts: dict[str, torch.Tensor]) -> GroupQuantWeight:
        rows, cols = (int(d) for d in parts["weight_shape"].tolist())
        values = unpack_int4(parts["weight_packed"], cols)
        scales = parts["weight_scale"].float()
        group = self.scheme.group_size or cols
        if values.shape[0] != rows or scales.shape != (rows, -(-cols // group)):
            raise QuantConfigError(
                f"compressed-tensors checkpoint: {module} has weight_packed "
                f"{tuple(parts['weight_packed'].shape)} and weight_scale "
                f"{tuple(scales.shape)}, which do not fit weight_shape {[rows, cols]} in "
                f"groups of {group}")
        if self.scheme.symmetric:
            zeros = torch.full_like(scales, 1 << (_PACK_BITS - 1))
        else:
            zeros = unpack_int4(parts["weight_zero_point"].T, rows).T.float()
        return GroupQuantWeight(values, scales, -zeros * scales, _PACK_BITS, group)

    def _ignored(self, module: str) -> bool:
        return any(re.match(name[3:], module) if name.startswith("re:") else name == module
                   for name in self.ignore)


def unpack_int4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 ``[R, ceil(cols / 8)]``, eight nibbles per word, low bits first -> uint8
    ``[R, cols]`` in 0..15."""
    shifts = torch.arange(0, 32, _PACK_BITS, dtype=torch.int32)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return nibbles.reshape(packed.shape[0], -1)[:, :cols].to(torch.uint8).contiguous()


def _check_unsupported_features(config: dict[str, Any]) -> None:
    require(config, "quantization_status", ("compressed",), "compressed")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(key):
            raise QuantConfigError(f"quantization_config.{key}: {config[key]!r} is not "
                                   f"supported")


def _parse_group(name: str, group: dict[str, Any], default_format: str | None) -> _Scheme:
    where = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise QuantConfigError(f"quantization_config.{where}.targets: {group.get('targets')!r} "
                               f"is not supported; supported: ['Linear']")
    fmt = group.get("format") or default_format
    require({"format": fmt}, "format", (*FLOAT_FORMATS, PACKED_FORMAT))
    if group.get("output_activations"):
        raise QuantConfigError(f"quantization_config.{where}.output_activations: "
                               f"{group['output_activations']!r} is not supported")
    weights = _args(group, "weights", where)
    if weights is None:
        raise QuantConfigError(f"quantization_config.{where}.weights: missing")
    inputs = _args(group, "input_activations", where)
    if fmt == PACKED_FORMAT:
        return _int4_scheme(weights, inputs, where)
    return _fp8_scheme(weights, inputs, where)


def _args(group: dict[str, Any], key: str, where: str) -> dict[str, Any] | None:
    args = group.get(key)
    if args is not None and not isinstance(args, dict):
        raise QuantConfigError(f"quantization_config.{where}.{key}: {args!r} is not an object")
    return args


def _need(args: dict[str, Any], where: str, key: str, allowed: tuple, default: Any = None) -> Any:
    """``require`` on one field of a nested scheme, its error naming the field's whole path."""
    path = f"{where}.{key}"
    return require({path: args.get(key, default)}, path, allowed, default)


def _int4_scheme(weights: dict[str, Any], inputs: dict[str, Any] | None, where: str) -> _Scheme:
    w = f"{where}.weights"
    _need(weights, w, "type", ("int",), "int")
    _need(weights, w, "num_bits", (_PACK_BITS,))
    _need(weights, w, "dynamic", (False,), False)
    # "static" reorders columns while quantizing but stores no g_idx: groups stay contiguous.
    _need(weights, w, "actorder", (None, "static"))
    symmetric = _need(weights, w, "symmetric", (True, False), True)
    strategy = _need(weights, w, "strategy", ("group", "channel"))
    if inputs is not None:
        raise QuantConfigError(f"quantization_config.{where}.input_activations: {inputs!r} is "
                               f"not supported with pack-quantized (read as W4A16)")
    if strategy == "channel":
        return _Scheme(packed=True, symmetric=symmetric)
    group_size = weights.get("group_size")
    if not isinstance(group_size, int) or group_size <= 0:
        raise QuantConfigError(f"quantization_config.{w}.group_size: {group_size!r} is not a "
                               f"positive integer")
    return _Scheme(packed=True, symmetric=symmetric, group_size=group_size)


def _fp8_scheme(weights: dict[str, Any], inputs: dict[str, Any] | None, where: str) -> _Scheme:
    w, i = f"{where}.weights", f"{where}.input_activations"
    _need(weights, w, "type", ("float",))
    _need(weights, w, "num_bits", (8,))
    _need(weights, w, "symmetric", (True,), True)
    _need(weights, w, "dynamic", (False,), False)
    _need(weights, w, "strategy", ("tensor", "channel"))
    if inputs is None:
        return _Scheme(packed=False)
    _need(inputs, i, "type", ("float",))
    _need(inputs, i, "num_bits", (8,))
    _need(inputs, i, "symmetric", (True,), True)
    dynamic = _need(inputs, i, "dynamic", (True, False))
    _need(inputs, i, "strategy", ("token",) if dynamic else ("tensor",))
    return _Scheme(packed=False, static_inputs=not dynamic)
