"""How a linear layer holds its weight and multiplies by it: the seam between checkpoint
formats and device kernels.

A model's ``Linear`` collects its weight from the checkpoint (dense or quantized, see
``quant.weights``), then asks the platform for a method for that weight
(``Platform.linear_method``). The method turns the weight into the layout its kernel reads
fastest, once (``create_weights``), and multiplies activations by it on every step
(``apply``). The layer adds its bias.

A method that quantizes its activations before multiplying (FP8 W8A8) may offer that step to
the op before the layer (``input_quantizer``): an RMSNorm or a SwiGLU that writes quantized
activations directly saves a pass over them and a kernel launch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quant.weights import LoadedWeight, dequantize


@dataclass
class QuantizedActivation:
    """Activations already quantized the way a method's matmul reads them: ``values
    [T, K']`` (``K'`` may pad ``K``) with ``values * scales`` approximating the input;
    ``scales`` is ``[T, 1]`` (one per token) or 0-dim (one for all). ``dtype``: the
    activations' own, which the layer's output takes."""
    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


@dataclass(frozen=True)
class MatmulNumerics:
    """Where a platform's linear methods may trade accuracy for speed: the engine options of
    the same names (``EngineConfig``)."""
    int8_activations: bool = True
    fp8_fast_accumulation: bool = True


class InputQuantizer(ABC):
    """A linear method's input quantization, fused into the op that produces its input."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """``LayerOps.rms_norm`` with its output quantized: ``QuantizedActivation``, or
        ``(QuantizedActivation, residual)`` with ``residual``."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> QuantizedActivation:
        """``LayerOps.silu_and_mul`` of ``x [T, 2I]`` with its output quantized."""


class LinearMethod(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, weight: LoadedWeight, dtype: torch.dtype,
                       device: torch.device) -> None:
        """Register on ``layer`` the parameters or buffers ``apply`` reads, built from the
        loaded ``weight`` ``[N, K]``; ``dtype`` is the model's activation dtype."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x [T, K] @ W.T -> [T, N]`` in ``x``'s dtype; ``x`` may instead be the
        ``QuantizedActivation`` of this method's ``input_quantizer``."""

    def input_quantizer(self, layer: nn.Module, num_tokens: int) -> InputQuantizer | None:
        """How the op before this layer may hand it ``num_tokens`` rows already quantized;
        None (the default): it hands them as they are."""
        return None


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
