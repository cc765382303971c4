"""What every checkpoint format does: turn the checkpoint's tensors into loaded weights.

A quantized linear layer is stored as several tensors under its module name
(``<module>.qweight``, ``<module>.scales``, ...). ``PackedFormat`` gathers them per module and
yields one ``<module>.weight`` holding a ``quant.weights`` form; every other tensor passes
through unchanged, so norms, embeddings, biases and the layers a checkpoint left unquantized
load as they always do.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from pagedserve.quant.weights import LoadedWeight

Tensors = Iterable[tuple[str, torch.Tensor]]


class QuantConfigError(ValueError):
    """A ``quantization_config`` value, ``--quantization`` choice or quantized tensor we
    cannot load; the one-line message names the field (or tensor) and its value."""


def require(config: dict[str, Any], key: str, allowed: tuple, default: Any = None) -> Any:
    """``config[key]`` (or ``default`` when absent), checked against ``allowed``."""
    value = config.get(key, default)
    if value not in allowed:
        raise QuantConfigError(
            f"quantization_config.{key}: {value!r} is not supported; supported: "
            f"{', '.join(repr(a) for a in allowed)}")
    return value


class CheckpointFormat:
    """The unquantized format: tensors pass through as they are."""

    name: ClassVar[str] = "none"

    def read(self, tensors: Tensors) -> Iterator[tuple[str, LoadedWeight]]:
        yield from tensors


class PackedFormat(CheckpointFormat):
    """A format storing each quantized linear layer as several tensors, named
    ``<module>.<part>``. A module is complete once ``parts`` and ``optional_parts`` are all in;
    at the end of the checkpoint, modules with only ``parts`` are complete too."""

    parts: ClassVar[tuple[str, ...]]
    optional_parts: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def unpack(self, module: str, parts: dict[str, torch.Tensor]) -> LoadedWeight:
        """The weight ``[out_features, in_features]`` of ``module`` from its tensors."""

    def claims(self, module: str, part: str, tensor: torch.Tensor) -> bool:
        """Whether ``<module>.<part>`` belongs to a quantized layer (default: by its name)."""
        return part in self.parts or part in self.optional_parts

    def read(self, tensors: Tensors) -> Iterator[tuple[str, LoadedWeight]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        every_part = len(self.parts) + len(self.optional_parts)
        for name, tensor in tensors:
            module, _, part = name.rpartition(".")
            if not self.claims(module, part, tensor):
                yield name, tensor
                continue
            held = pending.setdefault(module, {})
            held[part] = tensor
            if len(held) == every_part:
                yield f"{module}.weight", self.unpack(module, pending.pop(module))
        for module, held in pending.items():
            missing = [p for p in self.parts if p not in held]
            if missing:
                raise QuantConfigError(
                    f"{self.name} checkpoint: {module} has no {module}.{missing[0]} tensor")
            yield f"{module}.weight", self.unpack(module, held)
