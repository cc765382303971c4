"""Linear layers whose weight arrives as output shards and is held however the platform says.

A fused projection (q/k/v, gate/up) receives one shard per checkpoint tensor, each dense or
quantized in its own format. Once every shard is in, the layer concatenates them
(``quant.weights.concat_shards``) and the platform's linear method for that kind of weight
builds what its kernel reads. Model code asks for a ``Linear`` and never names a format or a
device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.quant.linear_method import LinearMethod
from pagedserve.quant.weights import LoadedWeight, concat_shards

if TYPE_CHECKING:
    from pagedserve.platforms.interface import Platform


class LinearFactory:
    """What every ``Linear`` of one model shares: the platform (which picks each layer's
    method), the activation dtype, the device, and the quantizer that ``--quantization fp8``
    applies to dense weights at load (None: weights stay as the checkpoint has them)."""

    def __init__(self, platform: type[Platform], dtype: torch.dtype, device: torch.device,
                 quantizer: Callable[[torch.Tensor], LoadedWeight] | None = None) -> None:
        self.platform = platform
        self.dtype = dtype
        self.device = device
        self.quantizer = quantizer

    def __call__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 quantize_at_load: bool = True) -> Linear:
        return Linear(in_features, out_sizes, bias, self, quantize_at_load)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_sizes: list[int], bias: bool,
                 factory: LinearFactory, quantize_at_load: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.factory = factory
        self.quantize_at_load = quantize_at_load
        self.bias = (nn.Parameter(torch.zeros(sum(out_sizes), dtype=factory.dtype,
                                              device=factory.device), requires_grad=False)
                     if bias else None)
        self.method: LinearMethod | None = None
        self._shards: dict[int, LoadedWeight] = {}

    @property
    def loaded(self) -> bool:
        return self.method is not None

    def load_shard(self, shard: int, weight: LoadedWeight) -> None:
        """Take output shard ``shard`` (``[out_sizes[shard], in_features]``); the last one to
        arrive builds the layer's weight."""
        expected = (self.out_sizes[shard], self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight shard {shard} has shape {tuple(weight.shape)}, "
                             f"expected {expected}")
        self._shards[shard] = weight
        if len(self._shards) == len(self.out_sizes):
            self.set_weight(concat_shards([self._shards[i] for i in range(len(self.out_sizes))]))
            self._shards = {}

    def set_weight(self, weight: LoadedWeight) -> None:
        f = self.factory
        if f.quantizer is not None and self.quantize_at_load and isinstance(weight, torch.Tensor):
            weight = f.quantizer(weight)
        self.method = f.platform.linear_method(weight)
        self.method.create_weights(self, weight, f.dtype, f.device)

    def shard_offset(self, shard: int) -> int:
        return sum(self.out_sizes[:shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_sizes={self.out_sizes}, "
                f"method={type(self.method).__name__}")
