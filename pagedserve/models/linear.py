"""Linear layers whose weight arrives as output shards and is held however the platform says.

A fused projection (q/k/v, gate/up) receives one shard per checkpoint tensor, each dense or
quantized in its own format. Once every shard is in, the layer concatenates them
(``quant.weights.concat_shards``) and the platform's linear method for that kind of weight
builds what its kernel reads. Model code asks for a ``Linear`` and never names a format or a
device.

Under tensor parallelism (``pagedserve.distributed``) a layer keeps only its rank's part of
each checkpoint shard: column-parallel layers a slice of every output shard's rows (each rank
holds its own q heads, KV heads, gate and up rows), row-parallel layers a slice of the input
columns, their partial outputs summed by one all-reduce before the bias is added, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.distributed import Part, TensorParallel
from pagedserve.quant.linear_method import (
    InputQuantizer,
    LinearMethod,
    MatmulNumerics,
    QuantizedActivation,
)
from pagedserve.quant.weights import LoadedWeight, concat_shards, take_columns, take_rows

if TYPE_CHECKING:
    from pagedserve.platforms.interface import Platform


class LinearFactory:
    """What every ``Linear`` of one model shares: the platform (which picks each layer's
    method), the activation dtype, the device, and the quantizer that ``--quantization fp8``
    applies to dense weights at load (None: weights stay as the checkpoint has them), the
    rank's place in tensor parallelism, and where methods may trade accuracy for speed
    (``MatmulNumerics``)."""

    def __init__(self, platform: type[Platform], dtype: torch.dtype, device: torch.device,
                 quantizer: Callable[[torch.Tensor], LoadedWeight] | None = None,
                 tp: TensorParallel = TensorParallel(),
                 numerics: MatmulNumerics = MatmulNumerics()) -> None:
        self.platform = platform
        self.dtype = dtype
        self.device = device
        self.quantizer = quantizer
        self.tp = tp
        self.numerics = numerics

    def column(self, in_features: int, out_parts: list[Part], bias: bool = False,
               quantize_at_load: bool = True) -> Linear:
        """Output shards cut to ``out_parts`` rows; every rank sees the whole input."""
        return Linear(Part.whole(in_features), out_parts, bias, self, quantize_at_load)

    def row(self, in_features: int, out_features: int, reduce: bool = True) -> Linear:
        """Input columns cut evenly across ranks; outputs summed over ranks (``reduce=False``:
        the caller adds this rank's partial output to others' and sums them once)."""
        return Linear(self.tp.even_part(in_features), [Part.whole(out_features)], False, self,
                      reduce=reduce and self.tp.size > 1)


class Linear(nn.Module):
    def __init__(self, in_part: Part, out_parts: list[Part], bias: bool,
                 factory: LinearFactory, quantize_at_load: bool = True,
                 reduce: bool = False) -> None:
        super().__init__()
        self.in_part = in_part
        self.out_parts = list(out_parts)
        self.in_features = in_part.size
        self.out_sizes = [p.size for p in out_parts]
        self.factory = factory
        self.quantize_at_load = quantize_at_load
        self.reduce = reduce
        self.bias = (nn.Parameter(torch.zeros(sum(self.out_sizes), dtype=factory.dtype,
                                              device=factory.device), requires_grad=False)
                     if bias else None)
        self.method: LinearMethod | None = None
        self._shards: dict[int, LoadedWeight] = {}

    @property
    def loaded(self) -> bool:
        return self.method is not None

    def load_shard(self, shard: int, weight: LoadedWeight) -> None:
        """Take output shard ``shard`` as the checkpoint stores it and keep this rank's part;
        the last one to arrive builds the layer's weight."""
        out, inp = self.out_parts[shard], self.in_part
        expected = (out.full, inp.full)
        if tuple(weight.shape) != expected:
            raise ValueError(f"weight shard {shard} has shape {tuple(weight.shape)}, "
                             f"expected {expected}")
        if not out.is_whole:
            weight = take_rows(weight, out.start, out.size)
        if not inp.is_whole:
            weight = take_columns(weight, inp.start, inp.size)
        self._shards[shard] = weight
        if len(self._shards) == len(self.out_sizes):
            self.set_weight(concat_shards([self._shards[i] for i in range(len(self.out_sizes))]))
            self._shards = {}

    def set_weight(self, weight: LoadedWeight) -> None:
        f = self.factory
        if f.quantizer is not None and self.quantize_at_load and isinstance(weight, torch.Tensor):
            weight = f.quantizer(weight)
        self.method = f.platform.linear_method(weight, f.numerics)
        self.method.create_weights(self, weight, f.dtype, f.device)

    def load_bias(self, shard: int, bias: torch.Tensor) -> None:
        part = self.out_parts[shard]
        if tuple(bias.shape) != (part.full,):
            raise ValueError(f"bias shard {shard} has shape {tuple(bias.shape)}, "
                             f"expected ({part.full},)")
        offset = sum(self.out_sizes[:shard])
        self.bias[offset:offset + part.size].copy_(take_rows(bias, part.start, part.size))

    def input_quantizer(self, num_tokens: int) -> InputQuantizer | None:
        """The op before this layer may quantize its output with this (then hand over a
        ``QuantizedActivation``); None: it hands over plain activations."""
        return self.method.input_quantizer(self, num_tokens)

    def forward(self, x: torch.Tensor | QuantizedActivation,
                lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """``lora_slots`` (``ForwardContext.lora_slots``) is read by the LoRA wrapper
        (``lora/layers.py``); a plain layer has no adapters."""
        return self.finish(self.method.apply(self, x))

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's matmul output to the layer's: summed over ranks, then the bias (LoRA
        adds its delta before, so a row-parallel delta is summed with the base output)."""
        if self.reduce:
            out = self.factory.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_sizes={self.out_sizes}, "
                f"method={type(self.method).__name__}")
