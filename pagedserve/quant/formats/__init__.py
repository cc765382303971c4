"""Checkpoint formats, chosen from ``config.json``'s ``quantization_config`` and
``--quantization``; each module is imported only when its format is used."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pagedserve.quant.formats.base import CheckpointFormat, QuantConfigError, Tensors
from pagedserve.quant.weights import LoadedWeight, dequantize

# quant_method -> (module, class); each class has ``from_config(quantization_config)``.
_FORMATS = {
    "awq": ("pagedserve.quant.formats.awq", "AwqFormat"),
    "gptq": ("pagedserve.quant.formats.gptq", "GptqFormat"),
    "fp8": ("pagedserve.quant.formats.fp8", "Fp8Format"),
    "compressed-tensors": ("pagedserve.quant.formats.compressed_tensors",
                           "CompressedTensorsFormat"),
}
# auto: as the checkpoint is stored; none: dequantize every quantized weight at load;
# fp8: quantize a float checkpoint at load; a method's name: require that method.
QUANTIZATION_CHOICES = ("auto", "none", "fp8", *[m for m in _FORMATS if m != "fp8"], "gguf")


def checkpoint_format(hf_config: dict[str, Any], quantization: str,
                      gguf_blocks: bool) -> CheckpointFormat:
    """The reader for a checkpoint. ``gguf_blocks``: a converted GGUF folder holding its
    Q4_0/Q4_1/Q8_0 tensors as blocks. Raises ``QuantConfigError`` before any weight is read."""
    method = _stored_method(hf_config, gguf_blocks)
    if quantization not in ("auto", "none", "fp8") and quantization != method:
        raise QuantConfigError(f"--quantization {quantization} does not match the checkpoint, "
                               f"which is {method or 'not quantized'}")
    if quantization == "fp8" and method not in (None, "fp8"):
        raise QuantConfigError(f"--quantization fp8 quantizes a float checkpoint at load; this "
                               f"one is already quantized ({method})")
    if method is None:
        return CheckpointFormat()
    if method == "gguf":
        from pagedserve.quant.formats.gguf import GgufFormat

        fmt: CheckpointFormat = GgufFormat()
    else:
        module, cls = _FORMATS[method]
        fmt = getattr(importlib.import_module(module), cls).from_config(
            hf_config["quantization_config"])
    return Dequantized(fmt) if quantization == "none" else fmt


def load_quantizer(hf_config: dict[str, Any], quantization: str,
                   dummy: bool) -> Callable[[torch.Tensor], LoadedWeight] | None:
    """What the linear layers' dense weights become at load, if anything: FP8 for
    ``--quantization fp8`` on a float checkpoint; with ``--load-format dummy``, the random
    weights take the form ``--quantization`` names (4-bit in groups of 128 for awq, gptq and
    compressed-tensors, 4-bit in groups of 32 for gguf), so benchmarks of real shapes run the
    quantized kernels without files."""
    from pagedserve.quant.weights import Fp8Weight, GroupQuantWeight

    if quantization == "fp8" and (dummy or not hf_config.get("quantization_config")):
        return Fp8Weight.quantize
    if dummy and quantization not in ("auto", "none"):
        group = 32 if quantization == "gguf" else 128
        return functools.partial(GroupQuantWeight.quantize, bits=4, group_size=group)
    return None


def _stored_method(hf_config: dict[str, Any], gguf_blocks: bool) -> str | None:
    if gguf_blocks:
        return "gguf"
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise QuantConfigError(f"quantization_config: expected an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in _FORMATS:
        raise QuantConfigError(
            f"quantization_config.quant_method: {method!r} is not supported; supported: "
            f"{', '.join(_FORMATS)}")
    return method


class Dequantized(CheckpointFormat):
    """``--quantization none``: another format's weights, dequantized as they are read."""

    name = "none"

    def __init__(self, inner: CheckpointFormat) -> None:
        self.inner = inner

    def read(self, tensors: Tensors) -> Iterator[tuple[str, LoadedWeight]]:
        for name, weight in self.inner.read(tensors):
            yield name, dequantize(weight)
