"""How a linear layer holds its weight and multiplies by it: the seam between checkpoint
formats and device kernels.

A model's ``Linear`` collects its weight from the checkpoint (dense or quantized, see
``quant.weights``), then asks the platform for a method for that weight
(``Platform.linear_method``). The method turns the weight into the layout its kernel reads
fastest, once (``create_weights``), and multiplies activations by it on every step
(``apply``). The layer adds its bias.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quant.weights import LoadedWeight, dequantize


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, weight: LoadedWeight, dtype: torch.dtype,
                       device: torch.device) -> None:
        """Register on ``layer`` the parameters or buffers ``apply`` reads, built from the
        loaded ``weight`` ``[N, K]``; ``dtype`` is the model's activation dtype."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K] @ W.T -> [T, N]`` in ``x``'s dtype."""


class DenseLinearMethod(LinearMethod):
    """A dense weight in the model's dtype; quantized weights are dequantized at load. The
    portable method every format loads through on every device."""

    def create_weights(self, layer, weight, dtype, device) -> None:
        dense = dequantize(weight).to(device=device, dtype=dtype)
        # A tied LM head arrives as the embedding's parameter and keeps sharing it.
        layer.weight = (dense if isinstance(dense, nn.Parameter)
                        else nn.Parameter(dense, requires_grad=False))

    def apply(self, layer, x):
        return F.linear(x, layer.weight)
